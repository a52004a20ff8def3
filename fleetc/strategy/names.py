"""Errors for misspelled or misplaced field names, with the closest valid name as a hint."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from fleetc.errors import StrategyError

_LIST_AT_MOST = 12  # name every valid choice when there are this few


class UnknownFieldError(StrategyError, AttributeError):
    """A strategy field or config key that does not exist (an AttributeError too, for hasattr)."""


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to ``name`` (ignoring case), or None when nothing is close."""
    by_lower = {candidate.lower(): candidate for candidate in candidates}
    matches = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[matches[0]] if matches else None


def unknown_name(name: str, what: str, valid: Iterable[str],
                 elsewhere: Mapping[str, str] | None = None) -> UnknownFieldError:
    """Build the error for ``name`` not being a valid ``what`` (e.g. "gradient_merge_configs key").

    ``elsewhere`` maps names that exist one level down to where they live
    (``{"fuse_bn_act_ops": "build_strategy.fuse_bn_act_ops"}``): an exact hit there is the best hint.
    """
    valid = list(valid)
    elsewhere = dict(elsewhere or {})
    message = f"unknown {what} {name!r}"
    if name in elsewhere:
        message += f"; it lives at {elsewhere[name]!r}"
    else:
        hint = closest(name, valid) or elsewhere.get(closest(name, elsewhere) or "")
        if hint:
            message += f"; did you mean {hint!r}?"
    if len(valid) <= _LIST_AT_MOST:
        message += f" (valid: {', '.join(valid)})"
    return UnknownFieldError(message)
