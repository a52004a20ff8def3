"""Wraps a model (and optional loss function) into one module whose forward returns the scalar loss."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fleetc.capture.int_arguments import is_carrier, tensor_positions
from fleetc.errors import CaptureError

MODEL_ATTR = "model"


def extract_loss(output: Any, *, loss_fn_given: bool) -> torch.Tensor:
    """The loss a model (or loss_fn) returned: a scalar tensor, an object with `.loss`, or a mapping with "loss"."""
    producer = "loss_fn" if loss_fn_given else "the model (loss_fn=None)"
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    elif loss_fn_given:
        raise CaptureError(f"loss_fn returned {type(output).__name__}; it must return the loss: a one-element "
                           "tensor (or an object with `.loss`, or a mapping with a 'loss' key)")
    else:
        raise CaptureError(
            f"loss_fn=None, so the model must return the loss, but it returned {type(output).__name__}: "
            "return a scalar tensor, an object with `.loss`, or a mapping with a 'loss' key, "
            "or pass loss_fn=... to fleetc.compile"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        hint = ("pass a loss_fn that reduces to one value (e.g. torch.nn.functional.cross_entropy)" if loss_fn_given
                else "the model itself must return the loss, otherwise pass loss_fn=... to fleetc.compile "
                     "(e.g. torch.nn.functional.cross_entropy)")
        raise CaptureError(f"the loss must be a one-element tensor, but {producer} gave {what}; {hint}")
    return loss.reshape(())


class StepInputs:
    """A step's (args, kwargs) split into the tensors the Program is fed and the rest, baked in as constants.

    Python scalars and other non-tensor arguments (`scale=2.0`, `use_cache=False`) specialize the Program: they
    are part of its cache key and guards, as torch.compile does; an int the dynamic policy marked comes as a size
    carrier (fleetc/capture/int_arguments.py), and the model gets its traced size where the int was.
    """

    def __init__(self, args: tuple, kwargs: dict[str, Any]):
        self.leaves, self.spec = tree_flatten((args, kwargs))
        self.tensor_positions = tensor_positions(self.leaves)
        self.carried = {i for i in self.tensor_positions if is_carrier(self.leaves[i])}
        self.ties: list[tuple[tuple[int, int], tuple[int, int]]] = []  # ((input, dim), (input, dim)) traced equal

    def tie(self, tensors: tuple) -> None:
        """Tell the trace that the tied dims are equal (`torch._check`): torch then gives them one symbol."""
        for (i, d), (j, e) in self.ties:
            torch._check(tensors[i].size(d) == tensors[j].size(e))

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.leaves[i] for i in self.tensor_positions)

    def rebuild(self, tensors: tuple) -> tuple[tuple, dict[str, Any]]:
        """(args, kwargs) with the constants of the example and `tensors` in the tensor places."""
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor.size(0) if position in self.carried else tensor
        return tree_unflatten(leaves, self.spec)


class TrainStep(nn.Module):
    """`forward(*tensors)` is the loss of one training step on the tensor arguments of `inputs`.

    With a loss function the last positional argument is the target:
    `loss_fn(model(*args[:-1], **kwargs), args[-1])`. A loss module is held, not registered as a submodule: its
    buffers (`nn.CrossEntropyLoss(weight=...)`) are not model state, so the trace lifts them as constants, like
    any other tensor the step reads that is neither a parameter nor a buffer of the model.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable | None, inputs: StepInputs):
        super().__init__()
        setattr(self, MODEL_ATTR, model)
        object.__setattr__(self, "loss_fn", loss_fn)
        self.inputs = inputs

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        model = getattr(self, MODEL_ATTR)
        self.inputs.tie(tensors)
        args, kwargs = self.inputs.rebuild(tensors)
        if self.loss_fn is None:
            return extract_loss(model(*args, **kwargs), loss_fn_given=False)
        return extract_loss(self.loss_fn(model(*args[:-1], **kwargs), args[-1]), loss_fn_given=True)


class EvalStep(nn.Module):
    """`forward(*tensors)` is the model's output on the tensor arguments of `inputs` (constants baked in)."""

    def __init__(self, model: nn.Module, inputs: StepInputs):
        super().__init__()
        setattr(self, MODEL_ATTR, model)
        self.inputs = inputs

    def forward(self, *tensors: torch.Tensor) -> Any:
        self.inputs.tie(tensors)
        args, kwargs = self.inputs.rebuild(tensors)
        return getattr(self, MODEL_ATTR)(*args, **kwargs)


def split_step_args(args: tuple, loss_fn: Callable | None) -> tuple[tuple, tuple]:
    """(model's positional args, the target as a 1-tuple or empty) — for naming and eval calls."""
    if loss_fn is None:
        return args, ()
    if not args:
        raise CaptureError("with loss_fn given, step(*args) needs the target as its last positional argument")
    return args[:-1], args[-1:]
