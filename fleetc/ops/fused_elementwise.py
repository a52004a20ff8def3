"""`fleetc.fused_elementwise`: a chain of pointwise aten ops (plus an optional trailing reduction) as one op.

The op's expression is plain data, so the Program stays JSON-serializable:

    outs = fleetc.fused_elementwise(*inputs, steps=STEPS, results=RESULTS, name="fused_add_gelu_3")

`STEPS` is a tuple of `(aten_op_type, args, kwargs)` with kwargs as a tuple of `(name, value)` pairs and
lists written as tuples. An operand `"%k"` names value k: values 0…n-1 are the op's inputs, value n+j is
the result of step j. `RESULTS` lists the values the op returns, in output order. The reference
semantics runs the steps with the very aten ops they name (so CPU results equal unfused execution
bit for bit); CUDA tensors run the Triton kernel that `fleetc.codegen.triton` generates for the op.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from fleetc.ir.registry import register_op, resolve_callable

OPERAND_PREFIX = "%"


def operand(index: int) -> str:
    """The step operand naming value `index`."""
    return f"{OPERAND_PREFIX}{index}"


def operand_index(value: Any) -> int | None:
    """The value index an operand names, or None for a constant."""
    if isinstance(value, str) and value.startswith(OPERAND_PREFIX) and value[1:].isdigit():
        return int(value[1:])
    return None


def short_op_name(op_type: str) -> str:
    """`aten.gelu_backward.default` → `gelu_backward` (kernel and op names are built from these)."""
    return op_type.split(".")[1]


@functools.lru_cache(maxsize=None)
def compile_reference(steps: tuple, results: tuple, num_inputs: int) -> Callable:
    """A Python function running the steps with their aten ops: one direct call per step, no interpretation."""
    namespace: dict[str, Any] = {}

    def emit(value: Any) -> str:
        index = operand_index(value)
        if index is not None:
            return f"v{index}"
        name = f"c{len(namespace)}"
        namespace[name] = value
        return name

    lines = [f"def evaluate({''.join(f'v{i}, ' for i in range(num_inputs))}):"]
    for j, (op_type, args, kwargs) in enumerate(steps):
        fn_name = f"op{j}"
        namespace[fn_name] = resolve_callable(op_type)
        call = [emit(a) for a in args] + [f"{k}={emit(v)}" for k, v in kwargs]
        lines.append(f"    v{num_inputs + j} = {fn_name}({', '.join(call)})")
    returned = ", ".join(f"v{r}" for r in results)
    lines.append(f"    return {returned}" + ("," if len(results) > 1 else ""))
    exec(compile("\n".join(lines) + "\n", "<fleetc fused_elementwise reference>", "exec"), namespace)
    return namespace["evaluate"]


def reference(*inputs: torch.Tensor, steps: tuple, results: tuple) -> Any:
    """The op's one semantics: the steps run with aten ops; one tensor, or a tuple for several results."""
    return compile_reference(steps, results, len(inputs))(*inputs)


@register_op("fused_elementwise", "a chain of pointwise aten ops with an optional trailing reduction, one kernel",
             kernels={"cuda": "fleetc.codegen.triton.launch:run_fused_elementwise"},
             kernel_sources="fleetc.codegen.triton:fused_elementwise_sources",
             cpu_kernel="fleetc.codegen.cpu.elementwise:plan_fused_elementwise")
def fused_elementwise(*inputs: torch.Tensor, steps: tuple, results: tuple, name: str) -> Any:
    """The reference path (CPU): the aten steps in order; CUDA tensors run the generated Triton kernel instead."""
    return compile_reference(steps, results, len(inputs))(*inputs)  # = reference(), one call layer less
