"""Names and small helpers every data-parallel allreduce pass shares (kept apart so those passes import no cycle)."""
from __future__ import annotations

from fleetc.ir.program import Program, Var

ALLOC = "aten.empty.memory_format"
AMP_CAST = "aten._to_copy.default"
START = "fleetc.c_allreduce_start"
WAIT = "fleetc.c_allreduce_wait"
SINGLE_PROCESS = "single process: no collectives needed"
GRAD_SUFFIX = "@GRAD"
LOCAL_SUFFIX = "@LOCAL"


def var_numel(var: Var) -> int:
    """Elements of a Var of static shape."""
    numel = 1
    for d in var.shape:
        numel *= d
    return numel


def common_module(program: Program, grads: list[str]) -> str:
    """The module path of the parameters behind `grads` when they share one, else ""."""
    paths = [g.removesuffix(GRAD_SUFFIX).rpartition(".")[0] for g in grads]
    return paths[0] if len(set(paths)) == 1 else ""
