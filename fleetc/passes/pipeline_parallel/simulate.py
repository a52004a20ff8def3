"""Run a pipeline Schedule with no processes: check it cannot deadlock, time it, count its bubbles and activations.

Model: each rank runs its actions in order. A compute action takes `cost(action)` time units and needs its inputs
on the rank: a forward the activation of the previous chunk (received, or computed on the same rank), a backward
its own forward and the next chunk's input gradient, a weight-gradient backward its input-gradient backward, the
optimizer every backward of the rank. Sends are buffered (isend: the sender never waits; the message arrives
`latency` later); a receive waits for its message. A schedule that runs an action without its inputs, or where
every unfinished rank waits on a message nobody will send, is a ScheduleError naming the ranks and actions.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fleetc.errors import FleetcError
from fleetc.passes.pipeline_parallel.schedule import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMPUTE_KINDS,
    FORWARD,
    OPTIMIZER,
    RECV_ACTIVATION,
    RECV_GRAD,
    SEND_ACTIVATION,
    SEND_GRAD,
    Action,
    Schedule,
)


class ScheduleError(FleetcError):
    """A pipeline schedule that would deadlock or run an action before its inputs exist."""


@dataclass(frozen=True)
class Slot:
    """One compute action on the timeline: rank, start and end time."""

    rank: int
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class Simulation:
    """What running a schedule gives: the step's length, each rank's busy time, the timeline, the peak number of
    micro-batch chunks whose activations a rank holds (forward done, input-gradient backward not yet), and the peak
    number it holds anything of until its weight gradient is done (what a deferred W keeps alive)."""

    schedule: Schedule
    makespan: float
    busy: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    timeline: tuple[Slot, ...]
    peak_until_weights: tuple[int, ...] = ()

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle time over all ranks' time: (p-1)/(m+p-1) for FThenB and 1F1B with uniform costs."""
        return sum(self.idle) / (self.makespan * self.schedule.ranks) if self.makespan else 0.0

    def summary(self) -> str:
        lines = [f"{self.schedule.mode}: step {self.makespan:g} time units, bubble fraction {self.bubble_fraction:.3f}"]
        for r in range(self.schedule.ranks):
            lines.append(f"  rank {r}: busy {self.busy[r]:g}, idle {self.idle[r]:g} "
                         f"({self.idle[r] / self.makespan:.1%}), peak in-flight micro-batches {self.peak_in_flight[r]}")
        return "\n".join(lines)


def uniform_cost(schedule: Schedule) -> Callable[[Action], float]:
    """Unit forward, backward twice the forward (input and weight gradients one each), each split by the chunks."""
    per_kind = {FORWARD: 1.0, BACKWARD: 2.0, BACKWARD_INPUT: 1.0, BACKWARD_WEIGHT: 1.0}
    return lambda a: per_kind.get(a.kind, 0.0) / schedule.vpp


