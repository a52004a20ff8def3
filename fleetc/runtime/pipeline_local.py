"""Runs a PipelinePlan per a Schedule inside one process: each pipeline rank is a thread, messages are hand-offs.

This executes exactly the per-stage Programs and the per-rank action lists that a multi-process run executes (the
same `fleetc.pipeline_send/recv` ops, over a `LocalMailbox` instead of torch.distributed), so comparing it with
eager PyTorch checks the partition and the schedules without processes. A rank runs its actions in order; the
send/recv actions of the schedule are carried out by the ops inside the stage Programs, the optimizer action runs
the optimizer Program of each of the rank's chunks on the gradients summed over the micro-batches.

A parameter several chunks hold (tied embeddings) is one tensor in the model; the lowest chunk uses it and every
other holder a copy made on the first step and kept, as separate processes would each hold one. Every copy gets
the same update, so they stay equal (`replica_drift()` measures that).
"""
from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from fleetc.comm.p2p import LocalChannel, LocalMailbox, use_channel
from fleetc.errors import StrategyError
from fleetc.ir.program import Program
from fleetc.passes.pipeline_parallel.partition import PipelinePlan
from fleetc.passes.pipeline_parallel.schedule import COMPUTE_KINDS, OPTIMIZER, Action, Schedule
from fleetc.runtime.executor import Executable
from fleetc.runtime.hyperparameters import HyperparameterFeeds
from fleetc.runtime.state import StateBinding


class LocalPipeline:
    """`step(*batch)` trains one step on a batch of m micro-batches and returns the mean micro-batch loss."""

    def __init__(self, program: Program, plan: PipelinePlan, schedule: Schedule, model: nn.Module,
                 optimizer: torch.optim.Optimizer, *, timeout_s: float = 60.0, cpu_kernels: str | None = "off"):
        if schedule.stages != len(plan.stages):
            raise StrategyError(f"the schedule has {schedule.stages} chunks but the model has {len(plan.stages)} "
                                "device_guard stages")
        self.plan, self.schedule, self.timeout_s = plan, schedule, timeout_s
        self.binding = StateBinding(program, model, optimizer, {})
        self.hyper = HyperparameterFeeds(program, model, optimizer)
        self.hyper_names = [spec["var"] for spec in program.metadata.get("optimizer", {}).get("feeds", [])]
        self.data_names = [n for n in program.feeds if n not in self.hyper_names]
        self.executables = [{phase: Executable(p, cpu_kernels=cpu_kernels) for phase, p in stage.phases.items()}
                            for stage in plan.stages]
        self.holders: dict[str, list[int]] = {}
        for stage in plan.stages:
            for p in stage.phases.values():
                for var in p.persistables():
                    if stage.stage not in self.holders.setdefault(var.name, []):
                        self.holders[var.name].append(stage.stage)
        self.copies: dict[tuple[int, str], torch.Tensor] = {}

    def _stage_state(self, resolved: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        states = []
        for stage in self.plan.stages:
            state = {}
            for name, holders in self.holders.items():
                if stage.stage not in holders:
                    continue
                if stage.stage == holders[0]:
                    state[name] = resolved[name]
                else:
                    key = (stage.stage, name)
                    if key not in self.copies:
                        self.copies[key] = resolved[name].detach().clone()
                    state[name] = self.copies[key]
            states.append(state)
        return states

    def replica_drift(self) -> float:
        """The largest difference between a copy of a shared persistable and the model's own tensor."""
        resolved = self.binding.resolve()
        return max((float((copy - resolved[name]).abs().max()) for (_, name), copy in self.copies.items()),
                   default=0.0)

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

    def step(self, *args: Any) -> torch.Tensor:
        batches = self._microbatches(args)
        hyper = dict(zip(self.hyper_names, self.hyper.values()))
        states = self._stage_state(self.binding.resolve())
        env = {(s, i): dict(batches[i]) for s in range(len(self.plan.stages)) for i in range(len(batches))}
        sums: list[dict[str, torch.Tensor]] = [{} for _ in self.plan.stages]
        losses: dict[int, torch.Tensor] = {}
        mailbox = LocalMailbox(self.timeout_s)
        errors: list[BaseException] = []

        def run_rank(rank: int) -> None:
            channel = LocalChannel(mailbox, rank)
            try:
                with use_channel(channel):
                    for action in self.schedule.actions[rank]:
                        if action.kind in COMPUTE_KINDS:
                            self._compute(action, channel, states, env, sums, losses)
                        elif action.kind == OPTIMIZER:
                            for s in range(rank, self.schedule.stages, self.schedule.ranks):
                                channel.stage, channel.microbatch = s, -1
                                exe = self.executables[s]["optimizer"]
                                values = {**hyper, **sums[s]}
                                exe.run(states[s], [values[n] for n in exe.program.feeds])
            except BaseException as exc:  # noqa: BLE001  (re-raised in the calling thread)
                errors.append(exc)

        threads = [threading.Thread(target=run_rank, args=(r,), name=f"pipeline-rank-{r}")
                   for r in range(self.schedule.ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return torch.stack([losses[i] for i in range(len(batches))]).mean()

    def _compute(self, action: Action, channel: LocalChannel, states: list, env: dict, sums: list,
                 losses: dict) -> None:
        s, mb = action.stage, action.microbatch
        channel.stage, channel.microbatch = s, mb
        exe = self.executables[s][action.kind]
        values = env[(s, mb)]
        out = exe.run(states[s], [values[n] for n in exe.program.feeds])
        for key, value in out.items():
            if key == "loss":
                losses[mb] = value
                values[exe.program.fetches["loss"]] = value
            elif key.startswith("grad:"):
                name = key[5:]
                sums[s][name] = value if name not in sums[s] else sums[s][name] + value
            else:
                values[key] = value
