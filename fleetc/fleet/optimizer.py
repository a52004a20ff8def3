"""`fleet.distributed_optimizer`: a torch optimizer plus the strategy to compile with, and Paddle's methods."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fleetc.comm import env
from fleetc.comm.faults import collective_failed


class DistributedOptimizer:
    """Wraps a torch optimizer for data-parallel training.

    `fleetc.compile(model, optimizer=this)` or `fleet.distributed_model(model)` compile the whole step
    (gradients averaged inside the Program). Used eagerly, `step()` averages `p.grad` across ranks
    (one collective per dtype) and then applies the update, so a hand-written loop is data parallel too.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Any = None, fleet: Any = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"distributed_optimizer needs a torch.optim.Optimizer, not {type(optimizer).__name__}")
        self.inner = optimizer
        self.strategy = strategy
        self.fleet = fleet  # the Fleet that made it: it builds the trainer

    def compile_trainer(self, model: Any, strategy: Any = None, **compile_options: Any) -> Any:
        """What `fleetc.compile(model, optimizer=this)` returns: the Fleet's data-parallel trainer."""
        return self.fleet.compile(model, self, strategy, **compile_options)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def step(self) -> None:
        """Average the parameters' gradients across ranks, then update (eager training loops)."""
        if env.world_size() > 1:
            self._average_grads()
        self.inner.step()

    def _average_grads(self) -> None:
        grads = [p.grad for g in self.inner.param_groups for p in g["params"] if p.grad is not None]
        timeout = env.collective_timeout()
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            try:
                dist.all_reduce(flat, op=dist.ReduceOp.AVG, async_op=True).wait(timeout)
            except RuntimeError as exc:
                raise collective_failed(f"eager gradient allreduce ({dtype})", exc, timeout.total_seconds()) from exc
            offset = 0
            for g in same:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def clear_grad(self, set_to_zero: bool = False) -> None:
        """Drop the gradients (`set_to_zero=True` zero-fills them instead, as Paddle's argument says)."""
        self.inner.zero_grad(set_to_none=not set_to_zero)

    def get_lr(self) -> float:
        return float(self.inner.param_groups[0]["lr"])

    def set_lr(self, value: float) -> None:
        """Set every param group's learning rate; a compiled trainer uses it from its next step, without recompiling."""
        for group in self.inner.param_groups:
            group["lr"] = float(value)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def set_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)
