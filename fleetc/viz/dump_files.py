"""`fleetc dump-ir --dir`: one numbered file per pass (`000_capture.txt`, …), deterministic, for diff/git diff."""
from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Iterable

from fleetc.ir.serialize import to_dict
from fleetc.strategy.atomic import write_atomically

if TYPE_CHECKING:
    from fleetc.passes.manager import History, PassRecord

# Files of an earlier dump in the same folder; the ones this dump does not rewrite are removed.
_DUMP_NAME = re.compile(r"^\d{3}_[\w.-]+\.(txt|json)$")


def pass_file_text(record: PassRecord, fmt: str) -> str:
    """A record as text (summary line, then the Program) or JSON (report and Program); no timings."""
    if fmt == "json":
        entry = {"pass": record.name, "report": record.report.as_dict(), "program": to_dict(record.program)}
        return json.dumps(entry, indent=1) + "\n"
    return f"# after {record.name}: {record.summary()}\n{record.program}\n"


def write_pass_files(history: History, records: Iterable[PassRecord], directory: str, fmt: str) -> list[str]:
    """Write each record to `directory/NNN_<pass>.<txt|json>` (NNN: its position in the history), atomically.

    Numbered files left by an earlier dump and not rewritten now are removed, so the folder
    always shows one run. Returns the paths written, in pass order.
    """
    os.makedirs(directory, exist_ok=True)
    position = {id(r): i for i, r in enumerate(history)}
    written = []
    for record in records:
        path = os.path.join(directory, f"{position[id(record)]:03d}_{record.name}.{'json' if fmt == 'json' else 'txt'}")
        write_atomically(path, pass_file_text(record, fmt))
        written.append(path)
    keep = {os.path.basename(p) for p in written}
    for name in os.listdir(directory):
        if _DUMP_NAME.match(name) and name not in keep:
            os.unlink(os.path.join(directory, name))
    return written
