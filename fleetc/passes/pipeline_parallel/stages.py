"""Which pipeline stage each op of a training Program runs on, from `device_guard("stage:N")` annotations.

Ops traced inside `fleetc.device_guard("stage:N")` (and their backward ops) carry `op_device="stage:N"`. The rest
are placed by data flow: an unannotated forward op (the loss, say) joins the latest stage it reads from; an
unannotated backward op (gradient sums) the earliest stage it reads from, since gradients flow from the last stage
to the first; optimizer ops go with the parameter they update (`partition.py`). Validation names the first op
that breaks a rule: stages entered out of order, a stage with no ops, or a stage reading a later stage's forward.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fleetc.errors import PassError
from fleetc.ir.program import Op, OpRole, Program

_STAGE = re.compile(r"stage:(\d+)$")


def annotated_stage(op: Op) -> int | None:
    """The N of `op_device="stage:N"`, or None (no annotation, or a device such as "gpu:0")."""
    match = _STAGE.match(str(op.attrs.get("op_device", "")))
    return int(match.group(1)) if match else None


def is_forward(op: Op) -> bool:
    return bool(op.role & OpRole.FORWARD) and not op.role & (OpRole.BACKWARD | OpRole.OPTIMIZE)


def is_backward(op: Op) -> bool:
    return bool(op.role & OpRole.BACKWARD) and not op.role & OpRole.OPTIMIZE


def is_optimize(op: Op) -> bool:
    return bool(op.role & (OpRole.OPTIMIZE | OpRole.LR_SCHED))


def where(op: Op) -> str:
    """How an error names an op: its name, type and source line."""
    source = op.attrs.get("source")
    return f"op {op.name!r} ({op.type}{', ' + source if source else ''})"


def runs_whole(program: Program) -> str | None:
    """Why the pipeline pass leaves a Program whole whatever the stages (None: it splits it when there are several)."""
    if program.metadata.get("kind") == "eval":
        return (None if has_stage_annotations(program) else "an evaluation Program without device_guard stages "
                "runs whole (an automatic cut of it need not match the training cut)")
    if not any(is_optimize(op) for _, op in program.walk_ops()):
        return ("no optimizer update in the Program: pipelining needs fleetc.compile(optimizer=...) "
                "(without one, gradients go to p.grad and the Program runs whole)")
    return None


def pipelined(program: Program, config: Any) -> bool:
    """Whether the pipeline pass will split this Program into several stages (asked by the passes before it that
    would otherwise put per-step collectives into it: under pipeline, each stage averages its summed gradients
    across data-parallel replicas in its own optimizer Program instead)."""
    if not config.pipeline or runs_whole(program):
        return False
    return (pipeline_stages(program) or config.hybrid_configs.pp_degree) > 1


def pipeline_stages(program: Program) -> int | None:
    """The number of device_guard stages of a training Program (None: no annotations)."""
    return assign_stages(program).count if has_stage_annotations(program) else None


@dataclass
class StageMap:
    """`stage[op name]` for every forward and backward op; `count` stages; `producer[var]` the op defining it."""

    stage: dict[str, int]
    count: int
    producer: dict[str, Op]


def has_stage_annotations(program: Program) -> bool:
    return any(annotated_stage(op) is not None for _, op in program.walk_ops())


def assign_stages(program: Program) -> StageMap:
    """Place every forward and backward op of the (single-block) Program on a stage; raise PassError on bad input."""
    ops = program.global_block.ops
    producer = {name: op for op in ops for name in op.defined}
    stage: dict[str, int] = {}
    forward = [op for op in ops if is_forward(op)]
    _check_order(forward)
    for op in forward:
        fixed = annotated_stage(op)
        upstream = [stage[producer[n].name] for n in op.inputs if n in producer and producer[n].name in stage]
        if fixed is not None and upstream and max(upstream) > fixed:
            raise PassError(f"{where(op)} is on pipeline stage {fixed} but reads a value computed on stage "
                            f"{max(upstream)}: a stage may only read from earlier stages")
        stage[op.name] = fixed if fixed is not None else max(upstream, default=-1)
    _place_from_consumers(forward, stage, first_consumer=True)
    backward = [op for op in ops if is_backward(op)]
    for op in backward:
        fixed = annotated_stage(op)
        upstream = [stage[producer[n].name] for n in op.inputs
                    if n in producer and stage.get(producer[n].name, -1) >= 0]
        by_forward = stage.get(op.attrs.get("forward_op", ""), -1)
        stage[op.name] = fixed if fixed is not None else min(upstream) if upstream else by_forward
    _place_from_consumers(backward, stage, first_consumer=False)
    used = sorted(set(stage.values()))
    count = used[-1] + 1 if used else 1
    missing = sorted(set(range(count)) - set(used))
    if missing:
        raise PassError(f"pipeline stage {missing[0]} has no ops: device_guard uses stages "
                        f"{', '.join(map(str, used))}; number the stages 0..{len(used) - 1} without gaps")
    return StageMap(stage, count, producer)


def _check_order(forward: list[Op]) -> None:
    """The forward pass must enter the annotated stages in increasing order (Paddle's rule)."""
    highest, highest_op = -1, None
    for op in forward:
        s = annotated_stage(op)
        if s is None:
            continue
        if s < highest:
            raise PassError(f"{where(op)} is on pipeline stage {s} but comes after {where(highest_op)} on stage "
                            f"{highest}: device_guard stages must be entered in increasing order")
        if s > highest:
            highest, highest_op = s, op


def _place_from_consumers(ops: list[Op], stage: dict[str, int], first_consumer: bool) -> None:
    """Ops still unplaced (-1: they read only parameters and inputs) join the stage of their earliest consumer;
    failing that, the first stage (forward) or, for backward, the stage of the forward op they differentiate."""
    readers: dict[str, list[str]] = {}
    for op in ops:
        for name in op.inputs:
            readers.setdefault(name, []).append(op.name)
    for op in reversed(ops):
        if stage[op.name] >= 0:
            continue
        consumers = [stage[r] for n in op.defined for r in readers.get(n, ()) if stage.get(r, -1) >= 0]
        stage[op.name] = min(consumers) if consumers else 0
