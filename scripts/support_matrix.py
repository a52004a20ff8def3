"""Writes README.md's support matrix (architecture x preset) from a real run, or checks it against one.

    python scripts/support_matrix.py            # run every architecture under every preset, rewrite the table
    python scripts/support_matrix.py --check    # run again; exit 1 and show the differences if the table is stale
    python scripts/support_matrix.py --check --only gpt2   # check gpt2's row alone
    python scripts/support_matrix.py --only mobilenet_v2   # rerun one row; README.md's other rows stay as committed
    python scripts/support_matrix.py --only gpt2,bert --out matrix.md   # a partial run, written elsewhere
    python scripts/support_matrix.py --jobs 3 2> progress.log   # later, after an interruption:
    python scripts/support_matrix.py --jobs 3 --resume progress.log   # runs only what progress.log lacks

The table sits in README.md between the `support-matrix` markers; each cell is `pass` or `fail` with the reason
(fleetc/fleet/explain.py decides both, as `fleetc explain` does).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import multiprocessing
import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))

from factories import ARCHITECTURES  # noqa: E402

from fleetc.fleet.explain import PRESETS, STEPS, check_preset  # noqa: E402

BEGIN, END = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"


PROGRESS = re.compile(r"^(\w+) (\w+): (.*) \[[0-9.]+s\]$")


def resumed(log: str) -> dict[str, dict[str, str]]:
    """The cells an earlier run printed to stderr (its progress lines): architecture → preset → cell."""
    cells: dict[str, dict[str, str]] = {}
    for line in log.splitlines():
        found = PROGRESS.match(line)
        if found and found.group(1) in ARCHITECTURES and found.group(2) in PRESETS:
            cells.setdefault(found.group(1), {})[found.group(2)] = found.group(3)
    return cells


def row(name: str, done: dict[str, str] | None = None) -> dict[str, str]:
    """One architecture's cells (preset → cell), printing progress to stderr; presets in `done` are not re-run."""
    case = ARCHITECTURES[name]()
    cells = dict(done or {})
    for preset in [p for p in PRESETS if p not in cells]:
        start = time.perf_counter()
        model, batches = case.build(STEPS)
        outcome = check_preset(model, batches, case.loss_fn, preset)
        cell = outcome.cell() + (f" ({outcome.location})" if outcome.location and not outcome.ok else "")
        cell = cell.replace("\n", " ")
        cells[preset] = cell
        print(f"{name} {preset}: {cell} [{time.perf_counter() - start:.1f}s]", file=sys.stderr, flush=True)
    return cells


def run(names: list[str], jobs: int, done: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """architecture → preset → cell, `jobs` architectures at a time (each in its own process); cells in `done`
    are kept, not re-run."""
    dones = [done.get(name, {}) for name in names]
    if jobs <= 1:
        return {name: row(name, d) for name, d in zip(names, dones)}
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(names, pool.map(row, names, dones)))


def _header() -> list[str]:
    return ["| architecture | " + " | ".join(PRESETS) + " |", "|---" * (len(PRESETS) + 1) + "|"]


def table(cells: dict[str, dict[str, str]]) -> str:
    """The Markdown table of `cells` (architecture → preset → cell), presets in PRESETS order."""
    lines = _header()
    for name, row in cells.items():
        lines.append(f"| {name} | " + " | ".join(row[p].replace("|", "\\|") for p in PRESETS) + " |")
    return "\n".join(lines)


_CELL_SEPARATOR = re.compile(r"(?<!\\) \| ")


def parse(text: str) -> dict[str, dict[str, str]]:
    """The cells of a table `table` wrote (its inverse); a table in another layout is a SystemExit naming the
    line, since only this script may write it."""
    lines = text.strip().splitlines()
    if lines[:2] != _header():
        raise SystemExit(f"the support matrix's header is not {_header()[0]!r}: rewrite it with this script")
    cells: dict[str, dict[str, str]] = {}
    for number, line in enumerate(lines[2:], start=3):
        parts = _CELL_SEPARATOR.split(line.removeprefix("| ").removesuffix(" |"))
        if not (line.startswith("| ") and line.endswith(" |")) or len(parts) != len(PRESETS) + 1:
            raise SystemExit(f"line {number} of the support matrix is not a row of {len(PRESETS) + 1} cells: {line!r}")
        cells[parts[0]] = {p: c.replace("\\|", "|") for p, c in zip(PRESETS, parts[1:])}
    return cells


def stale_rows(committed_table: str, fresh: dict[str, dict[str, str]]) -> list[str]:
    """A unified diff of the committed table's rows for the architectures in `fresh` against `fresh` (empty
    when they agree); a full run also compares which architectures the table lists."""
    old = parse(committed_table)
    if set(fresh) != set(ARCHITECTURES):  # a partial run (--only): compare its rows alone
        old = {name: old[name] for name in fresh if name in old}
    old_lines, new_lines = ((table(cells) + "\n").splitlines(True) for cells in (old, fresh))
    return list(difflib.unified_diff(old_lines, new_lines, "README.md (committed)", "fresh run"))


def merged_rows(committed_table: str, fresh: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The committed table's rows with those of `fresh` (a run of some or all architectures) replacing theirs, in
    ARCHITECTURES order; a full run replaces every row."""
    old = parse(committed_table) if set(fresh) != set(ARCHITECTURES) else {}
    rows = {**old, **fresh}
    return {name: rows[name] for name in ARCHITECTURES if name in rows}


def committed(readme: str) -> str:
    """The table between the support-matrix markers of README.md's text."""
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} section")
    return readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare README.md's table with a fresh run")
    parser.add_argument("--only", metavar="NAMES", help="comma-separated architectures (default: all)")
    parser.add_argument("--out", metavar="PATH", help="write the table here instead of into README.md")
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="architectures run at once (default 1)")
    parser.add_argument("--resume", metavar="LOG", help="keep the cells an interrupted run printed to stderr (saved "
                                                        "in LOG) and run only the rest")
    options = parser.parse_args(argv)
    names = options.only.split(",") if options.only else list(ARCHITECTURES)
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown architectures {unknown}; known: {', '.join(ARCHITECTURES)}")
    done = resumed(pathlib.Path(options.resume).read_text()) if options.resume else {}
    cells = run(names, options.jobs, done)
    fresh = table(cells)
    readme_path = ROOT / "README.md"
    readme = readme_path.read_text()
    if options.check:
        diff = stale_rows(committed(readme), cells)
        if not diff:
            print(f"README.md's support matrix matches a fresh run of {', '.join(names)}")
            return 0
        sys.stdout.writelines(diff)
        return 1
    if options.out:
        pathlib.Path(options.out).write_text(fresh + "\n")
    else:
        head, _, rest = readme.partition(BEGIN)
        merged = table(merged_rows(committed(readme), cells))
        readme_path.write_text(f"{head}{BEGIN}\n{merged}\n{END}{rest.partition(END)[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
