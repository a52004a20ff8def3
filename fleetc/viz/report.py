"""One self-contained HTML file (no script, no external resource) with a section per pass."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from fleetc.viz.record_view import history_body
from fleetc.viz.style import CSS, esc

if TYPE_CHECKING:
    from fleetc.passes.manager import PassRecord


def report_html(records: Iterable[PassRecord], title: str = "fleetc passes") -> str:
    """A complete HTML page showing `records` exactly as the notebook's History view does."""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<style>{CSS}</style></head><body class="fleetc"><h2>{esc(title)}</h2>'
            f'{history_body(records)}</body></html>\n')
