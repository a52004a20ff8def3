"""Runs a PipelinePlan per a Schedule: every pipeline rank in one process (`LocalPipeline`, a thread per rank,
messages handed over in memory), or one rank per process over torch.distributed (`DistributedPipeline`).

Both execute exactly the per-stage Programs and per-rank action lists: a rank runs its actions in order; the
schedule's send/recv actions are carried out by the `fleetc.pipeline_send/recv` ops inside the stage Programs; the
optimizer action runs the optimizer Program of each of the rank's chunks on the gradients summed over the
micro-batches. Comparing `LocalPipeline` with eager PyTorch checks the partition and the schedules with no
processes.

A parameter several chunks hold (tied embeddings) is one tensor in the model. Within one process the lowest
holding chunk uses it and every other holder a copy made on the first step and kept, as separate processes would
each hold one; every copy gets the same update, so they stay equal (`replica_drift()` measures that).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fleetc.comm import groups
from fleetc.comm.env import collective_timeout
from fleetc.comm.p2p import DistributedChannel, run_local_ranks, use_channel
from fleetc.comm.plan import check_ranks_agree
from fleetc.errors import StrategyError
from fleetc.ir.program import Program
from fleetc.passes.pipeline_parallel.partition import PipelinePlan
from fleetc.passes.pipeline_parallel.schedule import (
    COMPUTE_KINDS,
    OPTIMIZER,
    Action,
    Schedule,
)
from fleetc.passes.pipeline_parallel.stage3 import GATHER_PHASE
from fleetc.runtime.executor import Executable
from fleetc.runtime.hyperparameters import HyperparameterFeeds
from fleetc.runtime.state import StateBinding


class PipelineExecutor:
    """The pipeline ranks `ranks_here` of a plan: their chunks' Executables and state, and one step's work.

    With gradient merge (`k_steps` > 1) the gradient sums carry over k_steps steps and only the last runs the
    optimizer actions, on the sums divided by k_steps when `merge_avg`: k_steps multiplies the update interval."""

    def __init__(self, program: Program, plan: PipelinePlan, schedule: Schedule, model: nn.Module,
                 optimizer: torch.optim.Optimizer, ranks_here: list[int], *, cpu_kernels: str | None = "off",
                 counters: dict[str, torch.Tensor] | None = None, k_steps: int = 1, merge_avg: bool = True):
        if schedule.stages != len(plan.stages):
            raise StrategyError(f"the schedule has {schedule.stages} chunks but the model has {len(plan.stages)} "
                                "device_guard stages")
        self.plan, self.schedule, self.ranks_here = plan, schedule, ranks_here
        self.binding = StateBinding(program, model, optimizer, {} if counters is None else counters)
        self.hyper = HyperparameterFeeds(program, model, optimizer)
        self.hyper_names = [spec["var"] for spec in program.metadata.get("optimizer", {}).get("feeds", [])]
        self.data_names = [n for n in program.feeds if n not in self.hyper_names]
        self.chunks = [s for s in range(schedule.stages) if schedule.rank_of(s) in ranks_here]
        self.executables = {s: {phase: Executable(p, cpu_kernels=cpu_kernels)
                                for phase, p in plan.stages[s].phases.items()} for s in self.chunks}
        self.holders: dict[str, list[int]] = {}
        for s in self.chunks:
            for p in plan.stages[s].phases.values():
                for var in p.persistables():
                    if s not in self.holders.setdefault(var.name, []):
                        self.holders[var.name].append(s)
        self.binding.keep_only(set(self.holders))  # no optimizer state for other ranks' stages or shards
        for s in self.chunks:  # sharding stage 2 cuts a stage's state into flat-bucket pieces
            if "optimizer" in plan.stages[s].phases:
                self.binding.take_pieces(plan.stages[s].phases["optimizer"])
        self.copies: dict[tuple[int, str], torch.Tensor] = {}
        # the action after which a (chunk, micro-batch)'s values are dead: its activations are freed there, so a
        # schedule holds only the micro-batches it has in flight (1F1B: at most p), not every one until the update
        self.last_reader: dict[tuple[int, int], Action] = {}
        self.last_compute: dict[int, Action] = {}  # each chunk's last compute action of a step
        for rank in ranks_here:
            for action in schedule.compute_actions(rank):
                self.last_reader[(action.stage, action.microbatch)] = action
                self.last_compute[action.stage] = action
        self.k_steps, self.merge_avg = k_steps, merge_avg
        self.steps_merged = 0  # steps whose gradients the carried sums hold
        self._carried: dict[int, dict[str, torch.Tensor]] | None = None
        self._period_flags: list = []

    @property
    def updates_next_step(self) -> bool:
        """Whether the next step runs the optimizer update (every k_steps-th under gradient merge)."""
        return (self.steps_merged + 1) % self.k_steps == 0

    def _finish(self, step: _Step) -> None:
        """After a step: keep its gradient sums for the next one, unless it updated."""
        self.steps_merged = 0 if step.update else self.steps_merged + 1
        self._carried = None if step.update else step.sums

    def merge_state(self) -> dict:
        """What this rank carries between gradient-merge updates (a checkpoint's part): the steps merged so far,
        each chunk's gradient sums, and the period's first-step optimizer flags."""
        return {"steps_merged": self.steps_merged, "period_flags": list(self._period_flags) if self._carried else [],
                "carried": {s: dict(sums) for s, sums in (self._carried or {}).items()}}

    def load_state(self, merge: dict | None) -> None:
        """After a checkpoint was restored into the model and optimizer: forget the copies of shared persistables
        (the next step copies them again) and take the carried gradient-merge state `merge_state()` gave (None:
        at an update boundary). StrategyError when it was carried by other chunks than this rank's."""
        self.copies.clear()
        if merge is None or merge["steps_merged"] == 0:
            self.steps_merged, self._carried, self._period_flags = 0, None, []
            return
        if sorted(merge["carried"]) != sorted(self.chunks) or merge["steps_merged"] >= self.k_steps:
            raise StrategyError(f"the checkpoint's gradient-merge sums are of chunks {sorted(merge['carried'])} "
                                f"after {merge['steps_merged']} steps, but this pipeline rank runs chunks "
                                f"{self.chunks} with k_steps={self.k_steps}: resume mid-period on the same pipeline")
        self.steps_merged = merge["steps_merged"]
        self._carried = {s: dict(sums) for s, sums in merge["carried"].items()}
        self._period_flags = list(merge["period_flags"])

    def _chunk_state(self, resolved: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
        states: dict[int, dict[str, torch.Tensor]] = {s: {} for s in self.chunks}
        for name, holders in self.holders.items():
            states[holders[0]][name] = resolved[name]
            for s in holders[1:]:
                if (s, name) not in self.copies:
                    self.copies[(s, name)] = resolved[name].detach().clone()
                states[s][name] = self.copies[(s, name)]
        return states

    def replica_drift(self) -> float:
        """The largest difference between a copy of a shared persistable and the model's own tensor."""
        resolved = self.binding.resolve()
        return max((float((copy - resolved[name].detach()).abs().max()) for (_, name), copy in self.copies.items()),
                   default=0.0)

    def held_values(self, name: str) -> dict[int, torch.Tensor]:
        """Each of this process's chunks' own tensor of the persistable `name` (the model's for its first holder, a
        copy for the others; a chunk not run yet has none): how a caller sees that per-stage state agrees, such as
        AMP's loss scale."""
        resolved = self.binding.resolve()
        holders = self.holders.get(name, [])
        return {s: resolved[name] if s == holders[0] else self.copies[(s, name)] for s in holders
                if s == holders[0] or (s, name) in self.copies}

    def _hyper_values(self) -> list:
        """The optimizer's values for this step. Under gradient merge, the flags saying that a piece of optimizer
        state does not exist yet (momentum's fresh buffer) are those of the merge period's first step: the state
        binding creates the state on that step, but no update has run on it until the period's last."""
        values = self.hyper.values()
        if self._carried is None:
            self._period_flags = values
            return values
        return [first if isinstance(first, bool) else now for first, now in zip(self._period_flags, values)]

    def _microbatches(self, args: tuple) -> list[dict[str, torch.Tensor]]:
        m = self.schedule.microbatches
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len(tensors) != len(self.data_names):
            raise StrategyError(f"the pipeline step takes {len(self.data_names)} tensor(s) "
                                f"({', '.join(self.data_names)}), got {len(tensors)}")
        for name, t in zip(self.data_names, tensors):
            if t.dim() == 0 or t.shape[0] % m:
                raise StrategyError(f"input {name!r} has batch size {t.shape[0] if t.dim() else 0}, which does not "
                                    f"divide into pipeline_configs.accumulate_steps={m} micro-batches")
        chunks = [t.chunk(m) for t in tensors]
        return [{name: c[i] for name, c in zip(self.data_names, chunks)} for i in range(m)]

    def _prepare(self, args: tuple) -> _Step:
        batches = self._microbatches(args)
        hyper = dict(zip(self.hyper_names, self._hyper_values()))
        step = _Step(self._chunk_state(self.binding.resolve()), hyper,
                     {(s, i): dict(batches[i]) for s in self.chunks for i in range(len(batches))},
                     self._carried or {s: {} for s in self.chunks}, {}, self.updates_next_step)
        for s in self.chunks:  # sharding stage 3: the chunk's parameters whole for this step's compute (stage3.py)
            gather = self.executables[s].get(GATHER_PHASE)
            if gather is not None:
                step.gathered[s] = {**step.states[s], **gather.run(step.states[s], [])}
        return step

    def _run_rank(self, rank: int, channel: Any, step: _Step) -> None:
        with use_channel(channel):
            for action in self.schedule.actions[rank]:
                if action.kind in COMPUTE_KINDS:
                    self._compute(action, channel, step)
                elif action.kind == OPTIMIZER and step.update:
                    scale = self.k_steps if self.merge_avg else 1
                    for s in range(rank, self.schedule.stages, self.schedule.ranks):
                        channel.stage, channel.microbatch = s, -1
                        exe = self.executables[s]["optimizer"]
                        sums = {n: g / scale for n, g in step.sums[s].items()} if scale > 1 else step.sums[s]
                        values = {**step.hyper, **sums}
                        exe.run(step.states[s], [values[n] for n in exe.program.feeds])

    def _compute(self, action: Action, channel: Any, step: _Step) -> None:
        s, mb = action.stage, action.microbatch
        channel.stage, channel.microbatch = s, mb
        exe = self.executables[s][action.kind]
        values = step.env[(s, mb)]
        out = exe.run(step.gathered.get(s, step.states[s]), [values[n] for n in exe.program.feeds])
        if self.last_compute[s] is action:  # its last micro-batch backward: the gathered parameters die
            step.gathered.pop(s, None)
        for key, value in out.items():
            if key == "loss":
                step.losses[mb] = value
                values[exe.program.fetches["loss"]] = value
            elif key.startswith("grad:"):
                name = key[5:]
                step.sums[s][name] = value if name not in step.sums[s] else step.sums[s][name] + value
            else:
                values[key] = value
        if self.last_reader[(s, mb)] is action:
            del step.env[(s, mb)]


class _Step:
    """One step's working set: per-chunk state, hyperparameters, per-(chunk, micro-batch) values, gradient sums
    per chunk, the last stage's micro-batch losses, and whether the step runs the optimizer update; under sharding
    stage 3 `gathered`: per chunk, its state with its parameters whole, until its last compute action."""

    def __init__(self, states: dict, hyper: dict, env: dict, sums: dict, losses: dict, update: bool):
        self.states, self.hyper, self.env, self.sums, self.losses = states, hyper, env, sums, losses
        self.update = update
        self.gathered: dict[int, dict[str, torch.Tensor]] = {}


class LocalPipeline(PipelineExecutor):
    """Every pipeline rank in this process, a thread each; `step(*batch)` returns the mean micro-batch loss."""

    def __init__(self, program: Program, plan: PipelinePlan, schedule: Schedule, model: nn.Module,
                 optimizer: torch.optim.Optimizer, *, timeout_s: float = 60.0, cpu_kernels: str | None = "off",
                 counters: dict[str, torch.Tensor] | None = None, k_steps: int = 1, merge_avg: bool = True):
        super().__init__(program, plan, schedule, model, optimizer, list(range(schedule.ranks)),
                         cpu_kernels=cpu_kernels, counters=counters, k_steps=k_steps, merge_avg=merge_avg)
        self.timeout_s = timeout_s

    def step(self, *args: Any) -> torch.Tensor:
        step = self._prepare(args)
        run_local_ranks(self.ranks_here, lambda rank, channel: self._run_rank(rank, channel, step), self.timeout_s,
                        "pipeline-rank")
        self._finish(step)
        return torch.stack([step.losses[i] for i in range(self.schedule.microbatches)]).mean()


class DistributedPipeline(PipelineExecutor):
    """This process's pipeline rank. `pp_ranks` are the global ranks of this process's pipeline group, in stage
    order (default: the whole job is one pipeline); `group` is that group's name among the runtime's communicator
    groups (`fleetc.comm.groups`; None: the default group). Every rank of a pipeline calls `step` with the same
    batch; every rank returns the same loss, broadcast from the last stage."""

    def __init__(self, program: Program, plan: PipelinePlan, schedule: Schedule, model: nn.Module,
                 optimizer: torch.optim.Optimizer, *, timeout_s: float = 60.0, cpu_kernels: str | None = "off",
                 counters: dict[str, torch.Tensor] | None = None, pp_ranks: list[int] | None = None,
                 group: str | None = None, k_steps: int = 1, merge_avg: bool = True):
        import torch.distributed as dist

        if pp_ranks is None and dist.get_world_size() != schedule.ranks:
            raise StrategyError(f"the pipeline has {schedule.ranks} ranks but the job has {dist.get_world_size()} "
                                "processes and no pipeline group was given (the data-parallel trainer gives it)")
        self.pp_ranks = list(range(dist.get_world_size())) if pp_ranks is None else list(pp_ranks)
        if len(self.pp_ranks) != schedule.ranks or dist.get_rank() not in self.pp_ranks:
            raise StrategyError(f"the pipeline has {schedule.ranks} ranks but rank {dist.get_rank()}'s pipeline "
                                f"group is {self.pp_ranks}")
        super().__init__(program, plan, schedule, model, optimizer, [self.pp_ranks.index(dist.get_rank())],
                         cpu_kernels=cpu_kernels, counters=counters, k_steps=k_steps, merge_avg=merge_avg)
        self.group = group
        self.timeout_s = timeout_s
        self.checked = False
        self.last_wait_s = 0.0  # of the last step: time blocked on P2P (what bench/pipeline.py reports as idle)

    def step(self, *args: Any) -> torch.Tensor:
        import torch.distributed as dist

        if not self.checked:  # a rank with another plan would wait on messages nobody sends
            check_ranks_agree("pipeline plan check (hash exchange before the first step)",
                              {"the pipeline schedule": str(self.schedule).splitlines(),
                               "the stage split": self.plan.describe().splitlines()},
                              "Every rank must compile the same model, strategy and micro-batch shapes.")
            self.checked = True
        step = self._prepare(args)
        rank = self.ranks_here[0]
        channel = DistributedChannel(lambda s: self.pp_ranks[self.schedule.rank_of(s)], self.timeout_s)
        self._run_rank(rank, channel, step)
        channel.finish()
        self._finish(step)
        self.last_wait_s = channel.waited_s
        last = self.schedule.rank_of(self.schedule.stages - 1)
        loss = (torch.stack([step.losses[i] for i in range(self.schedule.microbatches)]).mean() if rank == last
                else torch.zeros(()))
        dist.broadcast(loss, src=self.pp_ranks[last], group=None if self.group is None else groups.group(self.group))
        return loss


def first_microbatch(args: tuple, kwargs: dict, micro_batch_size: int, microbatches: int) -> tuple[tuple, dict]:
    """The step's arguments cut to their first micro-batch (what the pipeline captures), after checking that every
    tensor holds micro_batch_size × accumulate_steps samples (Paddle's rule)."""
    def cut(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        batch = value.shape[0] if value.dim() else 0
        if batch % microbatches:
            raise StrategyError(f"an input has batch size {batch}, which does not divide into "
                                f"pipeline_configs.accumulate_steps={microbatches} micro-batches")
        if batch != micro_batch_size * microbatches:
            raise StrategyError(f"an input has batch size {batch}, but pipeline_configs.micro_batch_size × "
                                f"accumulate_steps = {micro_batch_size} × {microbatches} = "
                                f"{micro_batch_size * microbatches}: one step() takes exactly that many samples")
        return value[:micro_batch_size]

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def make_pipeline(program: Program, model: nn.Module, optimizer: torch.optim.Optimizer,
                  counters: dict[str, torch.Tensor], cpu_kernels: str | None, pp_ranks: list[int] | None = None,
                  group: str | None = None) -> PipelineExecutor:
    """The executor `step()` uses for a Program the pipeline pass planned: every pipeline rank in this process, or,
    given this process's pipeline group (`pp_ranks`, global ranks in stage order, named `group`), its own rank of
    it over torch.distributed."""
    from fleetc.passes.pipeline_parallel.split import pipeline_plan

    plan, schedule = pipeline_plan(program)
    meta = program.metadata["pipeline"]
    merge = {"k_steps": meta.get("k_steps", 1), "merge_avg": meta.get("merge_avg", True)}
    if pp_ranks is None:
        return LocalPipeline(program, plan, schedule, model, optimizer, cpu_kernels=cpu_kernels, counters=counters,
                             **merge)
    return DistributedPipeline(program, plan, schedule, model, optimizer, cpu_kernels=cpu_kernels, counters=counters,
                               pp_ranks=pp_ranks, group=group, timeout_s=collective_timeout().total_seconds(), **merge)
