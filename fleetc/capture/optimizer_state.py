"""How a torch.optim optimizer creates a parameter's state: its layout at capture time, its first values at run time.

Both come from the optimizer's own `_init_group` (what its `step()` runs before updating), called on
a shadow of the optimizer whose only parameter group holds one parameter and whose state starts
empty: on fake tensors to learn the state keys, shapes and dtypes, and on the real parameter to fill
`optimizer.state[param]` as the first eager `step()` would (Adagrad's initial accumulator, ASGD's
`eta = lr`, ...).
"""
from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fleetc.errors import UnsupportedOptimizerError


@dataclass(frozen=True)
class StateSlot:
    """One entry of `optimizer.state[param]`: its key and the tensor's shape, dtype and device."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    device: str


def shadow_optimizer(optimizer: torch.optim.Optimizer, group: dict[str, Any], state: Any) -> torch.optim.Optimizer:
    """A shallow copy of `optimizer` whose only param group is `group` and whose state is `state`; no hooks."""
    shadow = object.__new__(type(optimizer))  # not copy.copy: torch's __setstate__ would inspect the state
    shadow.__dict__.update(optimizer.__dict__)
    shadow.param_groups = [group]
    shadow.state = state
    shadow._optimizer_step_pre_hooks = {}
    shadow._optimizer_step_post_hooks = {}
    return shadow


def _run_init_group(optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor,
                    state: Any) -> None:
    init_group = getattr(type(optimizer), "_init_group", None)
    if init_group is None:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__} has no _init_group method, so fleetc cannot learn what state its step "
            "creates; torch.optim's single-step optimizers all have one")
    shadow = shadow_optimizer(optimizer, dict(group, params=[param]), state)
    lists = len(inspect.signature(init_group).parameters) - 2  # after self and group: the lists it fills
    init_group(shadow, shadow.param_groups[0], *([] for _ in range(lists)))


def state_layout(optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor) -> tuple[StateSlot, ...]:
    """The state tensors `optimizer` keeps for `param`: the existing ones, else what its first step creates."""
    existing = optimizer.state.get(param)
    if not existing:
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            fake.grad = torch.empty_like(fake)
            state: defaultdict = defaultdict(dict)
            _run_init_group(optimizer, group, fake, state)
            existing = state[fake]
    slots = []
    for key, value in existing.items():
        if not isinstance(value, torch.Tensor):
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__} keeps state {key!r} as {type(value).__name__}, not a tensor; fleetc binds "
                "optimizer state to Program variables, which are tensors")
        slots.append(StateSlot(key, tuple(value.shape), str(value.dtype).removeprefix("torch."), str(value.device)))
    return tuple(slots)


def initialize_state(optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor) -> list[str]:
    """Add to `optimizer.state[param]` the entries it lacks, with the values the optimizer's first eager step
    would create (entries already there, e.g. an AMP master weight, stay); returns the keys added."""
    saved_grad = param.grad
    param.grad = torch.zeros_like(param)  # _init_group only initializes parameters that have a gradient
    created: defaultdict = defaultdict(dict)
    try:
        _run_init_group(optimizer, group, param, created)
    finally:
        param.grad = saved_grad
    slot = optimizer.state[param]
    added = [key for key in created[param] if key not in slot]
    slot.update({key: created[param][key] for key in added})
    return added
