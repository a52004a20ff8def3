"""The building blocks of the strategy field tables: a Field, a Section of fields, and the common kinds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetc.strategy.kinds import (
    Bool,
    Bounds,
    Float,
    Int,
    Kind,
    ListOf,
)


@dataclass(frozen=True)
class Field:
    """One setting: its name, kind (type and range), default and a one-line meaning."""

    name: str
    kind: Kind
    default: Any
    doc: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Section:
    """A named group of fields.

    ``as_object`` False: a ``*_configs`` dict (read as a copy, assigned as a dict that merges).
    ``as_object`` True: an object with attributes, like ``build_strategy``.
    """

    name: str
    fields: tuple[Field, ...]
    doc: str
    as_object: bool = False


FieldOrSection = Field | Section

BOOL = Bool()
COUNT = Int(Bounds(ge=1))           # how many of something; at least one
SIZE = Int(Bounds(ge=0))            # a size that may be zero
POSITIVE = Float(Bounds(gt=0))
NON_NEGATIVE = Float(Bounds(ge=0))
NAMES = ListOf(str)


def flag(name: str, doc: str, default: bool = False) -> Field:
    return Field(name, BOOL, default, doc)
