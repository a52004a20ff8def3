"""Lowers a torch.optim optimizer into optimize-role ops appended to a training Program.

State tensors are named `<param>@<torch state key>` (e.g. `fc.weight@exp_avg`) and recorded in
`program.metadata["state_bindings"]`, so the runtime binds them to the user's `optimizer.state`.
Learning rates are host scalars fed every step (`lr@group<i>`), so LR changes need no recompile.
"""
from __future__ import annotations

import torch

from fleetc.errors import UnsupportedOptimizerError
from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind

SUPPORTED_OPTIMIZERS = ("SGD", "Adam", "AdamW")


def _check_supported(optimizer: torch.optim.Optimizer) -> str:
    kind = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        raise UnsupportedOptimizerError(
            f"optimizer {kind} has no Program lowering; supported: {', '.join(SUPPORTED_OPTIMIZERS)} from torch.optim"
        )
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "differentiable"):
            if group.get(flag):
                raise UnsupportedOptimizerError(f"{kind} param_groups[{i}] sets {flag}=True, which fleetc does not lower")
    return kind


_BAKED_HYPERPARAMETERS = ("momentum", "dampening", "nesterov", "weight_decay", "maximize", "betas", "eps",
                          "decoupled_weight_decay")


def optimizer_signature(optimizer: torch.optim.Optimizer) -> tuple:
    """The hyperparameters baked into the Program as constants: a change means recompiling (lr is fed)."""
    return tuple(tuple((k, repr(group.get(k))) for k in _BAKED_HYPERPARAMETERS) + (len(group["params"]),)
                 for group in optimizer.param_groups)


def _state_var(program: Program, param: Var, key: str, shape: tuple, dtype: str) -> Ref:
    name = f"{param.name}@{key}"
    program.global_block.add_var(Var(name, shape, dtype, param.device, VarKind.OPTIMIZER_STATE))
    program.metadata["state_bindings"][name] = [param.name, key]
    return Ref(name)


def _hyper(program: Program, name: str, dtype: str) -> Ref:
    program.global_block.add_var(Var(name, None, dtype, "cpu", VarKind.HYPER))
    program.feeds.append(name)
    return Ref(name)


def lower_optimizer(program: Program, optimizer: torch.optim.Optimizer, param_names: dict[int, str]) -> None:
    """Append one update op per parameter that has a gradient; grads stop being fetched."""
    kind = _check_supported(optimizer)
    program.metadata.setdefault("state_bindings", {})
    groups_meta = []
    block = program.global_block
    for gi, group in enumerate(optimizer.param_groups):
        lr = _hyper(program, f"lr@group{gi}", "float64")
        fresh = _hyper(program, f"momentum_fresh@group{gi}", "bool") if kind == "SGD" and group["momentum"] else False
        names = []
        for tensor in group["params"]:
            if id(tensor) not in param_names:
                raise UnsupportedOptimizerError(
                    f"{kind} param_groups[{gi}] holds a tensor of shape {tuple(tensor.shape)} that is not a "
                    "parameter of the compiled model"
                )
            name = param_names[id(tensor)]
            names.append(name)
            grad = program.fetches.pop(f"grad:{name}", None)
            if grad is None:
                continue  # no gradient reaches it: torch.optim skips such params too
            param = program.var(name)
            attrs = {"op_role": int(OpRole.OPTIMIZE), "module_path": name.rpartition(".")[0]}
            if kind == "SGD":
                buf = _state_var(program, param, "momentum_buffer", param.shape, param.dtype) if group["momentum"] else None
                op = Op(f"{name}.sgd", "fleetc.sgd",
                        (Ref(name), Ref(grad), buf, lr, fresh, float(group["momentum"]), float(group["dampening"]),
                         bool(group["nesterov"]), float(group["weight_decay"]), bool(group["maximize"])),
                        outputs=[name] + ([buf.name] if buf else []), attrs=attrs)
            else:
                states = [_state_var(program, param, key, param.shape, param.dtype) for key in ("exp_avg", "exp_avg_sq")]
                step = _state_var(program, param, "step", (), "float32")
                beta1, beta2 = (float(b) for b in group["betas"])
                op = Op(f"{name}.{kind.lower()}", "fleetc.adam",
                        (Ref(name), Ref(grad), *states, step, lr, beta1, beta2, float(group["eps"]),
                         float(group["weight_decay"]), kind == "AdamW" or bool(group.get("decoupled_weight_decay")),
                         bool(group["maximize"])),
                        outputs=[name, states[0].name, states[1].name, step.name], attrs=attrs)
            block.ops.append(op)
        groups_meta.append({"lr": lr.name, "momentum_fresh": fresh.name if fresh else None, "params": names})
    program.metadata["optimizer"] = {"type": kind, "groups": groups_meta}

