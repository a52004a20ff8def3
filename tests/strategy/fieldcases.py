"""Per-field test values derived from the field table, and access by dotted path through the public API."""

from __future__ import annotations

from typing import Any

from fleetc.strategy import DistributedStrategy
from fleetc.strategy.distributed import DISTRIBUTED_SCHEMA
from fleetc.strategy.fields import Field, Section
from fleetc.strategy.kinds import (
    Bool,
    Checkpoints,
    Choice,
    Float,
    Int,
    ListOf,
    Nullable,
    Text,
)
from fleetc.strategy.messages import Message

FIELDS: dict[str, Field] = DISTRIBUTED_SCHEMA.fields
PATHS = sorted(FIELDS)


def section_of(path: str) -> Section | None:
    name = path.partition(".")[0]
    entry = DISTRIBUTED_SCHEMA.entry(name)
    return entry if isinstance(entry, Section) else None


def set_path(strategy: DistributedStrategy, path: str, value: Any) -> None:
    """Assign like a user would: attribute, `*_configs` dict, or build/execution strategy attribute."""
    section, _, key = path.rpartition(".")
    if not section:
        setattr(strategy, path, value)
    elif section_of(path).as_object:
        setattr(getattr(strategy, section), key, value)
    else:
        setattr(strategy, section, {key: value})


def get_path(strategy: DistributedStrategy, path: str) -> Any:
    section, _, key = path.rpartition(".")
    if not section:
        return getattr(strategy, path)
    if section_of(path).as_object:
        return getattr(getattr(strategy, section), key)
    return getattr(strategy, section)[key]


def good_value(field: Field) -> Any:
    """A valid value different from the default."""
    kind = field.kind
    if isinstance(kind, Nullable):
        return "bfloat16" if isinstance(kind.inner, Choice) else 256.0
    if isinstance(kind, Bool):
        return not field.default
    if isinstance(kind, Int):
        return next(c for c in kind.choices if c != field.default) if kind.choices else field.default + 3
    if isinstance(kind, Float):
        return field.default * 0.5 if kind.bounds.lt is not None else field.default + 0.25
    if isinstance(kind, Choice):
        return next(c for c in kind.choices if c != field.default)
    if isinstance(kind, Checkpoints):
        return ["x", "y"]
    if isinstance(kind, ListOf):
        return {str: ["alpha", "beta"], int: [2, 3], float: [0.5, 0.25]}[kind.item]
    if isinstance(kind, Text):
        return field.default + "/elsewhere"
    if isinstance(kind, Message):
        message = {"name": "alpha", "size": 2, "inner": {"on": True, "rate": 0.5}}
        return [message] if kind.repeated else message
    raise AssertionError(f"no sample for {field.name}")


def wrong_types(field: Field) -> list[Any]:
    """Values of a type the field must refuse."""
    if isinstance(field.kind, Nullable):
        return [value for value in wrong_types(Field(field.name, field.kind.inner, None, "")) if value is not None]
    kind = field.kind
    if isinstance(kind, Bool):
        return [1, "true", None]
    if isinstance(kind, Int):
        return [True, 2.0, "3", None]
    if isinstance(kind, Float):
        return [True, "0.5", None]
    if isinstance(kind, Choice):
        return [1, ["float16"], None]
    if isinstance(kind, Checkpoints):
        return ["x", [1], None]
    if isinstance(kind, ListOf):
        return (["abc", [1], None] if kind.item is str else [[True], ["a"], 3])
    if isinstance(kind, Text):
        return [1, ["a"], None]
    if isinstance(kind, Message):
        bad = [{"name": None}, {"no name": 1}, {"size": float("nan")}, "text"]
        return [{"name": "x"}, [*bad[:1]], None] if kind.repeated else [*bad, None, ["x"]]
    raise AssertionError(f"no wrong types for {field.name}")


def out_of_range(field: Field) -> list[Any]:
    """Values of the right type outside the field's range or choices (empty when any value fits)."""
    kind = field.kind.inner if isinstance(field.kind, Nullable) else field.kind
    if isinstance(kind, Int):
        if kind.choices:
            return [min(kind.choices) - 1, max(kind.choices) + 1]
        return [kind.bounds.ge - 1, -5] if kind.bounds.ge is not None else []
    if isinstance(kind, Float):
        bounds = kind.bounds
        values = [v for v in (bounds.gt, None if bounds.ge is None else bounds.ge - 0.5, bounds.lt)
                  if v is not None]
        return values + [float("nan"), float("inf")]
    if isinstance(kind, Choice):
        return ["bogus"]
    return []
