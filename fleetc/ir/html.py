"""Notebook (HTML) views of fleetc's objects, supplied from above: `fleetc.viz` registers them, lower layers never
import it. Without a registered view, `_repr_html_` returns None and notebooks show the text form."""
from __future__ import annotations

from typing import Any, Callable

_VIEWS: dict[type, Callable[[Any], str]] = {}


def register_html_view(cls: type, render: Callable[[Any], str]) -> None:
    """Render instances of `cls` (and its subclasses) with `render` in notebooks."""
    _VIEWS[cls] = render


def html_view(obj: Any) -> str | None:
    """The registered HTML view of `obj`, or None when no view is registered for its type."""
    for cls in type(obj).__mro__:
        if cls in _VIEWS:
            return _VIEWS[cls](obj)
    return None


class HtmlViewable:
    """Mixin: `_repr_html_` renders through the view registered for the object's type."""

    def _repr_html_(self) -> str | None:
        return html_view(self)
