"""Training step time of every zoo model: eager PyTorch vs fleetc (vs torch.compile), measured interleaved."""
from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from conftest import eager_step  # noqa: E402  (the reference eager step the differential tests use)
from zoo import OPTIMIZERS, ZOO, ZooEntry  # noqa: E402

import fleetc  # noqa: E402


def make_batches(entry: ZooEntry, count: int, scale: int) -> list[tuple[tuple, dict]]:
    """`count` batches, each `scale` zoo batches concatenated along dim 0 (every zoo batch is batch-first)."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        parts = [entry.make_batch(g) for _ in range(scale)]
        args = tuple(torch.cat([p[0][i] for p in parts]) for i in range(len(parts[0][0])))
        kwargs = {k: torch.cat([p[1][k] for p in parts]) for k in parts[0][1]}
        batches.append((args, kwargs))
    return batches


def timed(fn: Callable, args: tuple, kwargs: dict) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def step_runners(entry: ZooEntry, optimizer: str, with_torch_compile: bool) -> tuple[dict[str, Callable], object]:
    """One training-step callable per variant, each on its own deep copy of the same initialised model."""
    base = entry.make_model()
    runners = {}
    model = copy.deepcopy(base)
    opt = OPTIMIZERS[optimizer](model.parameters())
    runners["eager"] = lambda *a, **k: eager_step(model, opt, entry.loss_fn, a, k)

    f_model = copy.deepcopy(base)
    trainer = fleetc.compile(f_model, optimizer=OPTIMIZERS[optimizer](f_model.parameters()), loss_fn=entry.loss_fn)
    runners["fleetc"] = trainer.step

    if with_torch_compile:
        t_model = copy.deepcopy(base)
        t_opt = OPTIMIZERS[optimizer](t_model.parameters())
        t_compiled = torch.compile(t_model)
        runners["torch.compile"] = lambda *a, **k: eager_step(t_compiled, t_opt, entry.loss_fn, a, k)
    return runners, trainer


def bench_model(entry: ZooEntry, args: argparse.Namespace) -> dict:
    runners, trainer = step_runners(entry, args.optimizer, args.torch_compile)
    batches = make_batches(entry, args.warmup + args.steps, args.batch_scale)
    first = {name: timed(run, *batches[0]) for name, run in runners.items()}  # compiles fleetc / torch.compile
    for b_args, b_kwargs in batches[1:args.warmup]:
        for run in runners.values():
            run(*b_args, **b_kwargs)
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for i, (b_args, b_kwargs) in enumerate(batches[args.warmup:]):
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotate so no variant always runs first
            times[name].append(timed(runners[name], b_args, b_kwargs))
    report = trainer.report()
    return {"median_ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
            "first_s": first, "compile_s": report.compile_seconds,
            "ops": (report.ops_before, report.ops_after)}


def print_table(results: dict[str, dict], with_torch_compile: bool) -> None:
    header = ["model", "eager ms", "fleetc ms", "fleetc/eager"]
    if with_torch_compile:
        header += ["t.compile ms", "fleetc/t.compile", "t.compile 1st s"]
    header += ["fleetc compile s", "fleetc 1st s", "ops before→after"]
    rows = []
    for name, r in results.items():
        ms = r["median_ms"]
        row = [name, f"{ms['eager']:.2f}", f"{ms['fleetc']:.2f}", f"{ms['fleetc'] / ms['eager']:.2f}x"]
        if with_torch_compile:
            row += [f"{ms['torch.compile']:.2f}", f"{ms['fleetc'] / ms['torch.compile']:.2f}x",
                    f"{r['first_s']['torch.compile']:.1f}"]
        row += [f"{r['compile_s']:.2f}", f"{r['first_s']['fleetc']:.2f}", "{}→{}".format(*r["ops"])]
        rows.append(row)
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(ZOO), help="comma-separated zoo names")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (the first one compiles)")
    parser.add_argument("--torch-compile", action="store_true", help="also time torch.compile (slow to compile)")
    parser.add_argument("--batch-scale", type=int, default=1, help="concatenate K zoo batches into one")
    args = parser.parse_args()
    args.warmup = max(args.warmup, 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, optimizer {args.optimizer}, "
          f"batch x{args.batch_scale}, median of {args.steps} steps after {args.warmup} warmup")
    results = {}
    for name in args.models.split(","):
        results[name] = bench_model(ZOO[name], args)
        print(f"  {name} done", file=sys.stderr, flush=True)
    print_table(results, args.torch_compile)


if __name__ == "__main__":
    main()
