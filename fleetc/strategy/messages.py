"""Paddle's nested strategy messages that fleetc keeps but does not apply (``hybrid_configs.mp_configs``,
``trainer_desc_configs``, ``downpour_table_param``, ...): a field kind holding one as read-only data.

fleetc does not model these messages field by field: a message is kept as nested data (names, scalars, lists,
sub-messages), checked for shape only, so that a prototxt Paddle wrote loads and saves back, and ``report()`` can
say it was not applied. Nothing in it is evaluated: the text goes through the same restricted parser as the rest of
the file (fleetc.strategy.textformat), and Python values must be plain data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleetc.errors import StrategyError
from fleetc.strategy.kinds import Kind, wrong_type_error
from fleetc.strategy.textformat import Entry, Word, quote

_BOOL_WORDS = {"true": True, "false": False}


class MessageValue(dict):
    """A message's fields by name, in file order; hashable (strategy configs hash their values). A repeated
    field holds a tuple. Always built by `Message.check`, which copies; treat it as read-only."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))


def _scalar(value: Any, path: str) -> Any:
    if isinstance(value, Word):
        return _BOOL_WORDS.get(value, value)
    if isinstance(value, float) and not math.isfinite(value):
        raise StrategyError(f"{path} must be a finite number, got {value!r}")
    if isinstance(value, (bool, int, float, str)):
        return value
    raise wrong_type_error(path, "a bool, number or string", value)


def _value(value: Any, path: str) -> Any:
    if isinstance(value, Mapping):
        return _message(value, path)
    if isinstance(value, (list, tuple)):
        return tuple(_value(item, f"{path}[{i}]") for i, item in enumerate(value))
    return _scalar(value, path)


def _message(value: Any, path: str) -> MessageValue:
    if not isinstance(value, Mapping):
        raise wrong_type_error(path, "a message (a dict of field names to values)", value)
    checked = MessageValue()
    for name, item in value.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise StrategyError(f"{path}: field name {name!r} is not a name")
        dict.__setitem__(checked, name, _value(item, f"{path}.{name}"))
    return checked


def _from_entries(entries: tuple[Entry, ...], path: str) -> MessageValue:
    """A parsed block: a name given more than once becomes a repeated field (a tuple, in file order)."""
    fields: dict[str, list[Any]] = {}
    for entry in entries:
        at = f"{path}.{entry.name}"
        value = _from_entries(entry.children, at) if entry.children is not None else entry.value
        items = value if isinstance(value, list) else [value]  # `name: [a, b]` is a repeated field too
        fields.setdefault(entry.name, []).extend(items)
    return _message({name: items[0] if len(items) == 1 else items for name, items in fields.items()}, path)


def _lines(name: str, value: Any, indent: str) -> list[str]:
    if isinstance(value, Mapping):
        body = [line for key, item in value.items() for line in _lines(key, item, indent + "  ")]
        return [f"{indent}{name} {{", *body, f"{indent}}}"]
    if isinstance(value, tuple):
        return [line for item in value for line in _lines(name, item, indent)]
    if isinstance(value, bool):
        return [f"{indent}{name}: {str(value).lower()}"]
    if isinstance(value, Word):
        return [f"{indent}{name}: {value}"]
    return [f"{indent}{name}: {quote(value) if isinstance(value, str) else value}"]


@dataclass(frozen=True)
class Message(Kind):
    """A nested Paddle message (``repeated``: a list of them), kept as data; empty by default."""

    repeated: bool = False  # type: ignore[misc]

    def describe(self) -> str:
        return "a list of messages (dicts)" if self.repeated else "a message (a dict)"

    def check(self, value: Any, path: str) -> MessageValue | tuple[MessageValue, ...]:
        if not self.repeated:
            return _message(value, path)
        if not isinstance(value, (list, tuple)):
            raise wrong_type_error(path, self.describe(), value)
        return tuple(_message(item, f"{path}[{i}]") for i, item in enumerate(value))

    def from_text(self, value: Any, path: str) -> MessageValue | tuple[MessageValue, ...]:
        """`value`: a block's entries (a list of blocks when repeated), as prototxt.read passes them."""
        blocks = value if self.repeated else [value]
        for block in blocks:
            if not isinstance(block, tuple):
                raise StrategyError(f"{path} is a message; write '{path.rpartition('.')[2]} {{ ... }}'")
        messages = tuple(_from_entries(block, path) for block in blocks)
        return messages if self.repeated else messages[0]

    def block_lines(self, name: str, value: Any, indent: str) -> list[str]:
        """The prototxt lines of the message (each of them, when repeated); none when empty."""
        return [] if not value else _lines(name, value, indent)
