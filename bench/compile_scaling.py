"""Compile time against depth: nn.TransformerEncoder stacks (issue 25's model) from 2 to 64 layers.

For each depth and strategy (default; every fusion + recompute "auto") the first `step()` of a fresh trainer in
a fresh process is split into:
- torch tracing: `aot_export_joint_with_descriptors` (the whole-step trace) plus the optimizer's `make_fx`;
- capture: the rest of `capture_train_program` (FX graph → Program, hooks, optimizer lowering);
- passes: the pass manager's run (the sum of the passes' own seconds);
- codegen: building the Executable (code generation and kernel loading);
and `warm` is a second compile of a fresh copy of the model in the same process (torch's and the code
generator's in-memory caches warm). The on-disk compile cache (docs/compile_cache.md) is timed in three more fresh
processes sharing one cache directory: the first fills it (`compile_cache="capture"`), then `cache_passes` is a
compile that captures again and loads the passes' result (`"passes"`), and `cache_capture` one that skips capture
too (`"capture"`); `cache_capture_cpu` is that process's CPU time over its first step (the compile and one run of
the step), which a loaded machine inflates far less than wall time. Growth exponents are least-squares fits
of log(time) on log(depth) over depths >= 8 (smaller ones are dominated by fixed costs).
torch.compile's cold first step (forward compiled, eager backward and optimizer) is timed only at the depths
given by --torch-compile, each in a fresh process with a fresh Inductor cache directory.

    OMP_NUM_THREADS=2 PYTHONPATH=.:tests python bench/compile_scaling.py [--depths 2,4,8,16,32,64]
        [--strategies default,all_passes] [--torch-compile 8,32]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _timed(module, attr: str, bucket: dict, key: str) -> None:
    """Wrap `module.attr` so its wall time adds to bucket[key]."""
    original = getattr(module, attr)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            bucket[key] = bucket.get(key, 0.0) + time.perf_counter() - start

    setattr(module, attr, wrapper)


def _one_compile(depth: int, strategy_name: str, compile_cache: str = "off") -> dict:
    from helpers.scaling import STRATEGIES, encoder_and_batch

    import fleetc

    model, optimizer, batch = encoder_and_batch(depth)
    trainer = fleetc.compile(model, STRATEGIES[strategy_name](), optimizer=optimizer, compile_cache=compile_cache)
    start, cpu = time.perf_counter(), time.process_time()
    trainer.step(*batch)
    first, first_cpu = time.perf_counter() - start, time.process_time() - cpu
    passes = sum(record.seconds for record in trainer.history[1:])
    return {"first_step": first, "first_step_cpu": first_cpu, "compile": trainer.report().compile_seconds,
            "passes": passes,
            "ops": trainer.report().ops_before, "cache": trainer.report().cache}


def measure_fleetc(depth: int, strategy_name: str) -> dict:
    """Run in a fresh process (`--child`): cold split, then a warm compile."""
    import fleetc.capture
    import fleetc.capture.optimizer_trace
    import fleetc.compiler

    spent: dict[str, float] = {}
    _timed(fleetc.capture, "trace_step", spent, "torch_tracing")
    _timed(fleetc.capture.optimizer_trace, "make_fx", spent, "torch_tracing")
    _timed(fleetc.compiler, "capture_train_program", spent, "capture_total")
    _timed(fleetc.compiler, "Executable", spent, "codegen")
    cold = _one_compile(depth, strategy_name)
    result = {"depth": depth, "strategy": strategy_name, "ops": cold["ops"],
              "torch_tracing": spent["torch_tracing"], "capture": spent["capture_total"] - spent["torch_tracing"],
              "passes": cold["passes"], "codegen": spent["codegen"], "cold_compile": cold["compile"],
              "cold_first_step": cold["first_step"]}
    result["warm_compile"] = _one_compile(depth, strategy_name)["compile"]
    return result


def measure_torch_compile(depth: int) -> dict:
    import torch
    from helpers.scaling import encoder_and_batch

    model, optimizer, batch = encoder_and_batch(depth)
    compiled = torch.compile(model)
    start = time.perf_counter()
    optimizer.zero_grad()
    compiled(*batch).backward()
    optimizer.step()
    return {"depth": depth, "torch_compile_first_step": time.perf_counter() - start}


def measure_cached(depth: int, strategy_name: str, mode: str) -> dict:
    """One compile in a fresh process with the on-disk compile cache in `mode` ($FLEETC_CACHE_DIR is shared)."""
    result = _one_compile(depth, strategy_name, mode)
    return {"compile": result["compile"], "first_step_cpu": result["first_step_cpu"], "cache": result["cache"]}


def warm_cache(depth: int, strategy: str) -> dict:
    """Compile seconds of a process that loads the passes' result, and of one that skips capture too."""
    with tempfile.TemporaryDirectory() as fleetc_cache:
        extra = {"FLEETC_CACHE_DIR": fleetc_cache}
        _child("cached-capture", depth, strategy, extra)  # fills the cache
        runs = {mode: _child(f"cached-{mode}", depth, strategy, extra) for mode in ("passes", "capture")}
    expected = {"passes": ["passes: hit"], "capture": ["capture: hit", "passes: hit"]}
    for mode, run in runs.items():
        if [line.split(",")[0].split(" (")[0] for line in run["cache"]] != expected[mode]:
            raise RuntimeError(f"the warm {mode} run did not hit the cache: {run['cache']}")
    return {"cache_passes": runs["passes"]["compile"], "cache_capture": runs["capture"]["compile"],
            "cache_capture_cpu": runs["capture"]["first_step_cpu"]}


