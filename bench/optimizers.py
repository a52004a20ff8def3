"""Training-step time with AdamW: fleetc's traced update vs its hand-written one (plain and fused), and eager torch
with torch.optim's single-tensor, foreach and fused AdamW.

Run from the repository root: `OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/tests python bench/optimizers.py [--steps N]`.
All variants train their own copy of one model side by side in one process, in alternating rounds; each reports
its fastest round, the figure least disturbed by other work on a shared machine.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import time

import torch
from conftest import eager_step
from zoo import ZOO

import fleetc
from fleetc.capture.optimizer import traced_updates_only

LR = 1e-3


def _fleetc(model, fused: bool, traced: bool, args, kwargs, loss_fn):
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.fuse_all_optimizer_ops = fused
    trainer = fleetc.compile(model, strategy, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), loss_fn=loss_fn)
    with traced_updates_only() if traced else contextlib.nullcontext():
        trainer.step(*args, **kwargs)  # compiles
    return lambda: trainer.step(*args, **kwargs)


def _eager(model, option: dict, args, kwargs, loss_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **option)
    return lambda: eager_step(model, opt, loss_fn, args, kwargs)


def variants(zoo_name: str) -> dict:
    entry = ZOO[zoo_name]
    torch.manual_seed(0)
    base = entry.make_model()
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(1))
    fn = entry.loss_fn
    return {
        "fleetc traced": _fleetc(copy.deepcopy(base), False, True, args, kwargs, fn),
        "fleetc hand-written": _fleetc(copy.deepcopy(base), False, False, args, kwargs, fn),
        "fleetc hand-written fused": _fleetc(copy.deepcopy(base), True, False, args, kwargs, fn),
        "eager single-tensor": _eager(copy.deepcopy(base), {"foreach": False}, args, kwargs, fn),
        "eager foreach": _eager(copy.deepcopy(base), {"foreach": True}, args, kwargs, fn),
        "eager fused": _eager(copy.deepcopy(base), {"fused": True}, args, kwargs, fn),
    }


def bench(zoo_name: str, steps: int, rounds: int) -> dict[str, float]:
    runs = variants(zoo_name)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, step in runs.items():
            step()  # warm
            start = time.perf_counter()
            for _ in range(steps):
                step()
            best[name] = min(best[name], (time.perf_counter() - start) / steps * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,gpt")
    parser.add_argument("--steps", type=int, default=30, help="steps per timing round")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds; the fastest is reported")
    args = parser.parse_args()
    results = {name: bench(name, args.steps, args.rounds) for name in args.models.split(",")}
    columns = list(next(iter(results.values())))
    print("| model | " + " | ".join(f"{c} ms" for c in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, times in results.items():
        print(f"| {name} | " + " | ".join(f"{times[c]:.2f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
