"""Writes README.md's support matrix (architecture x preset) from a real run, or checks it against one.

    python scripts/support_matrix.py            # run every architecture under every preset, rewrite the table
    python scripts/support_matrix.py --check    # run again; exit 1 and show the differences if the table is stale
    python scripts/support_matrix.py --only gpt2,bert --out matrix.md   # a partial run, written elsewhere

The table sits in README.md between the `support-matrix` markers; each cell is `pass` or `fail` with the reason
(fleetc/fleet/explain.py decides both, as `fleetc explain` does).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import multiprocessing
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))

from factories import ARCHITECTURES  # noqa: E402

from fleetc.fleet.explain import PRESETS, STEPS, check_preset  # noqa: E402

BEGIN, END = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"


def row(name: str) -> dict[str, str]:
    """One architecture's cells (preset → cell), printing progress to stderr."""
    case = ARCHITECTURES[name]()
    cells = {}
    for preset in PRESETS:
        start = time.perf_counter()
        model, batches = case.build(STEPS)
        outcome = check_preset(model, batches, case.loss_fn, preset)
        cell = outcome.cell() + (f" ({outcome.location})" if outcome.location and not outcome.ok else "")
        cells[preset] = cell.replace("|", "\\|").replace("\n", " ")
        print(f"{name} {preset}: {cell} [{time.perf_counter() - start:.1f}s]", file=sys.stderr, flush=True)
    return cells


def run(names: list[str], jobs: int) -> dict[str, dict[str, str]]:
    """architecture → preset → cell, `jobs` architectures at a time (each in its own process)."""
    if jobs <= 1:
        return {name: row(name) for name in names}
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(names, pool.map(row, names)))


def table(cells: dict[str, dict[str, str]]) -> str:
    lines = ["| architecture | " + " | ".join(PRESETS) + " |", "|---" * (len(PRESETS) + 1) + "|"]
    for name, row in cells.items():
        lines.append(f"| {name} | " + " | ".join(row[p] for p in PRESETS) + " |")
    return "\n".join(lines)


def committed(readme: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} section")
    return readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare README.md's table with a fresh run")
    parser.add_argument("--only", metavar="NAMES", help="comma-separated architectures (default: all)")
    parser.add_argument("--out", metavar="PATH", help="write the table here instead of into README.md")
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="architectures run at once (default 1)")
    options = parser.parse_args(argv)
    names = options.only.split(",") if options.only else list(ARCHITECTURES)
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown architectures {unknown}; known: {', '.join(ARCHITECTURES)}")
    fresh = table(run(names, options.jobs))
    readme_path = ROOT / "README.md"
    readme = readme_path.read_text()
    if options.check:
        old = committed(readme)
        if old == fresh:
            print("README.md's support matrix matches a fresh run")
            return 0
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), (fresh + "\n").splitlines(True),
                                                   "README.md (committed)", "fresh run"))
        return 1
    if options.out:
        pathlib.Path(options.out).write_text(fresh + "\n")
    else:
        head, _, rest = readme.partition(BEGIN)
        readme_path.write_text(f"{head}{BEGIN}\n{fresh}\n{END}{rest.partition(END)[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
