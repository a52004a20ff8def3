"""The pipeline pass: place every op on a stage, check the split, and plan the schedule.

It reads the device_guard stages (or cuts the model automatically when there are none and
`hybrid_configs.pp_degree` > 1), validates them together with the micro-batch settings, builds the per-stage
Programs (`partition.py`) and the schedule, and runs the schedule in the simulator. The Program it returns is the
input with every forward and backward op, and every single-stage optimizer op, annotated with its stage, and
`metadata["pipeline"]` saying how it splits (stages, micro-batches, mode, predicted bubble fraction): `fleetc
dump-ir --pipeline` prints the per-stage Programs and the schedule from it.

`fleetc.compile` captures the training Program on one micro-batch and `step()` runs the plan with
`fleetc.runtime.pipeline_local` (every rank in one process, or one rank per process under torch.distributed).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from fleetc.comm.mesh import pipeline_degree
from fleetc.errors import PassStrategyError, StrategyError
from fleetc.ir.program import Program, VarKind
from fleetc.passes.base import PassReport
from fleetc.passes.pipeline_parallel.amp import CHECK_FINITE
from fleetc.passes.pipeline_parallel.auto import auto_partition
from fleetc.passes.pipeline_parallel.clip import SQUARED_NORM
from fleetc.passes.pipeline_parallel.forward_only import partition_forward
from fleetc.passes.pipeline_parallel.partition import PipelinePlan, partition
from fleetc.passes.pipeline_parallel.schedule import Schedule, build_schedule
from fleetc.passes.pipeline_parallel.simulate import simulate
from fleetc.passes.pipeline_parallel.stages import (
    assign_stages,
    has_stage_annotations,
    is_optimize,
    runs_whole,
)


class PipelineSplit:
    name = "pipeline_split"
    enabled_by = "pipeline"
    summary = "place ops on device_guard stages (or cut automatically), build per-stage Programs and the schedule"
    reads: tuple[str, ...] = ("pipeline", "pipeline_configs.micro_batch_size", "pipeline_configs.accumulate_steps",
                              "pipeline_configs.schedule_mode", "pipeline_configs.vpp_degree",
                              "hybrid_configs.pp_degree", "gradient_merge", "gradient_merge_configs.k_steps",
                              "gradient_merge_configs.avg")

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        whole = runs_whole(program)
        if whole:
            report.skipped_reason = whole
            return program, report
        pipe = config.pipeline_configs
        if program.metadata.get("kind") == "eval":
            return self._forward_only(program, pipe, report)
        annotated = has_stage_annotations(program)
        with _as_pass_error():
            stages = pipeline_degree(config, config.hybrid_configs.pp_degree,
                                      assign_stages(program).count if annotated else None)
        if stages == 1:
            report.skipped_reason = ("one stage: the model has no device_guard('stage:N') annotations and "
                                     "hybrid_configs.pp_degree is 1")
            return program, report
        if not annotated:
            report.notes.append(f"automatic cut into {stages} stages (hybrid_configs.pp_degree; no device_guard):")
            report.notes += [f"  {estimate}" for estimate in auto_partition(program, stages)]
        microbatches = pipe.accumulate_steps
        _check_batch(program, pipe.micro_batch_size)
        with _as_pass_error():
            schedule = _schedule(pipe.schedule_mode, stages, microbatches, pipe.vpp_degree)
        summed = {SQUARED_NORM: "global-norm gradient clipping", CHECK_FINITE: "amp (found_inf)"}
        over_stages = sorted({summed[op.type] for _, op in program.walk_ops() if op.type in summed})
        if pipe.vpp_degree > 1 and over_stages:
            raise PassStrategyError(f"{' and '.join(over_stages)} with schedule_mode VPP is not supported yet: the "
                                    "value is summed over the chunks, and a rank holding several would wait on "
                                    "itself; use 1F1B, FThenB or ZBH1 (or ClipGradByNorm for clipping)")
        plan = partition(program, microbatches)
        simulation = simulate(schedule)
        _annotate(program, plan)
        merge = config.gradient_merge_configs if config.gradient_merge else None
        program.metadata["pipeline"] = {"stages": stages, "microbatches": microbatches,
                                        "schedule_mode": pipe.schedule_mode, "vpp_degree": pipe.vpp_degree,
                                        "bubble_fraction": round(simulation.bubble_fraction, 4),
                                        "k_steps": merge.k_steps if merge else 1, "merge_avg": bool(merge and merge.avg)}
        if merge:
            report.notes.append(f"gradient merge: one update every {merge.k_steps} step() calls ({merge.k_steps} × "
                                f"{microbatches} micro-batches), on the gradients "
                                + ("averaged over" if merge.avg else "summed over") + " those calls")
        report.changed = True
        report.stats.update(stages=stages, microbatches=microbatches, shared_params=len(plan.shared),
                            boundary_values=sum(map(len, plan.activations)) + sum(map(len, plan.gradients)))
        report.notes += plan.describe().splitlines()
        report.notes += simulation.summary().splitlines()
        if microbatches < schedule.ranks:
            report.notes.append(f"accumulate_steps={microbatches} micro-batches for {schedule.ranks} pipeline ranks: "
                                f"valid but wasteful (bubble fraction {simulation.bubble_fraction:.0%}); use at least "
                                f"{schedule.ranks} micro-batches")
        return program, report

    @staticmethod
    def _forward_only(program: Program, pipe: Any, report: PassReport) -> tuple[Program, PassReport]:
        """An evaluation Program: forward-only pipelining over its device_guard stages, on the micro-batches the
        compiler captured it for (`metadata["pipeline_microbatches"]`, see `capture_microbatched`)."""
        stages = assign_stages(program).count
        if stages == 1:
            report.skipped_reason = "one stage: the device_guard annotations of the evaluation Program name one stage"
            return program, report
        if "dynamic" in program.metadata:
            report.skipped_reason = ("a dynamic-shape evaluation Program runs whole: pipeline messages have static "
                                     "shapes")
            return program, report
        microbatches = program.metadata.get("pipeline_microbatches", 1)
        plan = partition_forward(program, microbatches)
        program.metadata["pipeline"] = {"stages": stages, "microbatches": microbatches, "forward_only": True,
                                        "schedule_mode": pipe.schedule_mode, "vpp_degree": pipe.vpp_degree}
        report.changed = True
        report.stats.update(stages=stages, microbatches=microbatches)
        report.notes += plan.describe().splitlines()
        return program, report


@contextlib.contextmanager
def _as_pass_error() -> Iterator[None]:
    """A StrategyError from the mesh or schedule rules, raised as the pass's own (the manager lets those through)."""
    try:
        yield
    except PassStrategyError:
        raise
    except StrategyError as exc:
        raise PassStrategyError(str(exc)) from None


