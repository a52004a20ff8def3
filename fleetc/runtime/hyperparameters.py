"""Reads, every step, the values of a training Program's HYPER feeds from the user's optimizer.

Capture records where each fed value comes from (`program.metadata["optimizer"]["feeds"]`): a param
group's hyperparameter (`param_groups[g]["betas"][0]`), or whether a parameter's state still lacks
a key (SGD's "momentum buffer is fresh", decided per parameter as torch.optim decides it).
"""
from __future__ import annotations

import torch
from torch import nn

from fleetc.ir.program import Program


class HyperparameterFeeds:
    """The optimizer-derived feeds of one Program, in feed order."""

    def __init__(self, program: Program, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.optimizer = optimizer
        specs = program.metadata.get("optimizer", {}).get("feeds", []) if optimizer is not None else []
        params = dict(model.named_parameters())
        # (group index, key, tuple index) for hyperparameters; (param, state key) for fresh-state flags
        self._readers: list[tuple] = [
            (spec["group"], spec["key"], spec.get("index")) if "group" in spec
            else (params[spec["param"]], spec["absent"]) for spec in specs]

    def values(self) -> list:
        """The feeds' current values; call before the step's state binding creates missing state."""
        if not self._readers:
            return []
        groups, state = self.optimizer.param_groups, self.optimizer.state
        values = []
        for reader in self._readers:
            if len(reader) == 3:
                group, key, index = reader
                value = groups[group][key]
                values.append(float(value if index is None else value[index]))
            else:
                param, key = reader
                values.append(key not in state.get(param, ()))
        return values
