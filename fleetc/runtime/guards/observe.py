"""Builds a compiled step's guard record from the live model, optimizer and step arguments, and the cache key."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, keystr, tree_flatten_with_path

from fleetc.capture.attribute_reads import is_plain
from fleetc.capture.dynamic import DynamicDims
from fleetc.capture.int_arguments import is_carrier, tensor_positions
from fleetc.capture.hooks import registered_hooks
from fleetc.capture import param_names
from fleetc.ir.program import Program
from fleetc.runtime.guards.record import Guard, GuardRecord


def input_key(leaves: list, spec: TreeSpec, dynamic: DynamicDims | None = None) -> tuple:
    """The cache key of a step's arguments: their structure, each tensor's shape, dtype, device and requires_grad,
    and each other value (baked into the Program as a constant) by type and repr. A `dynamic` dim's size is
    replaced by its name: the Program's shape guards decide whether a size fits."""
    parts: list[tuple] = [(str(spec),)]
    position = {leaf: i for i, leaf in enumerate(tensor_positions(leaves))}  # the dynamic dims' numbering
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            shape = dynamic.masked(position[i], tuple(leaf.shape)) if dynamic else tuple(leaf.shape)
            parts.append((shape, leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            parts.append((type(leaf).__name__, repr(leaf)))
    return tuple(parts)


def _argument_guards(args: tuple, kwargs: dict[str, Any]) -> list[Guard]:
    guards = []
    for path, leaf in tree_flatten_with_path((args, kwargs))[0]:
        target = ("args" if path[0].idx == 0 else "kwargs") + keystr(path[1:])
        if isinstance(leaf, torch.Tensor):
            guards.append(Guard("input", target, {"shape": list(leaf.shape), "dtype": str(leaf.dtype).removeprefix(
                "torch."), "device": str(leaf.device), "requires_grad": leaf.requires_grad,
                **({"int_argument": True} if is_carrier(leaf) else {})}))
        else:
            guards.append(Guard("constant_arg", target, leaf if is_plain(leaf) else repr(leaf)))
    return guards


def _model_guards(model: nn.Module, program: Program, train: bool) -> list[Guard]:
    modules = list(model.named_modules())
    reads = program.metadata.get("attribute_reads", ())
    # The training flag of each module whose forward read it (an eval step runs every module in eval mode).
    guards = [Guard("training", path or "model", value) for path, name, value in reads if name == "training"
              and train]
    guards += [Guard("attribute", f"{path}.{name}" if path else name, value)
               for path, name, value in reads if name != "training"]
    guards += [Guard("module", path, type(module).__qualname__) for path, module in modules[1:]]
    guards += [Guard("tensor", name, {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")})
               for name, t in [*model.named_parameters(), *model.named_buffers()]]
    if train:
        guards += [Guard("requires_grad", name, p.requires_grad) for name, p in model.named_parameters()]
    return guards


def observe_guards(step_kind: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, args: tuple,
                   kwargs: dict[str, Any], program: Program) -> GuardRecord:
    """What the Program just compiled from `model` (and `optimizer`) on these arguments assumed."""
    train = step_kind == "train"
    guards = _argument_guards(args, kwargs) + _model_guards(model, program, train)
    if train and optimizer is not None:
        names = param_names(model)
        guards += [Guard("param_group", str(i), [names.get(id(p), f"<tensor {tuple(p.shape)}>")
                                                 for p in group["params"]])
                   for i, group in enumerate(optimizer.param_groups)]
    hooks = registered_hooks(model, optimizer if train else None)
    guards.append(Guard("hooks", "model, parameters and optimizer", hooks))
    return GuardRecord(step_kind, tuple(guards))