def simulate(schedule: Schedule, cost: Callable[[Action], float] | None = None, latency: float = 0.0) -> Simulation:
    """Run `schedule` (costs from `cost`, default `uniform_cost`); raise ScheduleError if it cannot complete."""
    cost = cost or uniform_cost(schedule)
    ranks = schedule.ranks
    last = schedule.stages - 1
    position = [0] * ranks
    clock = [0.0] * ranks
    busy = [0.0] * ranks
    done: list[set[tuple[str, int, int]]] = [set() for _ in range(ranks)]   # (kind, microbatch, stage)
    messages: dict[tuple[str, int, int, int], float] = {}                   # (kind, mb, stage, receiver) → arrival
    in_flight = [0] * ranks
    peak = [0] * ranks
    until_weights = [0] * ranks
    peak_weights = [0] * ranks
    timeline: list[Slot] = []

    def missing_input(rank: int, a: Action) -> str | None:
        have = done[rank]
        mb, s = a.microbatch, a.stage
        if a.kind == FORWARD and s > 0 and (FORWARD, mb, s - 1) not in have and (RECV_ACTIVATION, mb, s) not in have:
            return f"the activation of chunk {s - 1}"
        if a.kind in (BACKWARD, BACKWARD_INPUT):
            if (FORWARD, mb, s) not in have:
                return "its own forward"
            if s < last and not have & {(BACKWARD, mb, s + 1), (BACKWARD_INPUT, mb, s + 1), (RECV_GRAD, mb, s)}:
                return f"the input gradient of chunk {s + 1}"
        if a.kind == BACKWARD_WEIGHT and (BACKWARD_INPUT, mb, s) not in have:
            return "its input-gradient backward"
        if a.kind == OPTIMIZER:
            for s in range(rank, schedule.stages, ranks):
                for mb in range(schedule.microbatches):
                    if not have & {(BACKWARD, mb, s), (BACKWARD_WEIGHT, mb, s)}:
                        return f"the backward of micro-batch {mb} on chunk {s}"
        return None

    def step(rank: int) -> bool:
        """Run rank's next action if it can; False when it waits on a message."""
        a = schedule.actions[rank][position[rank]]
        if a.kind in (SEND_ACTIVATION, SEND_GRAD):
            key = (RECV_ACTIVATION if a.kind == SEND_ACTIVATION else RECV_GRAD,
                   a.microbatch, a.stage + (1 if a.kind == SEND_ACTIVATION else -1), a.peer)
            produced = (FORWARD,) if a.kind == SEND_ACTIVATION else (BACKWARD, BACKWARD_INPUT)
            if not any((k, a.microbatch, a.stage) in done[rank] for k in produced):
                raise ScheduleError(f"rank {rank} runs {a} before computing what it sends")
            if key in messages:
                raise ScheduleError(f"rank {rank} sends {a} twice")
            messages[key] = clock[rank] + latency
        elif a.kind in (RECV_ACTIVATION, RECV_GRAD):
            key = (a.kind, a.microbatch, a.stage, rank)
            if key not in messages:
                return False
            clock[rank] = max(clock[rank], messages.pop(key))
        else:
            why = missing_input(rank, a)
            if why:
                raise ScheduleError(f"rank {rank} runs {a} before it has {why}")
            duration = cost(a)
            if a.kind in COMPUTE_KINDS:
                timeline.append(Slot(rank, clock[rank], clock[rank] + duration, a))
            clock[rank] += duration
            busy[rank] += duration
            in_flight[rank] += 1 if a.kind == FORWARD else -1 if a.kind in (BACKWARD, BACKWARD_INPUT) else 0
            peak[rank] = max(peak[rank], in_flight[rank])
            until_weights[rank] += 1 if a.kind == FORWARD else -1 if a.kind in (BACKWARD, BACKWARD_WEIGHT) else 0
            peak_weights[rank] = max(peak_weights[rank], until_weights[rank])
        done[rank].add((a.kind, a.microbatch, a.stage))
        position[rank] += 1
        return True

    while True:
        progressed = False
        for r in range(ranks):
            while position[r] < len(schedule.actions[r]) and step(r):
                progressed = True
        if all(position[r] == len(schedule.actions[r]) for r in range(ranks)):
            break
        if not progressed:
            waiting = "; ".join(f"rank {r} waits at {schedule.actions[r][position[r]]}" for r in range(ranks)
                                if position[r] < len(schedule.actions[r]))
            raise ScheduleError(f"schedule {schedule.mode} deadlocks: {waiting}")
    if messages:
        raise ScheduleError(f"schedule {schedule.mode} sends messages nobody receives: "
                            + ", ".join(f"{k[0].replace('recv_', '')} of micro-batch {k[1]} for chunk {k[2]} to rank "
                                        f"{k[3]}" for k in sorted(messages)))
    makespan = max(clock)
    return Simulation(schedule, makespan, tuple(busy), tuple(peak), tuple(sorted(timeline, key=lambda s: s.start)),
                      tuple(peak_weights))