def _check_batch(program: Program, micro_batch_size: int) -> None:
    """The Program is captured on one micro-batch: every fed batch must hold micro_batch_size samples."""
    for name in program.feeds:
        var = program.var(name)
        if var.kind is VarKind.DATA and var.shape and isinstance(var.shape[0], int) \
                and var.shape[0] != micro_batch_size:
            raise PassStrategyError(f"input {name!r} of the captured micro-batch has batch size {var.shape[0]}, but "
                                    f"pipeline_configs.micro_batch_size is {micro_batch_size}")


def _schedule(mode: str, stages: int, microbatches: int, vpp: int) -> Schedule:
    if stages % vpp:
        raise PassStrategyError(f"pipeline_configs.vpp_degree={vpp} chunks per rank does not divide the model's "
                                f"{stages} stages")
    return build_schedule(mode, stages // vpp, microbatches, vpp)


def _annotate(program: Program, plan: PipelinePlan) -> None:
    """Write each op's stage into op_device (optimizer ops of parameters one stage holds included)."""
    stage_map = assign_stages(program)
    for op in program.global_block.ops:
        if op.name in stage_map.stage:
            op.attrs["op_device"] = f"stage:{stage_map.stage[op.name]}"
        elif is_optimize(op):
            holders = {s for stage in plan.stages for s in [stage.stage]
                       if any(o.name == op.name for o in stage.phases["optimizer"].global_block.ops)}
            if len(holders) == 1:
                op.attrs["op_device"] = f"stage:{holders.pop()}"


def pipeline_plan(program: Program) -> tuple[PipelinePlan, Schedule]:
    """The plan and schedule of a Program the pipeline pass annotated."""
    meta = program.metadata["pipeline"]
    return (partition(program, meta["microbatches"]),
            build_schedule(meta["schedule_mode"], meta["stages"] // meta["vpp_degree"], meta["microbatches"],
                           meta["vpp_degree"]))


def format_pipeline(program: Program) -> str:
    """What `fleetc dump-ir --pipeline` appends: the schedule, its simulation, and every stage's Programs."""
    if "pipeline" not in program.metadata:
        return "# no pipeline split in this Program (strategy.pipeline off, or one stage)\n"
    plan, schedule = pipeline_plan(program)
    parts = [str(schedule), simulate(schedule).summary(), plan.describe(), *(str(stage) for stage in plan.stages)]
    return "\n".join(parts) + "\n"
