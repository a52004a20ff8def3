"""Reading a strategy file for the command line: JSON or prototxt, chosen by extension or content."""

from __future__ import annotations

import os
from pathlib import Path

from fleetc.errors import StrategyError
from fleetc.strategy.distributed import DistributedStrategy

PROTOTXT_SUFFIXES = (".prototxt", ".pbtxt", ".txt")


def load_strategy_file(path: str | os.PathLike[str]) -> DistributedStrategy:
    """A DistributedStrategy from a ``.json`` or ``.prototxt`` file; other names are judged by content
    (a JSON file starts with ``{``, a prototxt file never does). Errors name the file.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    if suffix == ".json" or (suffix not in PROTOTXT_SUFFIXES and text.lstrip().startswith("{")):
        try:
            return DistributedStrategy.from_json(text)
        except StrategyError as exc:
            raise type(exc)(f"{path}: {exc}") from None
    strategy = DistributedStrategy()
    strategy.load_from_prototxt(path)
    return strategy
