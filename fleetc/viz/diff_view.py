"""The coloured HTML form of a unified diff of two Program listings (`history.diff(...)` in notebooks)."""
from __future__ import annotations

from fleetc.viz.style import esc, wrap


def _line_class(line: str) -> str:
    if line.startswith(("--- ", "+++ ")):
        return "file"
    if line.startswith("@@"):
        return "hunk"
    return {"+": "add", "-": "del"}.get(line[:1], "")


def diff_body(diff: str) -> str:
    """The diff as a `<pre>` with added, removed and hunk lines coloured (no stylesheet)."""
    if not diff:
        return '<p class="note">no difference: the pass left the Program as it was</p>'
    lines = [f'<span class="{_line_class(line)}">{esc(line)}</span>' for line in diff.splitlines()]
    return f'<pre class="diff">{chr(10).join(lines)}</pre>'


def diff_html(diff: str) -> str:
    """The notebook view of `history.diff(...)`: the diff coloured, on the page's stylesheet."""
    return wrap(diff_body(str(diff)))
