"""Registry of fleetc's own op types: one reference implementation each, plus how to resolve aten ops."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class OpDef:
    """A fleetc op type.

    `reference` is the op's one semantics (written with aten ops): the CPU path and the oracle of
    every generated kernel. It updates persistable outputs in place and returns only the
    temporary outputs, in order (a single tensor, a tuple, or None when there are none).
    """

    name: str
    reference: Callable
    summary: str


_REGISTRY: dict[str, OpDef] = {}


def register_op(name: str, summary: str) -> Callable[[Callable], Callable]:
    """Decorator: register `fn` as the reference semantics of op type `fleetc.<name>`."""

    def wrap(fn: Callable) -> Callable:
        full = f"fleetc.{name}"
        if full in _REGISTRY:
            raise ValueError(f"op type {full!r} is registered twice")
        _REGISTRY[full] = OpDef(full, fn, summary)
        return fn

    return wrap


def op_def(op_type: str) -> OpDef:
    if op_type not in _REGISTRY:
        raise KeyError(f"unknown fleetc op type {op_type!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[op_type]


def registered_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)


def resolve_callable(op_type: str) -> Callable:
    """The function that runs an op type: a torch OpOverload (`aten.mm.default`) or a fleetc reference."""
    if op_type.startswith("fleetc."):
        return op_def(op_type).reference
    namespace, _, rest = op_type.partition(".")
    packet_name, _, overload = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet_name), overload)
    except AttributeError as exc:
        raise KeyError(f"op type {op_type!r} is neither a fleetc op nor a torch operator overload") from exc
