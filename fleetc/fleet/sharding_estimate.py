"""`fleetc shard-plan`: every rank's sharding plan and memory for a world size, before anything is launched.

One process captures the factory's training step and runs the data-parallel passes as if on
`--world-size` ranks (the passes never touch a process group: the Program only records the world size), then
computes each rank's ownership and bytes (passes/sharding/estimate.py) beside the ZeRO formula.

Then a few ranks are measured (`measure_ranks`): the real data-parallel trainer is built and runs one step as
that rank of the world, in this process, under torch's fake process group (comm/fake_group.py), and its
`memory_stats()["sharding"]` bytes are printed beside the estimate. Fake collectives move no data, so the step's
numbers are meaningless, but its Programs, plan and the bytes the rank holds are the real ones.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fleetc.comm.fake_group import fake_process_group
from fleetc.comm.mesh import ProcessMesh, resolve_mesh
from fleetc.compiler import CompiledTrainer
from fleetc.ir.liveness import estimate_memory
from fleetc.passes.base import PassReport
from fleetc.passes.instruments import VerifyInstrument
from fleetc.passes.manager import History, PassManager, PassRecord
from fleetc.passes.order import ordered_passes
from fleetc.passes.sharding.estimate import RankPlan, rank_plans

MB = 1 << 20
TOLERANCE = 0.10  # measured and estimated totals further apart than this get a line of their own


@dataclass(frozen=True)
class Measured:
    """One rank's bytes as the trainer measured them under the fake process group, and the checks it skipped."""
    rank: int  # in the sharding group (the plan's rank)
    world_rank: int
    stats: dict[str, Any]  # memory_stats()["sharding"]
    skipped: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return self.stats["total_bytes"]


def representative_ranks(plans: list[RankPlan]) -> list[int]:
    """The ranks measured by default: the first, the last, and the first whose piece is padding only (owns no
    parameter), if any."""
    picked = [plans[0].rank, plans[-1].rank]
    empty = [p.rank for p in plans if p.owned_params == 0 and p.rank not in picked]
    return sorted(set(picked + empty[:1]))


def measure_ranks(make_trainer: Callable[[], tuple[Any, tuple, dict]], mesh: ProcessMesh,
                  ranks: Sequence[int]) -> list[Measured]:
    """For each sharding rank in `ranks`, build the trainer (`make_trainer()` -> (trainer, args, kwargs), called
    under the fake group so the trainer sees this rank and world) and run one training step, as the first world
    rank with that sharding coordinate; the fake group is destroyed after each, error or not."""
    measured = []
    for rank in ranks:
        world_rank = next(r for r in range(mesh.world_size) if mesh.coordinates(r)["sharding"] == rank)
        with fake_process_group(world_rank, mesh.world_size) as skipped:
            trainer, args, kwargs = make_trainer()
            trainer.step(*args, **kwargs)
            measured.append(Measured(rank, world_rank, trainer.memory_stats()["sharding"], tuple(skipped)))
    return measured


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


def format_plans(mesh: Any, plans: list[RankPlan], stage: int, measured: Sequence[Measured] = ()) -> str:
    """The table `fleetc shard-plan` prints; stage 3 on flat buckets adds the parameters gathered in flight, and
    `measured` ranks a `measured MB` column ('-' for ranks not run) with notes below the table."""
    flight = any(p.gathered_in_flight_bytes for p in plans)
    by_rank = {m.rank: m for m in measured}
    lines = [(f"process mesh {mesh}; sharding stage {stage}: each sharding group holds {mesh.sharding} rank(s); "
              "data-parallel replicas repeat the same plan"),
             f"{'rank':>5} {'params':>7} {'param MB':>9} {'grad MB':>9} {'state MB':>9} {'total MB':>9}"
             + (f" {'measured MB':>12}" if measured else "") + (f" {'in flight MB':>13}" if flight else "")]
    for p in plans:
        seen = f" {by_rank[p.rank].total_bytes / MB:>12.3f}" if p.rank in by_rank else f" {'-':>12}"
        lines.append(f"{p.rank:>5} {p.owned_params:>7} {p.parameter_bytes / MB:>9.3f} {p.gradient_bytes / MB:>9.3f} "
                     f"{p.optimizer_state_bytes / MB:>9.3f} {p.total_bytes / MB:>9.3f}" + (seen if measured else "")
                     + (f" {p.gathered_in_flight_bytes / MB:>13.3f}" if flight else ""))
    totals = [p.total_bytes for p in plans]
    lines.append(f"per rank: {min(totals) / MB:.3f} to {max(totals) / MB:.3f} MB (parameters, gradients kept for the "
                 "update, optimizer state; activations and collective buffers come on top)")
    if flight:
        lines.append(f"stage 3 also gathers up to {max(p.gathered_in_flight_bytes for p in plans) / MB:.3f} MB of "
                     "parameters in flight per rank (in flight MB: the bucket in use and the one prefetched)")
    if measured:
        lines += measurement_notes(plans, measured)
    return "\n".join(lines) + "\n"


def measurement_notes(plans: list[RankPlan], measured: Sequence[Measured]) -> list[str]:
    """What was measured and how, each measured rank whose total (or stage 3's bytes in flight) is more than
    TOLERANCE from the estimate, and the checks skipped under the fake process group."""
    ranks = ", ".join(str(m.rank) for m in measured)
    lines = [f"measured MB: rank(s) {ranks} ran the trainer's first step under torch's fake process group (no data "
             "moves: losses are meaningless; Programs, plans and held bytes are real)"]
    for m in measured:
        plan = next(p for p in plans if p.rank == m.rank)
        for what, seen, guess in [("", m.total_bytes, plan.total_bytes),
                                  (" in flight", m.stats["gathered_in_flight_bytes"], plan.gathered_in_flight_bytes)]:
            if abs(seen - guess) > TOLERANCE * max(guess, 1):
                lines.append(f"rank {m.rank}: measured{what} {seen / MB:.3f} MB differs from the estimate "
                             f"{guess / MB:.3f} MB by more than {TOLERANCE:.0%}")
    skipped = list(dict.fromkeys(check for m in measured for check in m.skipped))
    for check in skipped:
        lines.append(f"skipped under the fake process group (its collectives return no data): {check}")
    return lines
