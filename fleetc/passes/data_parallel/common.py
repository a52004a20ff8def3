"""Names and small helpers every data-parallel allreduce pass shares (kept apart so those passes import no cycle)."""
from __future__ import annotations

from fleetc.ir.program import Op, OpRole, Program, Var

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


def is_backward(op: Op) -> bool:
    """A backward op, not part of the update: where a parameter's gradient is also the gradient flowing on (with a
    batch of one, `x + pos` gives `pos` and `x` the same gradient Var), it must read the rank's own value, as eager
    autograd does; only the update reads the average."""
    return OpRole.BACKWARD in op.role and not op.role & (OpRole.OPTIMIZE | OpRole.LR_SCHED)
