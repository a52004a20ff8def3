"""Dotted-name access to a field table, and the validated record of values kept on it.

A Schema flattens a table into paths (``amp``, ``amp_configs.incr_ratio``); a Record holds one
value per path plus the set of paths the user set. Every change goes through
``Record.apply``, which checks all new values before storing any, so a failed assignment or
load leaves the record as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fleetc.errors import StrategyError
from fleetc.strategy.fields import Field, FieldOrSection, Section
from fleetc.strategy.names import unknown_name


def plain(value: Any) -> Any:
    """``value`` as plain Python data for dicts and JSON: tuples become lists, nested messages plain dicts."""
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    return [plain(item) for item in value] if isinstance(value, tuple) else value


class Schema:
    """A field table seen as flat dotted paths, with name lookup, hints and defaults."""

    def __init__(self, title: str, entries: Sequence[FieldOrSection]) -> None:
        self.title = title
        self.entries = tuple(entries)
        self.fields: dict[str, Field] = {}
        self._aliases: dict[str, str] = {}
        self._nested_names: dict[str, str] = {}
        for entry in self.entries:
            if isinstance(entry, Field):
                self.fields[entry.name] = entry
                continue
            for field in entry.fields:
                path = f"{entry.name}.{field.name}"
                self.fields[path] = field
                self._nested_names.setdefault(field.name, path)
                self._aliases.update({f"{entry.name}.{alias}": path for alias in field.aliases})
        self._entries_by_name = {entry.name: entry for entry in self.entries}
        self.defaults: dict[str, Any] = {path: f.kind.check(f.default, path) for path, f in self.fields.items()}

    def entry(self, name: str) -> FieldOrSection:
        """The top-level field or section called ``name``; unknown names raise with a hint."""
        if name not in self._entries_by_name:
            raise unknown_name(name, f"{self.title} field", self._entries_by_name, self._nested_names)
        return self._entries_by_name[name]

    def path(self, section: Section, key: str) -> str:
        """The dotted path of ``key`` (or its alias) inside ``section``."""
        path = f"{section.name}.{key}"
        path = self._aliases.get(path, path)
        if path not in self.fields:
            raise unknown_name(key, f"{section.name} key", [f.name for f in section.fields])
        return path

    def validate(self, path: str, value: Any) -> Any:
        """``value`` checked and normalized for the field at ``path``."""
        return self.fields[path].kind.check(value, path)

    def flatten(self, nested: Mapping[str, Any]) -> dict[str, Any]:
        """Dotted paths of a nested dict such as ``{"amp": True, "amp_configs": {...}}`` (unchecked values)."""
        if not isinstance(nested, Mapping):
            raise StrategyError(f"{self.title} expects a dict of fields, got {type(nested).__name__} {nested!r}")
        flat: dict[str, Any] = {}
        for name, value in nested.items():
            entry = self.entry(name)
            if isinstance(entry, Field):
                flat[name] = value
            else:
                flat.update(self.flatten_section(entry, value))
        return flat

    def flatten_section(self, section: Section, keys: Any) -> dict[str, Any]:
        """Dotted paths of one section's ``{key: value}`` dict; aliases resolved, duplicates refused."""
        if not isinstance(keys, Mapping):
            valid = ", ".join(f.name for f in section.fields)
            raise StrategyError(f"{section.name} expects a dict with keys from ({valid}), "
                                f"got {type(keys).__name__} {keys!r}")
        flat: dict[str, Any] = {}
        for key, value in keys.items():
            path = self.path(section, str(key))
            if path in flat:
                raise StrategyError(f"{path} is given twice (the second time as {key!r})")
            flat[path] = value
        return flat

    def nest(self, flat: Mapping[str, Any]) -> dict[str, Any]:
        """The nested plain dict of ``flat`` (dotted paths to values), in table order."""
        nested: dict[str, Any] = {}
        for path in self.fields:
            if path in flat:
                section, _, key = path.rpartition(".")
                target = nested.setdefault(section, {}) if section else nested
                target[key] = plain(flat[path])
        return nested


class Record:
    """The current value of every field of a schema, and the paths the user set."""

    __slots__ = ("schema", "values", "explicit")

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.values: dict[str, Any] = dict(schema.defaults)
        self.explicit: set[str] = set()

    def apply(self, updates: Mapping[str, Any], explicit: Iterable[str] | None = None) -> None:
        """Check every update, then store them all; nothing changes if any check fails.

        Updated paths count as set by the user, or, when ``explicit`` is given, only those in it
        (the others are marked unset: used when copying a whole section from another object).
        """
        checked = {path: self.schema.validate(path, value) for path, value in updates.items()}
        marked = set(checked) if explicit is None else set(explicit) & set(checked)
        self.values.update(checked)
        self.explicit -= set(checked) - marked
        self.explicit |= marked
