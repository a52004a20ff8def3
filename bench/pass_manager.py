"""What the pass manager itself costs around the passes (issue 25): Program copies for the history, and the rest.

One nn.TransformerEncoder Program per depth (the model of tests/helpers/scaling.py) goes through the pass order of
a strategy with `--repeats` runs, fastest kept. `Program.clone` is wrapped to count and time every copy made during
the run (the manager's, and any a pass makes itself). Columns: the passes' own seconds (sum of the records'),
the run's wall time, the copies made and their seconds, then the seconds to rebuild every record's Program on
request (history inspection: dump-ir, notebooks), which a run nobody inspects does not pay.

Run it against another checkout to compare (the script only uses the manager's public interface):

    OMP_NUM_THREADS=1 PYTHONPATH=.:tests python bench/pass_manager.py [--depths 8,32] [--strategy all_passes]
    OMP_NUM_THREADS=1 PYTHONPATH=/path/to/other/checkout:tests python bench/pass_manager.py

`--fingerprint-arguments` runs the manager as a compile with `verify=True` does: the fingerprint it takes after
every pass (to check replays against) covers op arguments and attributes too.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Self

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.scaling import STRATEGIES, encoder_and_batch

from fleetc.capture import capture_train_program
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Program
from fleetc.passes.base import PassReport
from fleetc.passes.manager import History, PassManager, PassRecord
from fleetc.passes.order import ordered_passes
from fleetc.strategy import resolve_conflicts, resolve_strategy


class _Clones:
    """Counts and times `Program.clone` calls while installed."""

    def __init__(self) -> None:
        self.calls, self.seconds = 0, 0.0
        self.original = Program.clone

    def __enter__(self) -> Self:
        clones, original = self, self.original

        def timed(program: Program) -> Program:
            start = time.perf_counter()
            try:
                return original(program)
            finally:
                clones.calls += 1
                clones.seconds += time.perf_counter() - start

        Program.clone = timed
        return self

    def __exit__(self, *exc: object) -> None:
        Program.clone = self.original


def _run(captured: Program, config, fingerprint_arguments: bool = False) -> dict[str, float]:
    program = captured.clone()
    history = History([PassRecord("capture", program, PassReport("capture"), 0.0, estimate_memory(program))])
    with _Clones() as clones:
        start = time.perf_counter()
        manager = PassManager(ordered_passes(config), fingerprint_arguments=fingerprint_arguments)
        manager.run(program, config, history)
        wall = time.perf_counter() - start
    passes = sum(record.seconds for record in history[1:])
    start = time.perf_counter()
    for record in history:
        record.program  # noqa: B018 (rebuilt on first access where the manager kept none)
    inspect = time.perf_counter() - start
    return {"passes": passes, "wall": wall, "clones": clones.calls, "clone_s": clones.seconds,
            "overhead": wall - passes, "inspect": inspect, "records": len(history) - 1}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", default="8,32")
    parser.add_argument("--strategy", default="all_passes", choices=sorted(STRATEGIES))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--fingerprint-arguments", action="store_true")
    args = parser.parse_args()
    config = resolve_conflicts(resolve_strategy(STRATEGIES[args.strategy]()))[0]
    print("depth | ops | passes | passes s | run wall s | copies | copies s | wall - passes s | rebuild history s")
    for depth in (int(d) for d in args.depths.split(",")):
        model, optimizer, batch = encoder_and_batch(depth)
        captured = capture_train_program(model, None, optimizer, batch, {})
        runs = [_run(captured, config, args.fingerprint_arguments) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["wall"])
        print(f"{depth} | {captured.num_ops()} | {best['records']} | {best['passes']:.2f} | {best['wall']:.2f} | "
              f"{best['clones']} | {best['clone_s']:.2f} | {best['overhead']:.2f} | {best['inspect']:.2f}", flush=True)


if __name__ == "__main__":
    main()
