"""The per-step guard check alone (timeit) of every zoo model, against the smallest zoo training step.

The goal (issue 23): the guard check costs under 2% of the smallest zoo step. Each model is compiled and
stepped once; then `GuardCheck.passes()` of its training step is timed with timeit (best of `--repeat` runs of
`--number` calls), and the fleetc training step with the same method, in the same run.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import timeit

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from zoo import OPTIMIZERS, ZOO  # noqa: E402

import fleetc  # noqa: E402


def best_seconds(fn, number: int, repeat: int) -> float:
    """Seconds per call: the best of `repeat` timeit runs of `number` calls (the least disturbed run)."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def measure(name: str, optimizer: str, number: int, repeat: int) -> dict:
    entry = ZOO[name]
    model = entry.make_model()
    trainer = fleetc.compile(model, optimizer=OPTIMIZERS[optimizer](model.parameters()), loss_fn=entry.loss_fn)
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(0))
    trainer.step(*args, **kwargs)
    guards = trainer._last_train.guards
    assert guards.passes(), "the guards of an unchanged model must pass"
    counts = {kind: len(guards.record.of_kind(kind)) for kind in ("training", "attribute", "tensor", "requires_grad")}
    return {"guard_us": 1e6 * best_seconds(guards.passes, number, repeat),
            "step_ms": 1e3 * best_seconds(lambda: trainer.step(*args, **kwargs), max(1, number // 200), repeat),
            "guards": len(guards.record.guards), "counts": counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(ZOO), help="comma-separated zoo names")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--number", type=int, default=20000, help="guard checks per timeit run")
    parser.add_argument("--repeat", type=int, default=5, help="timeit runs (the best counts)")
    args = parser.parse_args()
    results = {name: measure(name, args.optimizer, args.number, args.repeat) for name in args.models.split(",")}
    smallest = min(r["step_ms"] for r in results.values())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, optimizer {args.optimizer}; "
          f"smallest zoo step {smallest:.3f} ms")
    print("| model | guards | guard check µs | step ms | check / own step | check / smallest step |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['guards']} | {r['guard_us']:.2f} | {r['step_ms']:.3f} | "
              f"{r['guard_us'] / (10 * r['step_ms']):.2f}% | {r['guard_us'] / (10 * smallest):.2f}% |")


if __name__ == "__main__":
    main()
