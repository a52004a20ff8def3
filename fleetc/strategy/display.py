"""Human-readable forms of a strategy: what differs from the defaults, as text, repr or HTML."""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from fleetc.strategy.schema import plain

Row = tuple[str, Any, Any]  # (dotted path, value, default)
_REPR_SHOWN = 3  # fields named in a repr before it says "+N fields"


class ShowsChanges:
    """Mixin giving str, repr and ``_repr_html_`` from ``self._changed()``, titled by the class name."""

    __slots__ = ()

    def _changed(self) -> list[Row]:
        raise NotImplementedError

    def __str__(self) -> str:
        return describe(type(self).__name__, self._changed())

    def __repr__(self) -> str:
        return short_repr(type(self).__name__, self._changed())

    def _repr_html_(self) -> str:
        return html_table(type(self).__name__, self._changed())


def changed_rows(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> list[Row]:
    """(path, value, default) of every field whose value differs from its default, in table order."""
    return [(path, value, defaults[path]) for path, value in values.items() if value != defaults[path]]


def describe(title: str, rows: list[Row]) -> str:
    """Multi-line text: the changed fields, top-level ones first-level, section fields under a header."""
    if not rows:
        return f"{title} (all fields at their defaults)"
    lines = [f"{title} ({_differ(len(rows))} from defaults)"]
    open_section = ""
    for path, value, default in rows:
        section, _, name = path.rpartition(".")
        if section and section != open_section:
            lines.append(f"  {section}:")
        open_section = section
        indent = "    " if section else "  "
        lines.append(f"{indent}{name} = {plain(value)!r}  (default {plain(default)!r})")
    return "\n".join(lines)


def short_repr(title: str, rows: list[Row]) -> str:
    """One line naming the first few changed fields, top-level switches first."""
    ordered = sorted(rows, key=lambda row: "." in row[0])
    parts = [f"{path}={plain(value)!r}" for path, value, _ in ordered[:_REPR_SHOWN]]
    if len(ordered) > _REPR_SHOWN:
        parts.append(f"+{_count(len(ordered) - _REPR_SHOWN)}")
    return f"{title}({', '.join(parts)})"


def html_table(title: str, rows: list[Row]) -> str:
    """An HTML table (field, value, default) of the changed fields, for notebooks."""
    caption = html.escape(f"{title}: {_differ(len(rows))} from defaults")
    body = "".join(
        f"<tr><td><code>{html.escape(path)}</code></td><td>{html.escape(repr(plain(value)))}</td>"
        f"<td>{html.escape(repr(plain(default)))}</td></tr>"
        for path, value, default in rows
    )
    return (f"<table><caption>{caption}</caption>"
            "<thead><tr><th>field</th><th>value</th><th>default</th></tr></thead>"
            f"<tbody>{body}</tbody></table>")


def _count(n: int) -> str:
    return f"{n} field" if n == 1 else f"{n} fields"


def _differ(n: int) -> str:
    return f"{_count(n)} differs" if n == 1 else f"{_count(n)} differ"
