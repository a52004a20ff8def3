"""Upper bounds of dynamic dims, read from a model's config: a sequence is no longer than its position table.

A Hugging Face model's config says how many positions it embeds (`max_position_embeddings`, GPT-2's
`n_positions`, …). A longer sequence fails inside the model (an index past the table, or a broadcast of the
table's slice), so the dims named "seq" are traced with that upper bound: torch then simplifies `Min(64, seq)` to
`seq` instead of guarding on it, and the shape guard `seq <= 64` rejects a longer call by name, before anything
runs.
"""
from __future__ import annotations

from torch import nn

BOUNDED_DIM = "seq"
# Config fields holding the number of positions a model embeds, in the order they are looked for.
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_target_positions")


def config_bounds(model: nn.Module) -> dict[str, tuple[int, str]]:
    """{"seq": (bound, the config field it was read from)} from the first module (in `named_modules` order) whose
    `config` names its number of positions; {} when none does."""
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        for name in POSITION_FIELDS:
            value = getattr(config, name, None)
            if type(value) is int and value > 0:
                return {BOUNDED_DIM: (value, f"{path + '.' if path else ''}config.{name}")}
    return {}
