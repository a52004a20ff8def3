"""Runs a ForwardPlan: evaluation through the pipeline stages, micro-batch by micro-batch, with no backward.

Each pipeline rank runs, for every micro-batch in order, the forward Program of each of its chunks (stage s lives
on rank s mod ranks, as in training); sends are buffered, so this order cannot deadlock. The last stage
concatenates each output over the micro-batches. In one process (`ranks_here` = every rank) the ranks are threads
with an in-memory mailbox; under torch.distributed each process runs its own rank, reads its own stages' current
state (nothing is gathered), and the last stage broadcasts the outputs over the pipeline group, so every rank
returns the same outputs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fleetc.comm import groups
from fleetc.comm.p2p import DistributedChannel, run_local_ranks, use_channel
from fleetc.errors import StrategyError
from fleetc.ir.program import Program
from fleetc.passes.pipeline_parallel.forward_only import (
    ForwardPlan,
    batch_major_outputs,
    partition_forward,
)
from fleetc.passes.pipeline_parallel.stages import pipeline_stages
from fleetc.runtime.executor import Executable


class ForwardPipeline:
    """The forward-only pipeline ranks `ranks_here` of a plan over `ranks` ranks. `pp_ranks`/`group`: this
    process's pipeline group (global ranks in stage order, and its communicator name) under torch.distributed;
    None: every rank runs here."""

    def __init__(self, plan: ForwardPlan, ranks: int, feeds: list[str], *, cpu_kernels: str | None = "off",
                 timeout_s: float = 60.0, pp_ranks: list[int] | None = None, group: str | None = None):
        self.plan, self.ranks, self.feeds = plan, ranks, feeds
        self.pp_ranks, self.group, self.timeout_s = pp_ranks, group, timeout_s
        if pp_ranks is None:
            self.ranks_here = list(range(ranks))
        else:
            import torch.distributed as dist

            self.ranks_here = [pp_ranks.index(dist.get_rank())]
        self.executables = {s: Executable(p, cpu_kernels=cpu_kernels) for s, p in enumerate(plan.stages)
                            if s % ranks in self.ranks_here}
        self.last = (len(plan.stages) - 1) % ranks

    def run(self, state: dict[str, torch.Tensor], inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The outputs (`output.<i>`) of the whole batch `inputs` (in the evaluation Program's feed order)."""
        m = self.plan.microbatches
        for name, t in zip(self.feeds, inputs):
            if t.dim() == 0 or t.shape[0] % m:
                raise StrategyError(f"evaluation input {name!r} has batch size {t.shape[0] if t.dim() else 0}, "
                                    f"which does not divide into pipeline_configs.accumulate_steps={m} micro-batches")
        micro = [dict(zip(self.feeds, batch)) for batch in zip(*(t.chunk(m) for t in inputs))]
        outputs: list[dict[str, torch.Tensor]] = [{} for _ in range(m)]
        if self.pp_ranks is None:
            self._threads(state, micro, outputs)
        else:
            channel = DistributedChannel(lambda s: self.pp_ranks[s % self.ranks], self.timeout_s)
            self._run_rank(self.ranks_here[0], channel, state, micro, outputs)
            channel.finish()
        if self.last not in self.ranks_here:
            whole = self._empty_outputs(m)
        else:
            whole = outputs[0] if m == 1 else {key: torch.cat([out[key] for out in outputs]) for key in outputs[0]}
        if self.pp_ranks is not None:
            import torch.distributed as dist

            group = None if self.group is None else groups.group(self.group)
            for key in sorted(whole):
                dist.broadcast(whole[key], src=self.pp_ranks[self.last], group=group)
        return whole

    def _empty_outputs(self, m: int) -> dict[str, torch.Tensor]:
        """Buffers for the outputs another rank broadcasts (their micro-batch shapes times m)."""
        last = self.plan.stages[-1]
        out = {}
        for key, name in last.fetches.items():
            var = last.var(name)
            shape = tuple(var.shape) if m == 1 else (var.shape[0] * m, *var.shape[1:])
            out[key] = torch.empty(shape, dtype=var.torch_dtype)
        return out

    def _threads(self, state: dict, micro: list, outputs: list) -> None:
        run_local_ranks(self.ranks_here, lambda rank, channel: self._run_rank(rank, channel, state, micro, outputs),
                        self.timeout_s, "pipeline-eval-rank")

    def _run_rank(self, rank: int, channel: Any, state: dict, micro: list, outputs: list) -> None:
        chunks = [s for s in range(len(self.plan.stages)) if s % self.ranks == rank]
        with use_channel(channel):
            for mb, feeds in enumerate(micro):
                for s in chunks:
                    channel.stage, channel.microbatch = s, mb
                    exe = self.executables[s]
                    out = exe.run(state, [feeds[n] for n in exe.program.feeds])
                    if s == len(self.plan.stages) - 1:
                        outputs[mb] = out


def forward_pipeline(program: Any, cpu_kernels: str | None, pp_ranks: list[int] | None = None,
                     group: str | None = None, timeout_s: float = 60.0) -> ForwardPipeline:
    """The executor of an evaluation Program the pipeline pass planned (see `make_pipeline` for the arguments)."""
    meta = program.metadata["pipeline"]
    plan = partition_forward(program, meta["microbatches"])
    return ForwardPipeline(plan, meta["stages"] // meta["vpp_degree"], list(program.feeds), cpu_kernels=cpu_kernels,
                           timeout_s=timeout_s, pp_ranks=pp_ranks, group=group)



def capture_microbatched(capture: Callable[[tuple, dict], tuple[Program, Any]], args: tuple, kwargs: dict,
                         accumulate_steps: int) -> tuple[Program, Any]:
    """`capture` of an evaluation step under a pipeline: on the first of `accumulate_steps` micro-batches when every
    tensor input divides into them and every output then leads with the micro-batch (the executor concatenates
    them); else on the whole batch, run as one micro-batch. The count goes to `metadata["pipeline_microbatches"]`."""
    m = accumulate_steps
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    if m > 1 and tensors and all(t.dim() and t.shape[0] % m == 0 for t in tensors):
        cut = lambda v: v[:v.shape[0] // m] if isinstance(v, torch.Tensor) else v
        program, out_spec = capture(tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()})
        if (pipeline_stages(program) or 1) > 1 and batch_major_outputs(program, tensors[0].shape[0] // m) is None:
            program.metadata["pipeline_microbatches"] = m
            return program, out_spec
    program, out_spec = capture(args, kwargs)
    program.metadata["pipeline_microbatches"] = 1
    return program, out_spec
