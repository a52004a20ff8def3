"""Sharding stage 3 × pipeline: each pipeline stage's parameters live as flat pieces over its sharding group.

Between steps a rank holds only its piece of each of its stage's parameters: the stage's averaging bucket, split
evenly across the stage's sharding group as stage 2 splits it (passes/sharding/optimizer_sharding.py's
`_pipeline_stage_3`), so the piece a rank holds is exactly the piece whose reduce-scattered gradient it gets and
whose optimizer state it keeps. Each step:

- the stage's `gather` Program, run once before the stage's first micro-batch forward, all-gathers the stage's
  parameters whole (one `fleetc.c_sharding_param_gather_start` per bucket, every bucket issued before the first
  wait, then `fleetc.gathered_params` views);
- every micro-batch's forward and backward reads those whole parameters; the executor drops them after the
  stage's last compute action of the step (its last micro-batch backward), so the gathered stage parameters are
  in flight from the first forward to the last backward: one gather per step, not one per micro-batch. The
  trade-off, declared: no parameter is gathered twice in a step (a per-micro-batch gather would cost m gathers
  per step), but a stage's whole parameters are live for the step's compute, on top of the pieces;
- the optimizer Program reduce-scatters the summed gradients and updates this rank's pieces; nothing is gathered
  after it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fleetc.ir.program import Op, OpRole, Program, Var, VarKind
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel.common import var_numel
from fleetc.passes.sharding.flat_params import flat_parameter_plan
from fleetc.passes.sharding.param_sharding import gather_bucket, gathered_buffer_bytes
from fleetc.passes.sharding.plan import FlatBucket

if TYPE_CHECKING:
    from fleetc.passes.pipeline_parallel.partition import StagePrograms

GATHER_PHASE = "gather"


def gather_program(stage: StagePrograms, sharding: dict) -> Program:
    """The stage's gather Program: this rank's pieces of the stage's parameters in, every parameter the stage's
    forward or backward reads whole out (fetched under its own name). `sharding`: the stage's optimizer Program's
    sharding metadata (its flat buckets and this rank's pieces)."""
    program = Program()
    program.metadata = {"kind": f"pipeline stage {stage.stage} gather",
                        "collective_groups": dict(sharding["groups"])}
    block = program.global_block
    read = {}
    for phase in ("forward", "backward"):
        for var in stage.phases[phase].persistables():
            if var.kind is VarKind.PARAM:
                read.setdefault(var.name, var)
    sizes = {}
    for names in sharding["param_buckets"]:
        for name in names:
            var = read.get(name) or stage.phases["optimizer"].var(name)
            block.add_var(Var(name, var.shape, var.dtype, var.device, VarKind.PARAM))
            sizes[name] = var_numel(var)
    degree, rank = sharding["degree"], sharding["rank"]
    buckets = [FlatBucket.of(names, sizes, degree) for names in sharding["param_buckets"]]
    report = PassReport("sharding")
    renames: dict[str, str] = {}
    starts: list[Op] = []
    waits: list[Op] = []
    for gather in flat_parameter_plan(buckets, rank, degree)([n for b in buckets for n in b.names]):
        start, wait = gather_bucket(program, block, gather, [n for n in gather.names if n in read], "@FULL",
                                    OpRole.FORWARD, renames, report)
        starts.append(start)  # every bucket in flight before the first wait
        waits.extend(wait)
    block.ops = starts + waits
    program.fetches = {name: renames.get(name, name) for name in read if name in sizes}
    pieces = sharding["param_pieces"]
    for name, size in sizes.items():
        if name not in pieces:
            del block.vars[name]  # this rank holds nothing of it
        elif tuple(pieces[name]) != (0, size):
            block.vars[name].shape = (pieces[name][1] - pieces[name][0],)
    return program


def gathered_bytes(gather: Program) -> int:
    """Bytes a stage's gather Program makes whole: its gathered buffers (padded), in flight from the stage's first
    micro-batch forward to its last backward of each step; the same on every rank of the sharding group."""
    return sum(gathered_buffer_bytes(gather))
