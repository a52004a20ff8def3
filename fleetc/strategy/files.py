"""Reading a strategy file for the command line: JSON or prototxt, chosen by extension or content."""

from __future__ import annotations

import os
import re
from pathlib import Path

from fleetc.errors import StrategyError
from fleetc.strategy.distributed import DistributedStrategy
from fleetc.strategy.textformat import read_source

PROTOTXT_SUFFIXES = (".prototxt", ".pbtxt", ".txt")


def load_strategy_file(path: str | os.PathLike[str]) -> DistributedStrategy:
    """A DistributedStrategy from a ``.json`` or ``.prototxt`` file; other names are judged by content
    (a JSON file starts with ``{``, a prototxt file never does). Errors name the file.
    """
    path = Path(path)
    text = read_source(path)
    suffix = path.suffix.lower()
    if suffix == ".json" or (suffix not in PROTOTXT_SUFFIXES and text.lstrip().startswith("{")):
        try:
            return DistributedStrategy.from_json(text)
        except StrategyError as exc:
            line = _json_line(text, str(exc))
            raise type(exc)(f"{path}{f':{line}' if line else ''}: {exc}") from None
    strategy = DistributedStrategy()
    strategy.load_from_prototxt(path)
    return strategy


def _json_line(text: str, message: str) -> int | None:
    """The line of the JSON text an error message is about: the one it names ("at line N"), or the line of the
    last key of the dotted path or quoted key it names (each key searched after the one before). None if not found."""
    named = re.search(r"at line (\d+)", message)
    if named:
        return None  # the message already says where
    found = re.match(r"(?:unknown \w+ field |key )?'?([A-Za-z_][\w.]*)'?", message)
    if not found:
        return None
    position = 0
    for key in found.group(1).split("."):
        at = text.find(f'"{key}"', position)
        if at < 0:
            return None
        position = at + 1
    if message.startswith("key "):  # a duplicate: the second occurrence
        again = text.find(f'"{found.group(1)}"', position)
        position = again + 1 if again >= 0 else position
    return text.count("\n", 0, position) + 1
