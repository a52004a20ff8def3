"""Wraps a model (and optional loss function) into one module whose forward returns the scalar loss."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from fleetc.errors import CaptureError

MODEL_ATTR = "model"


def extract_loss(output: Any) -> torch.Tensor:
    """The loss a model returned: a scalar tensor, an object with `.loss`, or a mapping with "loss"."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    else:
        raise CaptureError(
            f"loss_fn=None, so the model must return the loss, but it returned {type(output).__name__}: "
            "return a scalar tensor, an object with `.loss`, or a mapping with a 'loss' key, "
            "or pass loss_fn=... to fleetc.compile"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise CaptureError(
            f"the loss must be a one-element tensor, but it is {what}; with loss_fn=None the model itself must "
            "return the loss, otherwise pass loss_fn=... to fleetc.compile (e.g. torch.nn.functional.cross_entropy)"
        )
    return loss.reshape(())


class TrainStep(nn.Module):
    """`forward(*args, **kwargs)` is the loss of one training step.

    With a loss function the last positional argument is the target:
    `loss_fn(model(*args[:-1], **kwargs), args[-1])`.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable | None):
        super().__init__()
        setattr(self, MODEL_ATTR, model)
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        model = getattr(self, MODEL_ATTR)
        if self.loss_fn is None:
            return extract_loss(model(*args, **kwargs))
        return extract_loss(self.loss_fn(model(*args[:-1], **kwargs), args[-1]))


def split_step_args(args: tuple, loss_fn: Callable | None) -> tuple[tuple, tuple]:
    """(model's positional args, the target as a 1-tuple or empty) — for naming and eval calls."""
    if loss_fn is None:
        return args, ()
    if not args:
        raise CaptureError("with loss_fn given, step(*args) needs the target as its last positional argument")
    return args[:-1], args[-1:]
