"""Forward-only pipelining: an evaluation Program split into one forward Program per stage.

The stages come from the same `device_guard` annotations as training (stages.py). Stage s's Program receives what
the earlier stages send it, runs its ops for one micro-batch and sends on every value a later stage reads (relayed
stage by stage, as in training); the last stage also receives the outputs computed earlier and fetches every
output. The executor (runtime/pipeline_forward.py) runs the micro-batches through the stages and concatenates the
outputs, so the evaluation Program is captured on one micro-batch, and each output must be batch-major
(`batch_major_outputs`).
"""
from __future__ import annotations

from dataclasses import dataclass

from fleetc.errors import PassError
from fleetc.ir.program import Program, VarKind
from fleetc.passes.pipeline_parallel.partition import recv_ops, send_ops, sub_program
from fleetc.passes.pipeline_parallel.stages import assign_stages


@dataclass
class ForwardPlan:
    """Per-stage forward Programs of an evaluation Program, and what each stage sends to the next."""

    stages: list[Program]
    microbatches: int
    activations: list[list[str]]

    def describe(self) -> str:
        lines = [f"forward-only pipeline: {len(self.stages)} stage(s), {self.microbatches} micro-batch(es)"]
        for s, stage in enumerate(self.stages):
            lines.append(f"  stage {s}: {stage.num_ops()} ops"
                         + (f"; sends {', '.join(self.activations[s])} forward" if self.activations[s] else ""))
        return "\n".join(lines)


def partition_forward(program: Program, microbatches: int) -> ForwardPlan:
    """The ForwardPlan of an evaluation Program annotated with device_guard stages."""
    stage_map = assign_stages(program)
    ops = program.global_block.ops
    count, st = stage_map.count, stage_map.stage
    unplaced = [op for op in ops if op.name not in st]
    if unplaced:
        raise PassError(f"op {unplaced[0].name!r} ({unplaced[0].type}) of the evaluation Program is not a forward "
                        "op: it cannot be placed on a pipeline stage")
    reads_on: dict[str, set[int]] = {}
    for op in ops:
        for name in op.inputs:
            reads_on.setdefault(name, set()).add(st[op.name])
    for name in program.fetches.values():
        reads_on.setdefault(name, set()).add(count - 1)  # the last stage fetches every output
    produced_on = {n: st[op.name] for op in ops for n in op.defined}
    temp = {v.name for v in program.global_block.vars.values() if v.kind is VarKind.TEMP}
    activations = [sorted(n for n, p in produced_on.items() if n in temp and p <= s and max(reads_on[n]) > s)
                   for s in range(count)]
    stages = []
    for s in range(count):
        body = ((recv_ops(program, activations[s - 1], s - 1, "activation") if s > 0 and activations[s - 1] else [])
                + [op for op in ops if st[op.name] == s]
                + (send_ops(activations[s], s + 1, "activation") if s < count - 1 and activations[s] else []))
        fetches = dict(program.fetches) if s == count - 1 else {}
        defined = {n for op in body for n in op.defined}
        missing = sorted(set(fetches.values()) - defined)
        if missing:
            raise PassError(f"output {missing[0]!r} of the evaluation Program is no value a stage computes (an input "
                            "or a parameter returned as is): forward-only pipelining cannot fetch it")
        stages.append(sub_program(program, body, fetches, f"pipeline stage {s} forward (evaluation)"))
    return ForwardPlan(stages, microbatches, activations)


def batch_major_outputs(program: Program, micro_batch_size: int) -> str | None:
    """Why the outputs of an evaluation Program captured on one micro-batch cannot be concatenated over the
    micro-batches (None: each has the micro-batch as its leading dimension)."""
    for key, name in program.fetches.items():
        shape = program.var(name).shape
        if not shape or shape[0] != micro_batch_size:
            return (f"output {key} has shape {list(shape or [])}, not led by the micro-batch of {micro_batch_size} "
                    "samples")
    return None
