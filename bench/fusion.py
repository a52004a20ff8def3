"""Op counts before/after the named fusion passes per zoo model, and CPU step time with fusion on vs off.

Run from the repository root: `OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/tests python bench/fusion.py [--steps N]`.
Both trainers run side by side in one process, alternating rounds; each reports its fastest round, the figure
least disturbed by other work on a shared machine.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.passes.order import fusion_flags


def _strategy(on: bool) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    for flag in fusion_flags():
        setattr(strategy.build_strategy, flag, on)
    return strategy


def _trainer(zoo_name: str, optimizer_name: str, fused: bool):
    entry = ZOO[zoo_name]
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, _strategy(fused), optimizer=OPTIMIZERS[optimizer_name](model.parameters()),
                             loss_fn=entry.loss_fn)
    return trainer


def _time_steps(trainer, args, kwargs, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step(*args, **kwargs)
    return (time.perf_counter() - start) / steps


def bench(zoo_name: str, optimizer_name: str, steps: int, rounds: int) -> dict:
    args, kwargs = ZOO[zoo_name].make_batch(torch.Generator().manual_seed(1))
    off, on = _trainer(zoo_name, optimizer_name, False), _trainer(zoo_name, optimizer_name, True)
    for trainer in (off, on):
        trainer.step(*copy.deepcopy(args), **kwargs)  # compile + warm up
    times = {"off": [], "on": []}
    for _ in range(rounds):
        times["off"].append(_time_steps(off, args, kwargs, steps))
        times["on"].append(_time_steps(on, args, kwargs, steps))
    return {"model": zoo_name, "captured": off.report().ops_before, "ops_off": off.program.num_ops(),
            "ops_on": on.program.num_ops(), "ms_off": 1e3 * min(times["off"]), "ms_on": 1e3 * min(times["on"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="steps per timing round")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds; the fastest is reported")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    opts = parser.parse_args()
    print(f"| model | captured ops | ops, fusion off | ops, fusion on | step ms, off | step ms, on | on/off |")
    print("|---|---|---|---|---|---|---|")
    for zoo_name in ZOO:
        r = bench(zoo_name, opts.optimizer, opts.steps, opts.rounds)
        print(f"| {r['model']} | {r['captured']} | {r['ops_off']} | {r['ops_on']} | {r['ms_off']:.2f} | "
              f"{r['ms_on']:.2f} | {r['ms_on'] / r['ms_off']:.2f} |")


if __name__ == "__main__":
    main()