def _child(kind: str, depth: int, strategy: str, extra_env: dict[str, str] | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", **(extra_env or {}))
    with tempfile.TemporaryDirectory() as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        out = subprocess.run([sys.executable, __file__, "--child", kind, str(depth), strategy], env=env,
                             check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def exponent(depths: list[int], seconds: list[float]) -> float:
    """Least-squares slope of log(seconds) on log(depth)."""
    xs, ys = [math.log(d) for d in depths], [math.log(max(s, 1e-6)) for s in seconds]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


PARTS = ("torch_tracing", "capture", "passes", "codegen", "cold_compile", "warm_compile", "cache_passes",
         "cache_capture", "cache_capture_cpu")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", default="2,4,8,16,32,64")
    parser.add_argument("--strategies", default="default,all_passes")
    parser.add_argument("--torch-compile", default="8,32", help="depths to time torch.compile at ('' for none)")
    parser.add_argument("--child", nargs=3)
    args = parser.parse_args()
    if args.child:
        kind, depth, strategy = args.child
        if kind.startswith("cached-"):
            result = measure_cached(int(depth), strategy, kind.removeprefix("cached-"))
        else:
            result = measure_fleetc(int(depth), strategy) if kind == "fleetc" else measure_torch_compile(int(depth))
        print(json.dumps(result))
        return
    depths = [int(d) for d in args.depths.split(",")]
    for strategy in args.strategies.split(","):
        rows = []
        print(f"\n{strategy}: seconds (fresh process per depth)")
        print(f"{'depth':>5} {'ops':>6} " + " ".join(f"{p:>13}" for p in PARTS))
        for depth in depths:
            row = _child("fleetc", depth, strategy) | warm_cache(depth, strategy)
            rows.append(row)
            print(f"{depth:>5} {row['ops']:>6} " + " ".join(f"{row[p]:>13.2f}" for p in PARTS), flush=True)
        fit = [r for r in rows if r["depth"] >= 8] or rows
        if len(fit) >= 2:
            print("exponent (depth >= 8): " + ", ".join(
                f"{p} {exponent([r['depth'] for r in fit], [r[p] for r in fit]):.2f}" for p in PARTS))
    for depth in (int(d) for d in args.torch_compile.split(",") if d):
        seconds = _child("torch", depth, "-")["torch_compile_first_step"]
        print(f"torch.compile cold first step, depth {depth}: {seconds:.2f} s", flush=True)

if __name__ == "__main__":
    main()
