"""Sharding × pipeline: ZeRO stages 1, 2 and 3 applied to each pipeline stage's optimizer Program, over its sharding
group.

A stage's optimizer Program runs once per step, after every micro-batch: it reads the gradients summed over the
micro-batches (a parameter several stages hold, such as tied embeddings: also summed over those stages), averages
them over the stage's replicas (replicas.py) and updates. That is the optimize section of a data-parallel Program,
so the sharding rewrite (passes/sharding/optimizer_sharding.py) applies to it as it is, with the stage's own ranks:

- the replicas of a stage are the ranks with its pp coordinate (the mesh's dp × sharding groups); its sharding group
  the ranks among them that differ only in the sharding coordinate (fleetc/comm/mesh.py);
- ownership is decided per stage, over the parameters the stage holds. A tied parameter gets an owner in each stage
  that holds it, independently: its gradient is summed over the stages before the averaging, so every holder
  updates it from the same values, whoever owns it;
- stage 1: the averaging allreduce stays; each rank updates what it owns; the stage's parameters are then
  all-gathered over its sharding group;
- stage 2: the averaging becomes a reduce-scatter over the sharding group (then an allreduce of the shard over the
  dp axis when dp > 1), so a rank keeps only its averaged gradients. The micro-batch gradient sums themselves stay
  whole: they accumulate over the micro-batches (as gradient merge's accumulators do), so stage 2 saves the
  averaged gradients over stage 1, not the sums;
- stage 3: stage 2's layout, the parameters held as pieces between steps and gathered once per step by the
  stage's `gather` Program (stage3.py).

The sharding pass, which runs before the split, records `metadata["sharding"]["per_stage"]` (the stage and the
gather bucket size) instead of rewriting the whole Program. `shard_stages` runs inside `partition`, which the
runtime calls again on the final Program, so it reads nothing but the Program's metadata.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import TYPE_CHECKING

from fleetc.ir.program import Program
from fleetc.passes.pipeline_parallel.stage3 import (
    GATHER_PHASE,
    gather_program,
    gathered_bytes,
)
from fleetc.passes.sharding.optimizer_sharding import Sharding

if TYPE_CHECKING:
    from fleetc.passes.pipeline_parallel.partition import StagePrograms


def shard_stages(program: Program, stages: list[StagePrograms]) -> str:
    """Shard every stage's optimizer Program in place when the sharding pass deferred to the split; records the
    parameters this rank owns (over all stages) and the sharding groups. Returns the plan's line about it ("": not
    sharded), the same on every rank."""
    meta = program.metadata.get("sharding") or {}
    per_stage = meta.get("per_stage")
    if not per_stage:
        return ""
    settings = SimpleNamespace(sharding_configs=SimpleNamespace(**per_stage))
    owned: list[str] = []
    layouts: dict[int, dict] = {}  # stage 3: each stage's flat buckets and this rank's pieces of them
    for stage in stages:
        optimizer = stage.phases["optimizer"]
        optimizer.metadata.update(
            sharding=copy.deepcopy(meta),
            state_bindings=dict(program.metadata.get("state_bindings", {})),
            **({"grad_clip": copy.deepcopy(program.metadata["grad_clip"])} if "grad_clip" in program.metadata else {}))
        Sharding().run(optimizer, settings)
        owned += optimizer.metadata["sharding"].get("owned", [])
        if per_stage["stage"] == 3:
            stage.phases[GATHER_PHASE] = gather_program(stage, optimizer.metadata["sharding"])
            layouts[stage.stage] = {key: optimizer.metadata["sharding"][key] for key in ("param_buckets",
                                                                                        "param_pieces")}
    meta["owned"] = sorted(set(owned))
    if layouts:
        meta["stage_layouts"] = layouts
    program.metadata.setdefault("collective_groups", {}).update(meta["groups"])
    how = ("reduce-scatters its gradients and " if per_stage["stage"] == 2 else "") + "updates the parameters it owns"
    if per_stage["stage"] == 3:
        in_flight = ", ".join(f"stage {stage.stage} {gathered_bytes(stage.phases[GATHER_PHASE])}" for stage in stages)
        return (f"sharding stage 3: each of a stage's {meta['degree']} sharding ranks holds a flat piece of the "
                "stage's parameters between steps; the stage's gather Program all-gathers them once per step, "
                "before its first micro-batch forward, and they stay gathered through its last micro-batch "
                f"backward (bytes in flight meanwhile: {in_flight}); its optimizer Program reduce-scatters the "
                "summed gradients and updates the pieces")
    return (f"sharding stage {per_stage['stage']}: in each stage's optimizer Program, each of the stage's "
            f"{meta['degree']} sharding ranks {how}, then the stage's parameters are all-gathered")
