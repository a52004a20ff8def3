"""Shared setup for the CPU backend's tests: one kernel cache per session, and running one op's C++ kernel.

`cpu_kernel(op_type, args, kwargs)` plans the op from the given tensors (as the backend plans it from a Program's
Vars), builds its kernels synchronously and returns the bound callable with the reference's signature, so each
test compares `kernel(*args)` with `reference(*args)` on the same arguments.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from fleetc.codegen.cpu import backend
from fleetc.codegen.cpu.plan import CpuPlan
from fleetc.ir.program import Op, Ref, Var
from fleetc.ir.registry import import_target, resolve_callable


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def plan_for(op_type: str, args: tuple, kwargs: dict | None = None, attrs: dict | None = None) -> CpuPlan:
    """The CPU plan of `op_type` called on these arguments (tensors become Vars of their shape and dtype), for an
    op with these `attrs` (e.g. the layout pass's memory_format)."""
    names = iter(f"t{i}" for i in range(10_000))
    op_args, inputs = [], []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            name = next(names)
            op_args.append(Ref(name))
            inputs.append(Var(name, tuple(arg.shape), _dtype_name(arg)))
        elif isinstance(arg, (list, tuple)) and arg and all(isinstance(a, torch.Tensor) for a in arg):
            refs = [Ref(next(names)) for _ in arg]
            op_args.append(refs)
            inputs.append([Var(r.name, tuple(a.shape), _dtype_name(a)) for r, a in zip(refs, arg)])
        else:
            op_args.append(arg)
            inputs.append(None)
    op = Op("probe", op_type, tuple(op_args), dict(kwargs or {}), outputs=["out"], attrs=dict(attrs or {}))
    return import_target(backend.planner_of(op_type))(op, inputs)


def cpu_kernel(op_type: str, args: tuple, kwargs: dict | None = None, attrs: dict | None = None) -> Callable[..., Any]:
    """The op's C++ kernel(s), built now, bound to the reference's signature."""
    plan = plan_for(op_type, args, kwargs, attrs)
    return plan.bind([backend.build_async(k).result() for k in plan.kernels])


def run_both(op_type: str, args: tuple, kwargs: dict | None = None, seed: int = 0,
             attrs: dict | None = None) -> tuple[Any, Any, list, list]:
    """(kernel outputs, reference outputs, kernel's argument copies, reference's argument copies) from the same
    arguments and RNG seed; in-place updates show in the argument copies."""
    kwargs = kwargs or {}
    kernel = cpu_kernel(op_type, args, kwargs, attrs)
    got_args, want_args = copy.deepcopy(args), copy.deepcopy(args)
    torch.manual_seed(seed)
    got = kernel(*got_args, **kwargs)
    torch.manual_seed(seed)
    want = resolve_callable(op_type)(*want_args, **kwargs)
    return got, want, list(got_args), list(want_args)


def tensors(value: Any) -> list:
    """Every tensor in a (nested) result, None for a None output, in order."""
    if value is None or isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []


def assert_outputs(got: Any, want: Any, exact: bool, **tolerance: float) -> None:
    """Every output tensor equal (bit for bit when `exact`) and of the same dtype and shape."""
    got_t, want_t = tensors(got), tensors(want)
    assert len(got_t) == len(want_t)
    for i, (g, w) in enumerate(zip(got_t, want_t)):
        if w is None:
            assert g is None, f"output {i} should be None"
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, f"output {i}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}"
        if exact:
            assert torch.equal(g, w), f"output {i} differs in {(g != w).sum().item()} of {w.numel()} elements"
        else:
            torch.testing.assert_close(g, w, **tolerance, msg=lambda m: f"output {i}: {m}")
