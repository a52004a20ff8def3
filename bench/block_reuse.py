"""Passes with and without reuse of repeated blocks (issue 25), against depth: nn.TransformerEncoder stacks.

For each depth one Program is captured (the model of tests/helpers/scaling.py), then the pass order of "every
fusion + recompute auto + AMP (bf16)" runs on clones of it with `FLEETC_BLOCK_REUSE` on and off, `--repeats`
times each, alternating; the fastest run of each is kept. Columns: AMP's seconds, the four named fusion passes'
seconds together, recompute's seconds (its "auto" min-cut solved by pieces with reuse), and all passes' seconds,
then the Op/Var visits (fleetc.ir.visits) of the same parts, which do not
depend on load. The two Programs are checked to print identically.

    OMP_NUM_THREADS=1 PYTHONPATH=.:tests python bench/block_reuse.py [--depths 2,8,16,32] [--repeats 2]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.scaling import all_passes_strategy, encoder_and_batch

from fleetc.capture import capture_train_program
from fleetc.ir.block_copies import REUSE_ENV
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Program
from fleetc.ir.visits import count_visits
from fleetc.passes.base import PassReport
from fleetc.passes.instruments import VisitCountInstrument
from fleetc.passes.manager import History, PassManager, PassRecord
from fleetc.passes.order import ordered_passes
from fleetc.strategy import resolve_conflicts, resolve_strategy

FUSIONS = ("fuse_bn_add_act", "fuse_gemm_epilogue", "fuse_dropout_add", "fuse_elewise_add_act")


def _config():
    strategy = all_passes_strategy()
    strategy.amp = True
    strategy.amp_configs = {"dtype": "bfloat16"}
    return resolve_conflicts(resolve_strategy(strategy))[0]


def _run(captured: Program, config, reuse: bool, visits: bool) -> tuple[dict[str, float], str]:
    """{amp, fusion, recompute, passes} seconds (or visits) of one pass-manager run, and the final Program's text."""
    os.environ[REUSE_ENV] = "1" if reuse else "0"
    program = captured.clone()
    history = History([PassRecord("capture", program, PassReport("capture"), 0.0, estimate_memory(program))])
    if visits:
        with count_visits() as counter:
            instrument = VisitCountInstrument(counter)
            final = PassManager(ordered_passes(config), [instrument]).run(program, config, history)
        per_pass = dict(instrument.visits)
    else:
        final = PassManager(ordered_passes(config), []).run(program, config, history)
        per_pass = {record.name: record.seconds for record in history[1:]}
    return ({"amp": per_pass.get("amp", 0), "fusion": sum(per_pass.get(n, 0) for n in FUSIONS),
             "recompute": per_pass.get("recompute", 0), "passes": sum(per_pass.values())}, str(final))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", default="2,8,16,32")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    config = _config()
    print("depth | ops | amp s (reuse / off) | fusion s | recompute s | passes s | amp visits | fusion visits | "
          "recompute visits | passes visits")
    for depth in (int(d) for d in args.depths.split(",")):
        model, optimizer, batch = encoder_and_batch(depth)
        captured = capture_train_program(model, None, optimizer, batch, {})
        best = {True: {}, False: {}}
        texts = {}
        for _ in range(args.repeats):
            for reuse in (True, False):
                seconds, texts[reuse] = _run(captured, config, reuse, visits=False)
                best[reuse] = {k: min(v, best[reuse].get(k, v)) for k, v in seconds.items()}
        if texts[True] != texts[False]:
            raise SystemExit(f"depth {depth}: the Programs built with and without reuse differ")
        counted = {reuse: _run(captured, config, reuse, visits=True)[0] for reuse in (True, False)}
        parts = ("amp", "fusion", "recompute", "passes")
        cells = [f"{best[True][k]:.2f} / {best[False][k]:.2f}" for k in parts]
        cells += [f"{counted[True][k]:,} / {counted[False][k]:,}" for k in parts]
        print(f"{depth} | {len(captured.global_block.ops)} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
