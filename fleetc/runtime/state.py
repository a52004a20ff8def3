"""Binds a Program's persistable Vars to live tensors: the user's parameters, buffers and optimizer state."""
from __future__ import annotations

import torch
from torch import nn

from fleetc.ir.program import Program, VarKind


class StateBinding:
    """Resolves, every step, the tensors behind a Program's persistables.

    Parameters and buffers are the module's own tensors (so `model.state_dict()` is always current);
    optimizer state lives in `optimizer.state[param]` under torch's own keys and is created there,
    zero-filled, the first time it is needed; fleetc counters live in `counters`.
    """

    def __init__(self, program: Program, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 counters: dict[str, torch.Tensor]):
        self.model = model
        self.optimizer = optimizer
        self.counters = counters
        named = dict(model.named_parameters())
        named.update(model.named_buffers())
        self.fixed: dict[str, torch.Tensor] = {}
        self.optimizer_state: list[tuple[str, torch.Tensor, str, torch.Size, torch.dtype]] = []
        bindings = program.metadata.get("state_bindings", {})
        for var in program.persistables():
            if var.kind in (VarKind.PARAM, VarKind.BUFFER):
                self.fixed[var.name] = named[var.name]
            elif var.kind is VarKind.OPTIMIZER_STATE:
                param_name, key = bindings[var.name]
                self.optimizer_state.append((var.name, named[param_name], key, torch.Size(var.shape), var.torch_dtype))
            elif var.kind is VarKind.COUNTER and var.name not in counters:
                counters[var.name] = torch.zeros(var.shape or (), dtype=var.torch_dtype, device=var.device)
        self.counter_names = [v.name for v in program.persistables() if v.kind is VarKind.COUNTER]

    def resolve(self) -> dict[str, torch.Tensor]:
        state = dict(self.fixed)
        if self.optimizer_state:
            opt_state = self.optimizer.state
            for var_name, param, key, shape, dtype in self.optimizer_state:
                slot = opt_state[param]
                tensor = slot.get(key)
                if tensor is None:
                    tensor = slot[key] = torch.zeros(shape, dtype=dtype, device=param.device)
                state[var_name] = tensor
        for name in self.counter_names:
            state[name] = self.counters[name]
        return state
