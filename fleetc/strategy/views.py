"""Strategy objects with validated attributes, generated from a field table; BuildStrategy and ExecutionStrategy.

A FieldView shows the fields of a Schema as properties. The values live in a Record, which a
view either owns (``BuildStrategy()``) or shares with the object it is part of
(``dist_strategy.build_strategy``), so ``dist_strategy.build_strategy.fuse_bn_act_ops = True``
changes ``dist_strategy``. A subclass names its table with a class keyword:
``class BuildStrategy(FieldView, schema=...)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from fleetc.errors import StrategyError
from fleetc.strategy import display
from fleetc.strategy.fields import BUILD_STRATEGY, EXECUTION_STRATEGY, Field, Section
from fleetc.strategy.schema import Record, Schema, plain

ViewT = TypeVar("ViewT", bound="FieldView")


class FieldView(display.ShowsChanges):
    """Attribute access, checked on every assignment, to the fields of a schema kept in a Record."""

    __slots__ = ("_record", "_prefix")
    _schema: ClassVar[Schema]
    _attributes: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, schema: Schema | None = None,
                          object_views: Mapping[str, type[FieldView]] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if schema is None:
            return
        cls._schema = schema
        cls._attributes = frozenset(entry.name for entry in schema.entries)
        for entry in schema.entries:
            if isinstance(entry, Field):
                setattr(cls, entry.name, _field_property(entry))
            elif entry.as_object:
                setattr(cls, entry.name, _object_property(entry, (object_views or {})[entry.name]))
            else:
                setattr(cls, entry.name, _configs_property(entry))

    def __init__(self) -> None:
        self._record = Record(self._schema)
        self._prefix = ""

    @classmethod
    def _bound(cls: type[ViewT], record: Record, prefix: str) -> ViewT:
        """A view of the fields stored in ``record`` under ``prefix`` (e.g. ``"build_strategy."``)."""
        view = cls.__new__(cls)
        view._record = record
        view._prefix = prefix
        return view

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and name not in self._attributes:
            self._schema.entry(name)  # not a field: raises UnknownFieldError with a hint
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            self._schema.entry(name)  # not a field: raises UnknownFieldError with a hint
        raise AttributeError(name)

    def _values(self) -> dict[str, Any]:
        """Every field's value, by path relative to this view."""
        return {path: self._record.values[self._prefix + path] for path in self._schema.fields}

    def _explicit(self) -> set[str]:
        """Relative paths of the fields the user set."""
        return {path for path in self._schema.fields if self._prefix + path in self._record.explicit}

    def _merge(self, nested: Mapping[str, Any]) -> None:
        """Set the fields of a nested dict; all are checked before any is stored."""
        flat = self._schema.flatten(nested)
        self._record.apply({self._prefix + path: value for path, value in flat.items()})

    def to_dict(self, only_set: bool = False) -> dict[str, Any]:
        """Nested plain dict of all fields, or with ``only_set`` of those set by the user."""
        values = self._values()
        if only_set:
            explicit = self._explicit()
            values = {path: value for path, value in values.items() if path in explicit}
        return self._schema.nest(values)

    @classmethod
    def from_dict(cls: type[ViewT], data: Mapping[str, Any]) -> ViewT:
        """A new object with the fields of ``data`` (as ``to_dict`` gives) set, the rest default."""
        view = cls()
        view._merge(data)
        return view

    def to_json(self, only_set: bool = False, indent: int | None = 2) -> str:
        """``to_dict`` as JSON text; ``only_set=True`` keeps which fields the user set across a round trip."""
        return json.dumps(self.to_dict(only_set=only_set), indent=indent)

    @classmethod
    def from_json(cls: type[ViewT], text: str) -> ViewT:
        """A new object from JSON text as ``to_json`` writes it."""
        try:
            data = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
        except json.JSONDecodeError as exc:
            raise StrategyError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
        except RecursionError:
            raise StrategyError("invalid JSON: nested too deeply (a strategy nests two levels)") from None
        return cls.from_dict(data)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # mutable; resolve_strategy() gives the hashable form

    def __copy__(self: ViewT) -> ViewT:
        copy = type(self)._bound(Record(self._schema), "")
        copy._record.apply(self._values(), explicit=self._explicit())
        return copy

    def __deepcopy__(self: ViewT, memo: dict) -> ViewT:
        return self.__copy__()

    def _changed(self) -> list[display.Row]:
        return display.changed_rows(self._values(), self._schema.defaults)


def _field_property(field: Field) -> property:
    def get(view: FieldView) -> Any:
        return view._record.values[view._prefix + field.name]

    def set_(view: FieldView, value: Any) -> None:
        view._record.apply({view._prefix + field.name: value})

    return property(get, set_, doc=f"{field.doc} ({field.kind.describe()}; default {plain(field.default)!r})")


def _configs_property(section: Section) -> property:
    """A ``*_configs`` attribute: reads give a dict copy, assigning a dict merges its keys in."""
    def get(view: FieldView) -> dict[str, Any]:
        return {f.name: plain(view._record.values[f"{view._prefix}{section.name}.{f.name}"])
                for f in section.fields}

    def set_(view: FieldView, value: Any) -> None:
        view._merge({section.name: value})

    keys = "; ".join(f"{f.name}: {f.doc} (default {plain(f.default)!r})" for f in section.fields)
    return property(get, set_, doc=f"{section.doc.capitalize()}. Keys: {keys}.")


def _object_property(section: Section, view_class: type[FieldView]) -> property:
    """An object attribute: reads give a live view; assigning an object copies it, a dict merges."""
    def get(view: FieldView) -> FieldView:
        return view_class._bound(view._record, f"{view._prefix}{section.name}.")

    def set_(view: FieldView, value: Any) -> None:
        prefix = f"{view._prefix}{section.name}."
        if isinstance(value, view_class):
            view._record.apply({prefix + path: item for path, item in value._values().items()},
                               explicit={prefix + path for path in value._explicit()})
        elif isinstance(value, Mapping):
            view._merge({section.name: value})
        else:
            raise StrategyError(f"{section.name} expects a dict or {view_class.__name__}(), "
                                f"got {type(value).__name__} {value!r}")

    return property(get, set_, doc=f"{section.doc.capitalize()} (a {view_class.__name__}).")


class BuildStrategy(FieldView, schema=Schema("BuildStrategy", BUILD_STRATEGY.fields)):
    """Graph-building switches, as in Paddle's BuildStrategy: which fusions run, in-place reuse, op order."""

    __slots__ = ()


class ExecutionStrategy(FieldView, schema=Schema("ExecutionStrategy", EXECUTION_STRATEGY.fields)):
    """Executor settings, as in Paddle's ExecutionStrategy: threads, scope dropping, iterations per call."""

    __slots__ = ()


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; a key given twice is an error (json.loads would keep the last one silently)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise StrategyError(f"key {key!r} is given twice")
        data[key] = value
    return data
