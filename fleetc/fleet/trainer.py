"""The data-parallel compiled trainer: a CompiledTrainer whose Programs allreduce gradients across ranks."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from fleetc.comm import env, groups
from fleetc.comm.faults import collective_failed
from fleetc.comm.mesh import resolve_mesh
from fleetc.comm.plan import check_plans_agree
from fleetc.compiler import CompiledStep, CompiledTrainer
from fleetc.ir.program import Program
from fleetc.passes.manager import History
from fleetc.passes.recompute import RecomputePolicy
from fleetc.report import CompileReport


def broadcast_state(model: nn.Module) -> None:
    """Copy rank 0's parameters and buffers to every rank, so all ranks start from the same model."""
    timeout = env.collective_timeout()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        try:
            dist.broadcast(tensor.data, 0, async_op=True).wait(timeout)
        except RuntimeError as exc:
            raise collective_failed(f"broadcast of {name!r} from rank 0", exc, timeout.total_seconds()) from exc


class DataParallelTrainer(CompiledTrainer):
    """Each rank trains on its own shard of the batch; gradients are averaged, so all ranks stay identical.

    Built by `fleet.distributed_model(model)` or `fleetc.compile(model, optimizer=fleet.distributed_optimizer(...))`.
    Construction broadcasts rank 0's parameters and buffers. Each training Program is checked to issue
    the same collectives on every rank before it first runs.
    """

    def __init__(self, model: nn.Module, strategy: Any = None, *, optimizer: torch.optim.Optimizer | None = None,
                 loss_fn: Callable | None = None, measure_memory: bool = False, verify: bool = False,
                 disable_passes: Iterable[str] = (), print_after: str | None = None,
                 recompute_policy: RecomputePolicy | None = None, cpu_kernels: str | None = None):
        super().__init__(model, strategy, optimizer=optimizer, loss_fn=loss_fn, measure_memory=measure_memory,
                         verify=verify, disable_passes=disable_passes, print_after=print_after,
                         recompute_policy=recompute_policy, cpu_kernels=cpu_kernels)
        self.world_size = env.world_size()
        self.mesh, mesh_notes = resolve_mesh(self.config, self.world_size)
        self.decisions += [f"process mesh {self.mesh}", *mesh_notes]
        if self.world_size > 1:
            broadcast_state(model)

    def _optimize(self, program: Program, capture_seconds: float) -> tuple[Program, History, CompileReport]:
        program.metadata["data_parallel"] = {"world_size": self.world_size}
        return super()._optimize(program, capture_seconds)

    def _compile(self, kind: str, args: tuple, kwargs: dict) -> CompiledStep:
        compiled = super()._compile(kind, args, kwargs)
        if self.world_size > 1 and kind == "train":
            groups.ensure_groups(compiled.program.metadata.get("collective_groups", {}))
            check_plans_agree(compiled.program)
        return compiled
