"""Pipeline schedules as data: for each rank, the ordered list of actions it performs in one step.

An action is a forward or backward of one micro-batch on one (virtual) stage, a send or receive of an activation or
an activation gradient, or the optimizer step. Keeping the schedule as plain data means one simulator
(`simulate.py`) checks every schedule for deadlocks and measures its bubbles with no processes, and one executor
runs whichever schedule the strategy names.

Stages: with `vpp` virtual stages per rank (interleaved 1F1B) there are `ranks * vpp` model chunks; chunk `s`
lives on rank `s % ranks` (Megatron's and Paddle's placement), so a micro-batch visits every rank `vpp` times.
Backward kinds: `backward` is the whole backward of a chunk; zero-bubble schedules split it into `backward_input`
(B: the gradient with respect to the chunk's input, which the previous stage waits for) and `backward_weight`
(W: the parameter gradients, which nobody waits for and so can fill bubbles).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fleetc.errors import StrategyError
from fleetc.strategy.names import closest

FORWARD = "forward"
BACKWARD = "backward"
BACKWARD_INPUT = "backward_input"
BACKWARD_WEIGHT = "backward_weight"
SEND_ACTIVATION = "send_activation"
RECV_ACTIVATION = "recv_activation"
SEND_GRAD = "send_grad"
RECV_GRAD = "recv_grad"
OPTIMIZER = "optimizer"

COMPUTE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
_SHORT = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "Bi", BACKWARD_WEIGHT: "W", SEND_ACTIVATION: "send_act",
          RECV_ACTIVATION: "recv_act", SEND_GRAD: "send_grad", RECV_GRAD: "recv_grad", OPTIMIZER: "opt"}

SCHEDULE_MODES = ("FThenB", "1F1B", "VPP", "ZBH1")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule. `stage` is the model chunk (virtual stage); `peer` the other rank of a send or
    receive. The optimizer action has neither micro-batch nor stage (-1)."""

    kind: str
    microbatch: int = -1
    stage: int = -1
    peer: int = -1

    def __str__(self) -> str:
        if self.kind == OPTIMIZER:
            return "opt"
        text = f"{_SHORT[self.kind]}{self.microbatch}@s{self.stage}"
        if self.kind in (SEND_ACTIVATION, SEND_GRAD):
            return f"{text}->r{self.peer}"
        if self.kind in (RECV_ACTIVATION, RECV_GRAD):
            return f"{text}<-r{self.peer}"
        return text


@dataclass(frozen=True)
class Schedule:
    """The actions of every rank for one step: `ranks` pipeline ranks, `microbatches` micro-batches, `vpp` chunks
    per rank. `actions[r]` is rank r's list, in the order it runs them."""

    mode: str
    ranks: int
    microbatches: int
    vpp: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        return self.ranks * self.vpp

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.kind in COMPUTE_KINDS]

    def __str__(self) -> str:
        head = f"schedule {self.mode}: {self.ranks} rank(s), {self.microbatches} micro-batch(es)"
        head += f", {self.vpp} chunks per rank" if self.vpp > 1 else ""
        lines = [head]
        for rank, actions in enumerate(self.actions):
            lines.append(f"  rank {rank}: " + " ".join(str(a) for a in actions))
        return "\n".join(lines)


def build_schedule(mode: str, ranks: int, microbatches: int, vpp: int = 1) -> Schedule:
    """The schedule `mode` (one of SCHEDULE_MODES, Paddle's names) for `ranks` stages and `microbatches`.

    Raises StrategyError (with did-you-mean) for an unknown mode, and for settings the mode cannot use.
    """
    if mode not in _BUILDERS:
        hint = closest(mode, SCHEDULE_MODES)
        raise StrategyError(f"pipeline_configs.schedule_mode must be one of {', '.join(SCHEDULE_MODES)}, got "
                            f"{mode!r}" + (f"; did you mean {hint!r}?" if hint else ""))
    if ranks < 1 or microbatches < 1 or vpp < 1:
        raise StrategyError(f"a pipeline schedule needs at least one rank, micro-batch and chunk; got ranks={ranks}, "
                            f"micro-batches={microbatches}, vpp_degree={vpp}")
    if mode != "VPP" and vpp != 1:
        raise StrategyError(f"pipeline_configs.vpp_degree={vpp} needs schedule_mode 'VPP', not {mode!r}")
    if mode == "VPP" and microbatches % ranks:
        raise StrategyError(f"schedule_mode 'VPP' needs the micro-batch count (pipeline_configs.accumulate_steps="
                            f"{microbatches}) to be a multiple of the stage count {ranks}")
    orders = _BUILDERS[mode](ranks, microbatches, vpp)
    actions = tuple(tuple(_with_communication(order, rank, ranks, ranks * vpp)) for rank, order in enumerate(orders))
    return Schedule(mode, ranks, microbatches, vpp, actions)


def _with_communication(order: list[Action], rank: int, ranks: int, stages: int) -> list[Action]:
    """Rank `rank`'s compute order with a receive before each compute that needs another rank's result, a send
    after each that another rank needs, and the optimizer step at the end. Hand-offs within a rank need neither."""
    out: list[Action] = []
    for action in order:
        s, mb = action.stage, action.microbatch
        if action.kind == FORWARD and s > 0 and (s - 1) % ranks != rank:
            out.append(Action(RECV_ACTIVATION, mb, s, (s - 1) % ranks))
        if action.kind in (BACKWARD, BACKWARD_INPUT) and s < stages - 1 and (s + 1) % ranks != rank:
            out.append(Action(RECV_GRAD, mb, s, (s + 1) % ranks))
        out.append(action)
        if action.kind == FORWARD and s < stages - 1 and (s + 1) % ranks != rank:
            out.append(Action(SEND_ACTIVATION, mb, s, (s + 1) % ranks))
        if action.kind in (BACKWARD, BACKWARD_INPUT) and s > 0 and (s - 1) % ranks != rank:
            out.append(Action(SEND_GRAD, mb, s, (s - 1) % ranks))
    out.append(Action(OPTIMIZER))
    return out


