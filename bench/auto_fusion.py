"""Auto fusion on the zoo: op counts before/after and CPU training-step time with the pass on vs off.

Run from the repository root (the machine is shared; pin threads for steadier numbers):
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/tests python bench/auto_fusion.py [--steps 200]
Both trainers train copies of one model on the same batch; steps are interleaved (one off, one on, the
order alternating), so load on the machine lands on both sides alike; each figure is the median step
time and the ratio is median(on) / median(off).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from zoo import OPTIMIZERS, ZOO

import fleetc


def trainer_for(model: torch.nn.Module, entry, optimizer_name: str, on: bool) -> fleetc.CompiledTrainer:
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.enable_auto_fusion = on
    return fleetc.compile(model, strategy, optimizer=OPTIMIZERS[optimizer_name](model.parameters()),
                          loss_fn=entry.loss_fn)


def time_step(trainer: fleetc.CompiledTrainer, args: tuple, kwargs: dict) -> float:
    start = time.perf_counter()
    trainer.step(*args, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per side after compiling")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    options = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), optimizer {options.optimizer}, "
          f"{options.steps} interleaved steps per side, medians")
    print(f"{'model':<13} {'ops off':>7} {'ops on':>6} {'groups':>6} {'fused':>5} "
          f"{'off us/step':>11} {'on us/step':>10} {'on/off':>6}")
    for name, entry in ZOO.items():
        torch.manual_seed(0)
        model = entry.make_model()
        args, kwargs = entry.make_batch(torch.Generator().manual_seed(1))
        off = trainer_for(copy.deepcopy(model), entry, options.optimizer, on=False)
        on = trainer_for(copy.deepcopy(model), entry, options.optimizer, on=True)
        for _ in range(options.warmup + 1):  # the first step compiles
            time_step(off, args, kwargs), time_step(on, args, kwargs)
        times: dict[str, list[float]] = {"off": [], "on": []}
        for i in range(options.steps):
            order = (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off))
            for side, trainer in order:
                times[side].append(time_step(trainer, args, kwargs))
        t_off, t_on = statistics.median(times["off"]), statistics.median(times["on"])
        stats = on.report().stats.get("auto_fusion", {})
        print(f"{name:<13} {off.program.num_ops():>7} {on.program.num_ops():>6} {stats.get('groups', 0):>6} "
              f"{stats.get('ops_fused', 0):>5} {t_off * 1e6:>11.0f} {t_on * 1e6:>10.0f} {t_on / t_off:>6.3f}")


if __name__ == "__main__":
    main()
