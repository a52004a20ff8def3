"""The automatic partitioner: with no device_guard stages and `hybrid_configs.pp_degree` = S, cut the forward pass
into S contiguous stages of about equal estimated cost, and annotate the ops as device_guard would.

Cost of a forward op: its FLOPs (the recompute policy's estimate: 2·M·N·K for matmuls and convolutions, one per
output element otherwise) plus the bytes it writes, with its backward counted as twice its forward (so the
balance holds for the whole step). Memory of a stage: its parameters plus the activations its forward writes for
one micro-batch. The loss stays with the last stage.
"""
from __future__ import annotations

from dataclasses import dataclass

from fleetc.errors import PassStrategyError
from fleetc.ir.program import Op, OpRole, Program, VarKind
from fleetc.passes.pipeline_parallel.stages import is_backward, is_forward
from fleetc.passes.recompute.policy import RecomputePolicy


@dataclass(frozen=True)
class StageEstimate:
    """One stage of an automatic cut: its forward ops (first and last), estimated cost and memory."""

    stage: int
    first_op: str
    last_op: str
    ops: int
    cost: float
    param_bytes: int
    activation_bytes: int

    def __str__(self) -> str:
        return (f"stage {self.stage}: ops {self.first_op} .. {self.last_op} ({self.ops} forward ops), estimated "
                f"{self.cost / 1e6:.3g} MFLOP-equivalents per micro-batch, {self.param_bytes / 2**20:.3g} MiB "
                f"parameters + {self.activation_bytes / 2**20:.3g} MiB activations")


def op_cost(program: Program, op: Op, policy: RecomputePolicy) -> float:
    """Estimated FLOPs plus bytes written of a forward op, times 3 for forward + backward."""
    written = sum(v.nbytes() for n in op.defined if (v := program.find_var(n)) is not None)
    return 3.0 * (policy.cost(program, op) + written)


def auto_partition(program: Program, stages: int) -> list[StageEstimate]:
    """Annotate `program`'s forward ops (and the backward ops that name them) with `op_device="stage:N"`, cutting
    where the running cost crosses each S-th of the total; return the per-stage estimates."""
    forward = [op for op in program.global_block.ops if is_forward(op) and not op.role & OpRole.LOSS]
    if len(forward) < stages:
        raise PassStrategyError(f"hybrid_configs.pp_degree={stages} stages, but the model has only {len(forward)} "
                                "forward ops to divide among them")
    policy = RecomputePolicy()
    costs = [op_cost(program, op, policy) for op in forward]
    total = sum(costs) or 1.0
    assignment: list[int] = []
    running, stage = 0.0, 0
    for i, cost in enumerate(costs):
        ops_left, stages_after = len(forward) - i, stages - 1 - stage
        current_has_ops = bool(assignment) and assignment[-1] == stage
        if stages_after and current_has_ops and (running + cost / 2 > total * (stage + 1) / stages
                                                 or ops_left == stages_after):
            stage += 1
        assignment.append(stage)
        running += cost
    stage_of = {op.name: s for op, s in zip(forward, assignment)}
    _follow_consumers(program, forward, stage_of)
    for op in program.global_block.ops:
        if op.name in stage_of:
            op.attrs["op_device"] = f"stage:{stage_of[op.name]}"
        elif is_backward(op) and op.attrs.get("forward_op") in stage_of:
            op.attrs["op_device"] = f"stage:{stage_of[op.attrs['forward_op']]}"
    estimates = []
    for s in range(stages):
        ops = [op for op in forward if stage_of[op.name] == s]
        params = {n for op in ops for n in op.inputs
                  if (v := program.find_var(n)) is not None and v.kind is VarKind.PARAM}
        estimates.append(StageEstimate(
            s, ops[0].name, ops[-1].name, len(ops), sum(c for op, c in zip(forward, costs) if stage_of[op.name] == s),
            sum(program.var(n).nbytes() for n in params),
            sum(v.nbytes() for op in ops for n in op.defined if (v := program.find_var(n)) is not None
                and v.kind is VarKind.TEMP)))
    return estimates


def _follow_consumers(program: Program, forward: list[Op], stage_of: dict[str, int]) -> None:
    """Ops that read only parameters and inputs (a weight's transpose) go with their first consumer, so a cut never
    separates a parameter from the op that uses it."""
    produced = {n for op in forward for n in op.defined}
    for i, op in enumerate(forward):
        if any(n in produced for n in op.inputs):
            continue
        consumer = next((later for later in forward[i + 1:] if set(op.defined) & set(later.inputs)), None)
        alone = sum(stage_of[other.name] == stage_of[op.name] for other in forward) == 1
        if consumer is not None and not alone:
            stage_of[op.name] = stage_of[consumer.name]
