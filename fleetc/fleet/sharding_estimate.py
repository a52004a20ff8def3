"""`fleetc shard-plan`: every rank's sharding plan and memory for a world size, before anything is launched.

One process captures the factory's training step and runs the data-parallel passes as if on
`--world-size` ranks (the passes never touch a process group: the Program only records the world size), then
computes each rank's ownership and bytes (passes/sharding/estimate.py) beside the ZeRO formula.
"""
from __future__ import annotations

from typing import Any

from fleetc.comm.mesh import resolve_mesh
from fleetc.compiler import CompiledTrainer
from fleetc.ir.liveness import estimate_memory
from fleetc.passes.base import PassReport
from fleetc.passes.instruments import VerifyInstrument
from fleetc.passes.manager import History, PassManager, PassRecord
from fleetc.passes.order import ordered_passes
from fleetc.passes.sharding.estimate import RankPlan, rank_plans

MB = 1 << 20


def plan_for_world(trainer: CompiledTrainer, world_size: int) -> tuple[Any, list[RankPlan]]:
    """(the process mesh, each rank's plan in its sharding group) of `trainer`'s last training Program on
    `world_size` ranks."""
    mesh, _ = resolve_mesh(trainer.config, world_size)
    program = trainer.history["capture"].program.clone()
    program.metadata["data_parallel"] = {"world_size": world_size}
    history = History([PassRecord("capture", program, PassReport("capture"), 0.0, estimate_memory(program))])
    final = PassManager(ordered_passes(trainer.config), [VerifyInstrument()]).run(program, trainer.config, history)
    return mesh, rank_plans(final, mesh.sharding, trainer.config.sharding_configs.stage,
                            trainer.config.sharding_configs.segment_broadcast_MB)


def format_plans(mesh: Any, plans: list[RankPlan], stage: int) -> str:
    """The table `fleetc shard-plan` prints; stage 3 on flat buckets adds the parameters gathered in flight."""
    flight = any(p.gathered_in_flight_bytes for p in plans)
    lines = [(f"process mesh {mesh}; sharding stage {stage}: each sharding group holds {mesh.sharding} rank(s); "
              "data-parallel replicas repeat the same plan"),
             f"{'rank':>5} {'params':>7} {'param MB':>9} {'grad MB':>9} {'state MB':>9} {'total MB':>9}"
             + (f" {'in flight MB':>13}" if flight else "")]
    for p in plans:
        lines.append(f"{p.rank:>5} {p.owned_params:>7} {p.parameter_bytes / MB:>9.3f} {p.gradient_bytes / MB:>9.3f} "
                     f"{p.optimizer_state_bytes / MB:>9.3f} {p.total_bytes / MB:>9.3f}"
                     + (f" {p.gathered_in_flight_bytes / MB:>13.3f}" if flight else ""))
    totals = [p.total_bytes for p in plans]
    lines.append(f"per rank: {min(totals) / MB:.3f} to {max(totals) / MB:.3f} MB (parameters, gradients kept for the "
                 "update, optimizer state; activations and collective buffers come on top)")
    if flight:
        lines.append(f"stage 3 also gathers up to {max(p.gathered_in_flight_bytes for p in plans) / MB:.3f} MB of "
                     "parameters in flight per rank (in flight MB: the bucket in use and the one prefetched)")
    return "\n".join(lines) + "\n"
