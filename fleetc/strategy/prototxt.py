"""Strategy fields to and from protobuf text format, laid out as Paddle's save_to_prototxt writes them.

Written: the fields the user set or that differ from their default, sections as sub-messages
(``gradient_merge_configs { k_steps: 4 }``), repeated fields one line per item. Read: every
entry is mapped to a field and checked, and the whole file is accepted or refused; errors name
the file and line.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fleetc.errors import StrategyError
from fleetc.strategy.fields import Field
from fleetc.strategy.messages import Message
from fleetc.strategy.schema import Record, Schema
from fleetc.strategy.textformat import Entry, parse


def render(record: Record) -> str:
    """The prototxt text of ``record``'s set or non-default fields."""
    schema = record.schema
    written = record.explicit | {path for path, value in record.values.items() if value != schema.defaults[path]}
    lines: list[str] = []
    for entry in schema.entries:
        if isinstance(entry, Field):
            lines += _field_lines(entry, entry.name, record, written, indent="")
            continue
        body = [line for field in entry.fields
                for line in _field_lines(field, f"{entry.name}.{field.name}", record, written, indent="  ")]
        if body:
            lines += [f"{entry.name} {{", *body, "}"]
    return "".join(line + "\n" for line in lines)


def _field_lines(field: Field, path: str, record: Record, written: set[str], indent: str) -> list[str]:
    if path not in written:
        return []
    if isinstance(field.kind, Message):
        return field.kind.block_lines(field.name, record.values[path], indent)
    return [f"{indent}{field.name}: {text}" for text in field.kind.to_text(record.values[path])]


def read(schema: Schema, text: str, source: str) -> dict[str, Any]:
    """Checked values, by dotted path, of every field in prototxt ``text`` read from ``source``."""
    found: dict[str, list[tuple[Any, int]]] = defaultdict(list)
    for entry in parse(text, source):
        for path, child in _paths(schema, entry, source):
            found[path].append((child.value, child.line))
    updates: dict[str, Any] = {}
    for path, items in found.items():
        kind = schema.fields[path].kind
        if not kind.repeated and len(items) > 1:
            raise StrategyError(f"{source}:{items[1][1]}: {path} is given twice (first on line {items[0][1]})")
        value = [item for item, _ in items] if kind.repeated else items[0][0]
        with _at(source, items[0][1]):
            updates[path] = kind.from_text(value, path)
    return updates


def _paths(schema: Schema, entry: Entry, source: str) -> list[tuple[str, Entry]]:
    """(dotted path, scalar entry) pairs for a top-level entry, checking its shape."""
    with _at(source, entry.line):
        target = schema.entry(entry.name)
    if isinstance(target, Field):
        if isinstance(target.kind, Message):
            return [(entry.name, _block(entry))]
        if entry.children is not None:
            raise StrategyError(f"{source}:{entry.line}: {entry.name} takes a value ('{entry.name}: ...'), "
                                "not a { } block")
        return [(entry.name, entry)]
    if entry.children is None:
        raise StrategyError(f"{source}:{entry.line}: {entry.name} is a section; write '{entry.name} {{ ... }}'")
    pairs = []
    for child in entry.children:
        with _at(source, child.line):
            path = schema.path(target, child.name)
        if isinstance(schema.fields[path].kind, Message):
            pairs.append((path, _block(child)))
            continue
        if child.children is not None:
            raise StrategyError(f"{source}:{child.line}: {path} takes a value, not a {{ }} block")
        pairs.append((path, child))
    return pairs


def _block(entry: Entry) -> Entry:
    """A message field's entry with its block as the value (the scalar itself when it has none: refused later)."""
    return Entry(entry.name, entry.line, entry.children if entry.children is not None else entry.value)


@contextmanager
def _at(source: str, line: int) -> Iterator[None]:
    """Prefix the message of a StrategyError raised inside with ``source:line``."""
    try:
        yield
    except StrategyError as exc:
        raise type(exc)(f"{source}:{line}: {exc}") from None
