"""Notebook and report views of pass records: what each pass did, its cost, and the Program it left."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from fleetc.viz.memory_view import memory_chart
from fleetc.viz.pipeline_view import pipeline_timeline
from fleetc.viz.program_view import program_body
from fleetc.viz.style import esc, format_bytes, wrap

if TYPE_CHECKING:
    from fleetc.passes.manager import History, PassRecord


def _position(record: PassRecord) -> int:
    position, previous = 0, record.previous
    while previous is not None:
        position, previous = position + 1, previous.previous
    return position


def _state(record: PassRecord) -> str:
    if record.report.changed:
        return '<span class="badge added">changed</span>'
    why = record.report.skipped_reason or "nothing matched"
    return f'<span class="badge">unchanged: {esc(why)}</span>'


def _stats(record: PassRecord) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(record.report.stats.items())) or "none"


def _delta(before: int, after: int, fmt=str) -> str:
    if before == after:
        return f"{fmt(after)} (unchanged)"
    sign = "+" if after > before else "−"
    return f"{fmt(before)} → {fmt(after)} ({sign}{fmt(abs(after - before))})"


def record_body(record: PassRecord, program_open: bool = True) -> str:
    """One pass: name, time, statistics, ops and estimated peak before/after, live-bytes chart, the Program."""
    previous = record.previous
    peak_before = previous.memory.peak_bytes if previous else record.memory.peak_bytes
    ops_before = previous.program.num_ops() if previous else record.program.num_ops()
    rows = [("time", f"{record.seconds * 1000:.1f} ms"), ("statistics", _stats(record)),
            ("ops", _delta(ops_before, record.program.num_ops())),
            ("estimated peak", _delta(peak_before, record.memory.peak_bytes, format_bytes))]
    rows += [("note", note) for note in record.report.notes]
    facts = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    state = " open" if program_open else ""
    before = previous.program if previous else None
    return (f'<section class="record" id="pass-{_position(record)}">'
            f'<h3>#{_position(record)} {esc(record.name)} {_state(record)}</h3>'
            f'<table class="facts">{facts}</table>{memory_chart(record.memory)}'
            f'{pipeline_timeline(record.program) if record.name == "pipeline_split" else ""}'
            f'<details class="record-program"{state}><summary>Program after {esc(record.name)}</summary>'
            f'{program_body(record.program, before)}</details></section>')


def record_html(record: PassRecord) -> str:
    """PassRecord._repr_html_: the record with ops changed against the record before highlighted."""
    return wrap(record_body(record))


def passes_table(records: Iterable[PassRecord]) -> str:
    """One row per pass, linking to its section: whether it changed, time, ops, estimated peak, statistics."""
    rows = []
    for record in records:
        i = _position(record)
        rows.append(f'<tr><td>{i}</td><td><a href="#pass-{i}">{esc(record.name)}</a></td>'
                    f'<td>{"changed" if record.report.changed else "unchanged"}</td>'
                    f'<td>{record.seconds * 1000:.1f} ms</td><td>{record.program.num_ops()}</td>'
                    f'<td>{esc(format_bytes(record.memory.peak_bytes))}</td><td>{esc(_stats(record))}</td></tr>')
    return ('<table class="passes"><tr><th>#</th><th>pass</th><th>result</th><th>time</th><th>ops</th>'
            f'<th>estimated peak</th><th>statistics</th></tr>{"".join(rows)}</table>')


def history_body(records: Iterable[PassRecord]) -> str:
    """The passes table, then a section per pass; only the Programs a pass changed start unfolded."""
    records = list(records)
    return passes_table(records) + "".join(
        record_body(r, program_open=r.report.changed and r.previous is not None) for r in records)


def history_html(history: History) -> str:
    """History._repr_html_."""
    return wrap(history_body(history))
