"""Checkpoints of the state fleetc itself owns (counters, accumulators), saved beside the model's and optimizer's."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fleetc.errors import CheckpointError

STATE_KEY = "fleetc_owned"


def owned_state_dict(owned: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """`{"fleetc_owned": {var name: tensor copy}}` for every fleetc-owned persistable bound so far."""
    return {STATE_KEY: {name: tensor.detach().clone() for name, tensor in sorted(owned.items())}}


def load_owned_state(owned: dict[str, torch.Tensor], state_dict: Mapping[str, Any]) -> None:
    """Copy a checkpoint into `owned`: in place for state already bound, as new entries otherwise.

    Entries not bound yet are checked against the Program that binds them (StateBinding). State
    already bound but absent from the checkpoint is an error: the run would resume half-restored.
    """
    entries = state_dict.get(STATE_KEY) if isinstance(state_dict, Mapping) else None
    if not isinstance(entries, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                   for k, v in entries.items()):
        raise CheckpointError(f"expected {{{STATE_KEY!r}: {{var name: tensor}}}} as returned by "
                              f"CompiledTrainer.state_dict(), got {type(state_dict).__name__} "
                              f"with keys {sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else '-'}")
    missing = sorted(set(owned) - set(entries))
    if missing:
        raise CheckpointError(f"the checkpoint lacks fleetc state {missing} that this trainer's compiled Programs use")
    for name, tensor in entries.items():
        current = owned.get(name)
        if current is None:
            owned[name] = tensor.detach().clone()
        elif (current.shape, current.dtype) != (tensor.shape, tensor.dtype):
            raise CheckpointError(f"checkpointed fleetc state {name!r} is {tensor.dtype}{list(tensor.shape)}, "
                                  f"but this trainer holds {current.dtype}{list(current.shape)}")
        else:
            current.copy_(tensor)
