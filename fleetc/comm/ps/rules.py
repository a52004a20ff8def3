"""The update rules servers run: torch.optim's SGD, Adam/AdamW and Adagrad, on dense parameters and on table rows.

Dense parameters follow torch's dense rule exactly (the same reference ops a compiled step runs). Table rows are
updated lazily: only the rows a step pushed gradients for change, and only their optimizer state moves (Adam on a
table is `torch.optim.SparseAdam`'s rule; SGD and Adagrad without weight decay or momentum give the same result as
the dense rule, since a zero gradient leaves a row unchanged). Weight decay on a table applies to touched rows only.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from fleetc.errors import FleetcError
from fleetc.ops.optimizer import adam, sgd

SUPPORTED = ("SGD", "Adam", "AdamW", "Adagrad")


def optimizer_spec(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The rule and hyperparameters servers apply, from the worker's torch optimizer (one param group; the learning
    rate also travels with every push, so set_lr and LR schedulers on the worker take effect)."""
    kind = type(optimizer).__name__
    if kind not in SUPPORTED:
        raise FleetcError(f"parameter-server mode runs the update on the servers and supports {', '.join(SUPPORTED)};"
                          f" {kind} is not one of them")
    if len(optimizer.param_groups) != 1:
        raise FleetcError(f"parameter-server mode supports one param group, the optimizer has "
                          f"{len(optimizer.param_groups)}")
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    if group.get("amsgrad"):
        raise FleetcError("parameter-server mode: Adam(amsgrad=True) is not supported on the servers")
    if kind == "Adagrad" and group.get("initial_accumulator_value", 0) < 0:
        raise FleetcError("Adagrad initial_accumulator_value must be non-negative")
    spec = {"type": kind, "maximize": bool(group.get("maximize", False)),
            "weight_decay": float(group.get("weight_decay", 0.0)), "lr": float(group["lr"])}
    if kind == "SGD":
        spec.update(momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                    nesterov=bool(group["nesterov"]))
    elif kind in ("Adam", "AdamW"):
        spec.update(beta1=float(group["betas"][0]), beta2=float(group["betas"][1]), eps=float(group["eps"]))
    else:
        spec.update(lr_decay=float(group["lr_decay"]), eps=float(group["eps"]),
                    initial_accumulator_value=float(group["initial_accumulator_value"]))
    return spec


def new_state(spec: dict[str, Any], param: torch.Tensor, table: bool) -> dict[str, torch.Tensor]:
    """Optimizer state for one parameter (or one server's shard of a table), created when the server starts."""
    kind = spec["type"]
    if kind == "SGD":
        if spec["momentum"] == 0:
            return {}
        return {"momentum_buffer": torch.zeros_like(param),
                "seen": torch.zeros(param.shape[0] if table else 1, dtype=torch.bool)}
    if kind in ("Adam", "AdamW"):
        return {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param),
                "step": torch.zeros((), dtype=torch.float32)}
    return {"sum": torch.full_like(param, spec["initial_accumulator_value"]),
            "step": torch.zeros((), dtype=torch.float32)}


def dense_update(spec: dict[str, Any], param: torch.Tensor, grad: torch.Tensor, state: dict, lr: float) -> None:
    """torch.optim's dense update of `param` by `grad`, in place."""
    kind, wd = spec["type"], spec["weight_decay"]
    if kind == "SGD":
        fresh = bool("seen" in state and not state["seen"][0])
        sgd(param, grad, state.get("momentum_buffer"), fresh, lr, spec["momentum"], spec["dampening"],
            spec["nesterov"], wd, spec["maximize"])
        if "seen" in state:
            state["seen"][0] = True
    elif kind in ("Adam", "AdamW"):
        adam(param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr, spec["beta1"], spec["beta2"],
             spec["eps"], wd, kind == "AdamW", spec["maximize"])
    else:
        grad = -grad if spec["maximize"] else grad
        state["step"] += 1
        if wd != 0:
            grad = grad.add(param, alpha=wd)
        clr = lr / (1 + (state["step"].item() - 1) * spec["lr_decay"])
        state["sum"].addcmul_(grad, grad, value=1)
        param.addcdiv_(grad, state["sum"].sqrt().add_(spec["eps"]), value=-clr)


def sparse_update(spec: dict[str, Any], table: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, state: dict,
                  lr: float) -> None:
    """The lazy update of the `rows` (unique local row indices) of a table shard by their gradients `grad`."""
    kind, wd = spec["type"], spec["weight_decay"]
    if spec["maximize"]:
        grad = -grad
    values = table[rows]
    if kind != "AdamW" and wd != 0:
        grad = grad.add(values, alpha=wd)
    if kind == "SGD":
        if spec["momentum"] != 0:
            old = state["momentum_buffer"][rows]
            fresh = ~state["seen"][rows]
            buf = torch.where(fresh.unsqueeze(1), grad, old * spec["momentum"] + grad * (1 - spec["dampening"]))
            state["momentum_buffer"][rows] = buf
            state["seen"][rows] = True
            grad = grad + buf * spec["momentum"] if spec["nesterov"] else buf
        table[rows] = values - lr * grad
    elif kind in ("Adam", "AdamW"):  # torch.optim.SparseAdam's rule (one step count per table)
        if kind == "AdamW" and wd != 0:
            values = values * (1 - lr * wd)
        state["step"] += 1
        step = state["step"].item()
        beta1, beta2 = spec["beta1"], spec["beta2"]
        old_avg, old_sq = state["exp_avg"][rows], state["exp_avg_sq"][rows]
        exp_avg = old_avg + (grad - old_avg) * (1 - beta1)
        exp_avg_sq = old_sq + (grad * grad - old_sq) * (1 - beta2)
        state["exp_avg"][rows], state["exp_avg_sq"][rows] = exp_avg, exp_avg_sq
        step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        table[rows] = values - step_size * exp_avg / exp_avg_sq.sqrt().add_(spec["eps"])
    else:
        state["step"] += 1
        clr = lr / (1 + (state["step"].item() - 1) * spec["lr_decay"])
        total = state["sum"][rows] + grad * grad
        state["sum"][rows] = total
        table[rows] = values - clr * grad / total.sqrt().add_(spec["eps"])
