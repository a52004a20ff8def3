"""Registry of fleetc's own op types: one reference implementation each, device kernels, and how to resolve aten ops."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class OpDef:
    """A fleetc op type.

    `reference` is the op's one semantics (written with aten ops): the CPU path and the oracle of
    every generated kernel. It updates persistable outputs in place and returns only the
    temporary outputs, in order (a single tensor, a tuple, or None when there are none).
    `kernels` maps a device type ("cuda") to the "module:function" that runs the op there with the
    reference's signature; `kernel_sources` names the "module:function" that lists the generated
    sources of one op, `(op, input Vars) -> [KernelSource]`, for `dump-ir --kernels`. Both are
    imported on first use, so `import fleetc` never imports triton. `cpu_kernel` names the op's planner in
    the CPU backend (fleetc/codegen/cpu), `(op, input Vars) -> CpuPlan`: generated C++ kernels that the
    runtime switches an op to per Program when the backend is on (CPU tensors otherwise run the reference).
    `draws_random` says that the op advances the default random generator (a dropout that draws its mask or
    seed), so the scheduler keeps such ops in Program order and every draw sees what it saw in eager order.
    """

    name: str
    reference: Callable
    summary: str
    kernels: dict[str, str] = field(default_factory=dict)
    kernel_sources: str | None = None
    cpu_kernel: str | None = None
    draws_random: bool = False


_REGISTRY: dict[str, OpDef] = {}


def register_op(name: str, summary: str, *, kernels: dict[str, str] | None = None,
                kernel_sources: str | None = None, cpu_kernel: str | None = None,
                draws_random: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register `fn` as the reference semantics of op type `fleetc.<name>` (plus its device kernels)."""

    def wrap(fn: Callable) -> Callable:
        full = f"fleetc.{name}"
        if full in _REGISTRY:
            raise ValueError(f"op type {full!r} is registered twice")
        _REGISTRY[full] = OpDef(full, fn, summary, dict(kernels or {}), kernel_sources, cpu_kernel, draws_random)
        return fn

    return wrap


def op_def(op_type: str) -> OpDef:
    if op_type not in _REGISTRY:
        raise KeyError(f"unknown fleetc op type {op_type!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[op_type]


def registered_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)


def import_target(target: str) -> Any:
    """The object a "package.module:attribute" string names."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def device_kernel(op_type: str, device_type: str) -> Callable | None:
    """The function running a fleetc op on tensors of `device_type`, or None when only the reference exists."""
    target = op_def(op_type).kernels.get(device_type)
    return import_target(target) if target else None


def _dispatching(definition: OpDef) -> Callable:
    """Runs the op's device kernel when its first argument lives on a device that has one, else the reference."""
    reference, kernels, loaded = definition.reference, definition.kernels, {}

    def run(*args: Any, **kwargs: Any) -> Any:
        device_type = args[0].device.type
        if device_type not in kernels:
            return reference(*args, **kwargs)
        if device_type not in loaded:
            loaded[device_type] = import_target(kernels[device_type])
        return loaded[device_type](*args, **kwargs)

    run.__name__ = run.__qualname__ = definition.name.replace(".", "_")
    run.__doc__ = reference.__doc__
    return run


def resolve_callable(op_type: str) -> Callable:
    """The function that runs an op type: a torch OpOverload (`aten.mm.default`) or a fleetc op (kernel or reference)."""
    if op_type.startswith("fleetc."):
        definition = op_def(op_type)
        return _dispatching(definition) if definition.kernels else definition.reference
    namespace, _, rest = op_type.partition(".")
    packet_name, _, overload = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet_name), overload)
    except AttributeError as exc:
        raise KeyError(f"op type {op_type!r} is neither a fleetc op nor a torch operator overload") from exc
