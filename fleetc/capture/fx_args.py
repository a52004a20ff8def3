"""Arguments of an FX node in Program form: every node inside (nested lists, tuples, dicts) mapped to its value."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def map_node_args(value: Any, lookup: Callable[[torch.fx.Node], Any]) -> Any:
    """`value` with each FX node replaced by `lookup(node)`; tuples become lists, as Program op arguments are."""
    if isinstance(value, torch.fx.Node):
        return lookup(value)
    if isinstance(value, (list, tuple)):
        return [map_node_args(v, lookup) for v in value]
    if isinstance(value, dict):
        return {k: map_node_args(v, lookup) for k, v in value.items()}
    return value