def _fthenb(ranks: int, microbatches: int, vpp: int) -> list[list[Action]]:
    """GPipe: every forward, then every backward (in reverse micro-batch order, as GPipe frees activations)."""
    return [[Action(FORWARD, i, r) for i in range(microbatches)]
            + [Action(BACKWARD, i, r) for i in range(microbatches)] for r in range(ranks)]


def _one_f_one_b(ranks: int, microbatches: int, vpp: int) -> list[list[Action]]:
    """PipeDream-flush 1F1B: rank r runs ranks-r-1 warm-up forwards, then alternates forward and backward, then
    drains the remaining backwards; at most ranks-r micro-batches' activations are alive on rank r."""
    orders = []
    for r in range(ranks):
        warmup = min(ranks - r - 1, microbatches)
        order = [Action(FORWARD, i, r) for i in range(warmup)]
        for k in range(microbatches - warmup):
            order += [Action(FORWARD, warmup + k, r), Action(BACKWARD, k, r)]
        order += [Action(BACKWARD, i, r) for i in range(microbatches - warmup, microbatches)]
        orders.append(order)
    return orders


def _interleaved(ranks: int, microbatches: int, vpp: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: micro-batches go through the rank's chunks in groups of `ranks`; the warm-up is
    longer (2(ranks-r-1) + (vpp-1)·ranks virtual forwards) and the bubble shrinks by the factor vpp."""
    total = microbatches * vpp

    def chunk_and_mb(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // ranks) % vpp
        return (chunk if forward else vpp - 1 - chunk), (k // (ranks * vpp)) * ranks + k % ranks

    def virtual(k: int, rank: int, forward: bool) -> Action:
        chunk, mb = chunk_and_mb(k, forward)
        return Action(FORWARD if forward else BACKWARD, mb, chunk * ranks + rank)

    orders = []
    for r in range(ranks):
        warmup = total if microbatches == ranks and vpp > 1 else min(2 * (ranks - r - 1) + (vpp - 1) * ranks, total)
        order = [virtual(k, r, True) for k in range(warmup)]
        for k in range(total - warmup):
            order += [virtual(warmup + k, r, True), virtual(k, r, False)]
        order += [virtual(k, r, False) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def _zbh1(ranks: int, microbatches: int, vpp: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B's order of forwards and input-gradient backwards
    B, with the weight-gradient backwards W moved into the moments a rank would otherwise wait.

    Built by list scheduling with unit costs for F, B and W: a rank runs its next F or B when its input is there,
    else a pending W. Memory stays 1F1B's peak: no rank starts a forward while `ranks` micro-batches are held
    until their W (first stage's 1F1B peak), running a W first. With uniform costs each rank then idles (p-1)
    units, ZB-H1's (p-1)(F+B-W), against 1F1B's (p-1)(F+B+W)."""
    split = [[Action(BACKWARD_INPUT, a.microbatch, a.stage) if a.kind == BACKWARD else a for a in order]
             for order in _one_f_one_b(ranks, microbatches, 1)]
    finish: dict[tuple[str, int, int], int] = {}
    orders: list[list[Action]] = [[] for _ in range(ranks)]
    position = [0] * ranks
    pending_w: list[list[Action]] = [[] for _ in range(ranks)]
    busy_until = [0] * ranks

    def ready(a: Action, t: int) -> bool:
        """Whether `a`'s input from another rank is there at time t (every action started before t is recorded)."""
        if a.kind == FORWARD:
            done = 0 if a.stage == 0 else finish.get((FORWARD, a.microbatch, a.stage - 1))
        else:
            done = 0 if a.stage == ranks - 1 else finish.get((BACKWARD_INPUT, a.microbatch, a.stage + 1))
        return done is not None and done <= t

    t = 0
    while any(position[r] < len(split[r]) or pending_w[r] for r in range(ranks)):
        for r in range(ranks):
            if busy_until[r] > t:
                continue
            nxt = split[r][position[r]] if position[r] < len(split[r]) else None
            alive = sum(a.kind == FORWARD for a in orders[r]) - sum(a.kind == BACKWARD_WEIGHT for a in orders[r])
            if nxt is not None and ready(nxt, t) and not (nxt.kind == FORWARD and pending_w[r]
                                                          and alive >= ranks):
                action = nxt
                position[r] += 1
                if action.kind == BACKWARD_INPUT:
                    pending_w[r].append(Action(BACKWARD_WEIGHT, action.microbatch, action.stage))
            elif pending_w[r]:
                action = pending_w[r].pop(0)
            else:
                continue
            busy_until[r] = t + 1
            finish[(action.kind, action.microbatch, action.stage)] = t + 1
            orders[r].append(action)
        t += 1
    return orders


_BUILDERS: dict[str, Callable[[int, int, int], list[list[Action]]]] = {
    "FThenB": _fthenb, "1F1B": _one_f_one_b, "VPP": _interleaved, "ZBH1": _zbh1}
