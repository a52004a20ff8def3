"""AMP on vs off for every zoo model on CPU (bf16): step time, measured and estimated peak memory, casts.

Both variants train deep copies of one initialised model; steps are interleaved (order rotating) so
machine noise lands on both alike. Memory comes from separate trainers built with
`measure_memory=True` (its bookkeeping would distort the timing), read through `trainer.memory_stats()`.
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from step_time import make_batches, timed  # noqa: E402
from zoo import OPTIMIZERS, ZOO, ZooEntry  # noqa: E402

import fleetc  # noqa: E402

VARIANTS = ("fp32", "amp")


def _trainer(base: torch.nn.Module, entry: ZooEntry, optimizer: str, amp: bool, measure_memory: bool):
    model = copy.deepcopy(base)
    strategy = fleetc.DistributedStrategy()
    strategy.amp = amp
    return fleetc.compile(model, strategy, optimizer=OPTIMIZERS[optimizer](model.parameters()),
                          loss_fn=entry.loss_fn, measure_memory=measure_memory)


def bench_model(entry: ZooEntry, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    base = entry.make_model()
    batches = make_batches(entry, args.warmup + args.steps, args.batch_scale)
    timers = {v: _trainer(base, entry, args.optimizer, v == "amp", False) for v in VARIANTS}
    for b_args, b_kwargs in batches[:args.warmup]:  # the first step compiles
        for trainer in timers.values():
            trainer.step(*b_args, **b_kwargs)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i, (b_args, b_kwargs) in enumerate(batches[args.warmup:]):
        for v in VARIANTS[i % 2:] + VARIANTS[:i % 2]:
            times[v].append(timed(timers[v].step, b_args, b_kwargs))
    memory = {}
    for v in VARIANTS:
        trainer = _trainer(base, entry, args.optimizer, v == "amp", True)
        for b_args, b_kwargs in batches[:2]:
            trainer.step(*b_args, **b_kwargs)
        memory[v] = trainer.memory_stats()
    return {"ms": {v: 1e3 * statistics.median(t) for v, t in times.items()}, "memory": memory,
            "casts": timers["amp"].report().stats["amp"].get("casts", 0)}


def print_table(results: dict[str, dict]) -> None:
    header = ["model", "fp32 ms", "amp ms", "amp/fp32", "fp32 peak MiB", "amp peak MiB", "amp/fp32 peak",
              "est. fp32→amp MiB", "casts"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    mib = 2**20
    for name, r in results.items():
        ms, mem = r["ms"], r["memory"]
        peak = {v: mem[v]["measured_peak_bytes"] for v in VARIANTS}
        est = {v: mem[v]["estimated_peak_bytes"] / mib for v in VARIANTS}
        print(f"| {name} | {ms['fp32']:.2f} | {ms['amp']:.2f} | {ms['amp'] / ms['fp32']:.2f}x | "
              f"{peak['fp32'] / mib:.2f} | {peak['amp'] / mib:.2f} | {peak['amp'] / peak['fp32']:.2f}x | "
              f"{est['fp32']:.2f}→{est['amp']:.2f} | {r['casts']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(ZOO), help="comma-separated zoo names")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one compiles)")
    parser.add_argument("--batch-scale", type=int, default=1, help="concatenate K zoo batches into one")
    args = parser.parse_args()
    args.warmup = max(args.warmup, 2)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, optimizer {args.optimizer}, "
          f"batch x{args.batch_scale}, bf16 AMP, median of {args.steps} interleaved steps after {args.warmup} warmup")
    results = {}
    for name in args.models.split(","):
        results[name] = bench_model(ZOO[name], args)
        print(f"  {name} done", file=sys.stderr, flush=True)
    print_table(results)


if __name__ == "__main__":
    main()
