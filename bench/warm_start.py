"""Where a warm start with capture skipped spends its CPU (issue 25's goal: at most 0.5 s at any depth).

For each strategy and depth, one process fills a fresh `$FLEETC_CACHE_DIR` (`compile_cache="capture"`, a cold
compile), then `--repeats` fresh processes each compile the same model from it (capture and passes both hit) and run
one step. Each of those is split by phase in process CPU time (`time.process_time`), which a loaded machine inflates
far less than wall time; a phase's time excludes the phases nested in it:
- capture key: fingerprinting the model's code, config and inputs;
- capture entry: reading the capture entry and decoding its Program's metadata and guard record;
- guard check: comparing the guard record and attribute reads with the live model, observing the guards again
  after binding, and arming the per-step guard check;
- passes key, passes entry: hashing the captured Program's text; reading and decoding the final Program;
- emit, py compile: generating the step's Python source, and CPython compiling it;
- binding: binding parameters and optimizer state to the Program's Vars;
- compile other: the rest of the compile;
- state init, run: creating the optimizer state on the first step, and running the step itself.
`compile` is the sum of the compile's phases (the goal's figure); `first step` adds the two run phases. The run
with the lowest `first step` is shown.

    OMP_NUM_THREADS=1 PYTHONPATH=.:tests python bench/warm_start.py [--depths 2,8,32]
        [--strategies default,all_passes] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

COMPILE_PHASES = ("capture key", "capture entry", "guard check", "passes key", "passes entry", "emit", "py compile",
                  "binding", "compile other")
RUN_PHASES = ("state init", "run")


class PhaseClock:
    """Process CPU time by phase; a wrapped call's time goes to its phase minus the wrapped calls nested in it."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self._stack: list[list] = []  # [phase, start, time taken by nested phases]

    def wrap(self, owner, attr: str, phase: str, static: bool = False) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            self._stack.append([phase, time.process_time(), 0.0])
            try:
                return original(*args, **kwargs)
            finally:
                name, start, nested = self._stack.pop()
                total = time.process_time() - start
                self.spent[name] = self.spent.get(name, 0.0) + total - nested
                if self._stack:
                    self._stack[-1][2] += total

        setattr(owner, attr, staticmethod(timed) if static else timed)


def measure_warm(depth: int, strategy_name: str) -> dict:
    """In a fresh process whose cache is filled: one compile + first step, split by phase."""
    from helpers.scaling import STRATEGIES, encoder_and_batch

    import fleetc
    import fleetc.compiler
    import fleetc.runtime.executor
    import fleetc.runtime.pycodegen
    from fleetc.compile_cache import CompileCache
    from fleetc.runtime.state import StateBinding

    clock = PhaseClock()
    clock.wrap(CompileCache, "capture_key", "capture key")
    clock.wrap(CompileCache, "load_capture", "capture entry")
    clock.wrap(CompileCache, "_guard_mismatch", "guard check", static=True)
    clock.wrap(fleetc.compiler, "observe_guards", "guard check")
    clock.wrap(fleetc.compiler, "GuardCheck", "guard check")
    clock.wrap(CompileCache, "passes_key", "passes key")
    clock.wrap(CompileCache, "load_passes", "passes entry")
    clock.wrap(fleetc.compiler, "Executable", "emit")
    fleetc.runtime.pycodegen.compile = compile  # a module global shadowing the builtin, so it can be wrapped
    clock.wrap(fleetc.runtime.pycodegen, "compile", "py compile")
    clock.wrap(fleetc.compiler, "StateBinding", "binding")
    clock.wrap(fleetc.compiler.CompiledTrainer, "_compile", "compile other")
    clock.wrap(StateBinding, "resolve", "state init")
    clock.wrap(fleetc.compiler.CompiledTrainer, "step", "run")

    model, optimizer, batch = encoder_and_batch(depth)
    trainer = fleetc.compile(model, STRATEGIES[strategy_name](), optimizer=optimizer, compile_cache="capture")
    start = time.perf_counter()
    trainer.step(*batch)
    wall = time.perf_counter() - start
    hits = [line.split(",")[0].split(" (")[0] for line in trainer.report().cache]
    if hits != ["capture: hit", "passes: hit"]:
        raise RuntimeError(f"the warm start did not hit the cache: {trainer.report().cache}")
    phases = {phase: clock.spent.get(phase, 0.0) for phase in COMPILE_PHASES + RUN_PHASES}
    return {"ops": trainer.report().ops_before, "phases": phases, "wall": wall,
            "compile": sum(phases[p] for p in COMPILE_PHASES), "first_step": sum(phases.values())}


def fill(depth: int, strategy_name: str) -> dict:
    from helpers.scaling import STRATEGIES, encoder_and_batch

    import fleetc

    model, optimizer, batch = encoder_and_batch(depth)
    trainer = fleetc.compile(model, STRATEGIES[strategy_name](), optimizer=optimizer, compile_cache="capture")
    trainer.step(*batch)
    return {"cache": trainer.report().cache}


def _child(kind: str, depth: int, strategy: str, cache_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", FLEETC_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(depth), strategy], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", default="2,8,32")
    parser.add_argument("--strategies", default="default,all_passes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=3)
    args = parser.parse_args()
    if args.child:
        kind, depth, strategy = args.child
        print(json.dumps(fill(int(depth), strategy) if kind == "fill" else measure_warm(int(depth), strategy)))
        return
    print(f"warm start with capture skipped: process CPU seconds by phase, best of {args.repeats} "
          f"(load average {os.getloadavg()[0]:.1f} at the start)")
    columns = ("depth", "ops") + COMPILE_PHASES + ("compile",) + RUN_PHASES + ("first step", "wall")
    for strategy in args.strategies.split(","):
        print(f"\n{strategy}\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns), flush=True)
        for depth in (int(d) for d in args.depths.split(",")):
            with tempfile.TemporaryDirectory() as cache_dir:
                _child("fill", depth, strategy, cache_dir)
                best = min((_child("warm", depth, strategy, cache_dir) for _ in range(args.repeats)),
                           key=lambda run: run["first_step"])
            cells = [f"{best['phases'][p]:.3f}" for p in COMPILE_PHASES] + [f"**{best['compile']:.3f}**"]
            cells += [f"{best['phases'][p]:.3f}" for p in RUN_PHASES] + [f"{best['first_step']:.3f}",
                                                                         f"{best['wall']:.3f}"]
            print(f"| {depth} | {best['ops']} | " + " | ".join(cells) + " |", flush=True)
    print(f"(load average {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
