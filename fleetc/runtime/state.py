"""Binds a Program's persistable Vars to live tensors: the user's parameters, buffers and optimizer state."""
from __future__ import annotations

import torch
from torch import nn

from fleetc.capture.optimizer_state import initialize_state
from fleetc.errors import CheckpointError, StrategyError
from fleetc.ir.program import FLEETC_OWNED_KINDS, Program, Var, VarKind
from fleetc.ops.optimizer import MASTER_KEY


class StateBinding:
    """Resolves, every step, the tensors behind a Program's persistables.

    Parameters and buffers are the module's own tensors (so `model.state_dict()` is always current);
    optimizer state lives in `optimizer.state[param]` under torch's own keys and is created there the
    first time it is needed, as the optimizer's own first step creates it (zero-filled where the step
    itself would create it, as SGD's momentum buffer); fleetc-owned state (counters, accumulators) lives in
    `counters`, created zero-filled unless a checkpoint already put it there.
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
        # sharding stage 2 on flat buckets: state Var → the [lo, hi) of the flattened state this rank keeps
        self.pieces: dict[str, tuple[int, int]] = dict(program.metadata.get("state_pieces", {}))
        self._convert_params(program, named)
        for var in program.persistables():
            if var.kind in (VarKind.PARAM, VarKind.BUFFER):
                self.fixed[var.name] = named[var.name]
            elif var.kind is VarKind.OPTIMIZER_STATE:
                param_name, key = bindings[var.name]
                self.optimizer_state.append((var.name, named[param_name], key, torch.Size(var.shape), var.torch_dtype))
            elif var.kind in FLEETC_OWNED_KINDS:
                counters[var.name] = _owned_tensor(var, counters.get(var.name))
        self.counter_names = [v.name for v in program.persistables() if v.kind in FLEETC_OWNED_KINDS]
        self.group_of = {id(p): group for group in (optimizer.param_groups if optimizer else ()) for p in group["params"]}
        self.declared = {(id(param), key): dtype for _, param, key, _, dtype in self.optimizer_state}

    def keep_only(self, names: set[str]) -> None:
        """Resolve only the optimizer state among `names` from now on: state no Program of this process reads (a
        pipeline rank's other stages, a sharding rank's foreign parameters) is then never created here."""
        self.optimizer_state = [entry for entry in self.optimizer_state if entry[0] in names]

    def take_pieces(self, program: Program) -> None:
        """Bind the optimizer state of `program` (a pipeline stage's optimizer Program, sharded on its own) with
        the shapes and flat-bucket pieces it declares, instead of the whole Program's."""
        shapes = {v.name: torch.Size(v.shape) for v in program.persistables() if v.kind is VarKind.OPTIMIZER_STATE}
        for name, piece in program.metadata.get("state_pieces", {}).items():
            if tuple(self.pieces.setdefault(name, tuple(piece))) != tuple(piece):
                raise StrategyError(f"sharding stage 2: optimizer state {name!r} is cut into different pieces by two "
                                    "pipeline stages of this rank; run one stage per rank with sharding")
        self.optimizer_state = [(n, param, key, shapes.get(n, shape), dtype)
                                for n, param, key, shape, dtype in self.optimizer_state]

    def _convert_params(self, program: Program, named: dict[str, torch.Tensor]) -> None:
        """amp use_pure_fp16 declares parameters in low precision: convert the module's own parameters in place
        (like Paddle's `decorate`), after seeding the optimizer's float32 `master_weight` from them."""
        for var in program.persistables():
            param = named.get(var.name)
            if var.kind is not VarKind.PARAM or param.dtype == var.torch_dtype:
                continue
            if self.optimizer is not None:
                self.optimizer.state[param].setdefault(MASTER_KEY, param.detach().float().clone())
            param.data = param.data.to(var.torch_dtype)

    def _create(self, param: torch.Tensor, key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """State the optimizer has not created yet: its own initial values (in the Program's dtype, which differs
        from a low-precision parameter's under use_pure_fp16), else zeros."""
        slot = self.optimizer.state[param]
        for added in initialize_state(self.optimizer, self.group_of[id(param)], param):
            slot[added] = slot[added].to(self.declared.get((id(param), added), slot[added].dtype))
        if key not in slot:
            slot[key] = torch.zeros(shape, dtype=dtype, device=param.device)
        return slot[key]

    def resolve(self) -> dict[str, torch.Tensor]:
        state = dict(self.fixed)
        if self.optimizer_state:
            opt_state = self.optimizer.state
            for var_name, param, key, shape, dtype in self.optimizer_state:
                slot = opt_state[param]
                tensor = slot.get(key)
                if tensor is None:
                    tensor = self._create(param, key, shape, dtype)
                if var_name in self.pieces and tensor.shape != shape:  # whole (created, loaded): keep this rank's piece
                    lo, hi = self.pieces[var_name]
                    tensor = slot[key] = tensor.reshape(-1)[lo:hi].clone()
                if tensor.dtype != dtype:
                    raise CheckpointError(
                        f"optimizer state {key!r} of {var_name.partition('@')[0]!r} is {tensor.dtype}, the Program "
                        f"declares {dtype}: under amp use_pure_fp16 call optimizer.load_state_dict before the first "
                        "step (torch casts loaded state to the parameter's dtype, now low precision)")
                state[var_name] = tensor
        for name in self.counter_names:
            state[name] = self.counters[name]
        return state


def _owned_tensor(var: Var, existing: torch.Tensor | None) -> torch.Tensor:
    """The tensor behind a fleetc-owned Var: `existing` (shared by every Program, maybe from a checkpoint) or zeros."""
    shape = torch.Size(var.shape or ())
    if existing is None:
        return torch.zeros(shape, dtype=var.torch_dtype, device=var.device)
    if (existing.shape, existing.dtype) != (shape, var.torch_dtype):
        raise CheckpointError(f"fleetc state {var.name!r} holds {existing.dtype}{list(existing.shape)} (from "
                         f"load_state_dict or another input signature), but the Program declares "
                         f"{var.torch_dtype}{list(shape)}")
    return existing.to(var.device)
