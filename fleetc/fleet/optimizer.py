"""`fleet.distributed_optimizer`: a torch optimizer plus the strategy to compile with, and Paddle's methods."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fleetc.comm import env
from fleetc.comm.faults import collective_failed
from fleetc.errors import StrategyError
from fleetc.strategy import resolve_conflicts, resolve_strategy

# Strategy switches that change the results but have no meaning in a hand-written eager loop's step(): an eager
# step() refuses them rather than silently training without them. Switches that change only speed or memory
# (fusion, recompute, allreduce bucketing) do not change what step() computes and are not listed.
_NEEDS_COMPILE = {
    "amp": "AMP casts the forward pass and scales the loss before backward, which step() runs after",
    "lars": "the LARS update is a rewrite of the compiled optimizer step",
    "lamb": "the LAMB update is a rewrite of the compiled optimizer step",
    "localsgd": "local SGD replaces the gradient allreduce inside the compiled step",
    "adaptive_localsgd": "adaptive local SGD replaces the gradient allreduce inside the compiled step",
    "sync_batch_norm": "synchronized batch norm rewrites the forward pass",
}


MERGE_KEY = "fleetc_gradient_merge"  # eager gradient merge's accumulators in state_dict()


class DistributedOptimizer:
    """Wraps a torch optimizer for data-parallel training.

    `fleetc.compile(model, optimizer=this)` or `fleet.distributed_model(model)` compile the whole step
    (gradients averaged inside the Program). Used eagerly, `step()` averages `p.grad` across ranks
    (one collective per dtype) and then applies the update, so a hand-written loop is data parallel too.
    Eagerly, `gradient_merge` is applied too: each `step()` is a micro-step whose gradients are added into
    accumulators (call `clear_grad()` after each, as usual), and every k-th one updates with their mean (`avg`)
    or sum. Strategy switches with no eager meaning (`_NEEDS_COMPILE`, e.g. `amp`) make `step()` raise a
    StrategyError that points to `fleetc.compile`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Any = None, fleet: Any = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"distributed_optimizer needs a torch.optim.Optimizer, not {type(optimizer).__name__}")
        self.inner = optimizer
        self.strategy = strategy
        self.fleet = fleet  # the Fleet that made it: it builds the trainer
        self._merged: dict[torch.Tensor, torch.Tensor] = {}  # eager gradient merge: parameter -> summed grads
        self._micro_steps = 0  # micro-steps merged since the last update

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
        """Average the parameters' gradients across ranks, then update (eager training loops).

        With gradient merge on, only every k-th call updates, with the merged gradients."""
        config = self._eager_config()
        if config.gradient_merge and not self._merge_micro_step(config.gradient_merge_configs):
            return
        if env.world_size() > 1:
            _average_over_ranks([p.grad for g in self.inner.param_groups for p in g["params"] if p.grad is not None],
                                "eager gradient allreduce")
        self.inner.step()

    def _eager_config(self) -> Any:
        """The strategy as resolved for compiling; a StrategyError for switches an eager step cannot honour."""
        config, _ = resolve_conflicts(resolve_strategy(self.strategy))
        for switch, why in _NEEDS_COMPILE.items():
            if config.get(switch):
                raise StrategyError(f"strategy.{switch} is on, but the eager distributed_optimizer.step() cannot apply "
                                    f"it ({why}); compile the training step with fleetc.compile(model, strategy, "
                                    "optimizer=...) or fleet.distributed_model(model), or switch it off")
        return config

    def _merge_micro_step(self, merge: Any) -> bool:
        """Add this micro-step's gradients to the accumulators; on every k-th, put the merged ones in `p.grad`.

        Returns whether the optimizer update runs now."""
        for group in self.inner.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    total = self._merged.get(p)
                    self._merged[p] = p.grad.detach().clone() if total is None else total.add_(p.grad)
        self._micro_steps += 1
        if self._micro_steps < merge.k_steps:
            return False
        for p, total in self._merged.items():
            p.grad = total.div_(merge.k_steps) if merge.avg else total
        self._merged, self._micro_steps = {}, 0
        return True

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
        """The torch optimizer's state dict; mid-accumulation under eager gradient merge, also its accumulators
        (keyed by parameter index, as torch keys the optimizer state) and micro-step count under `MERGE_KEY`.

        With several ranks the accumulators are their average over the ranks, which is what the update averages
        them to: every rank calls it then (a collective), and loading the first rank's copy on every rank resumes
        as the uninterrupted run. Each rank's own sums would drop the other ranks' gradients of the period."""
        state = self.inner.state_dict()
        if self._micro_steps:
            index = {id(p): i for i, p in enumerate(p for g in self.inner.param_groups for p in g["params"])}
            merged = sorted((index[id(p)], total.clone()) for p, total in self._merged.items())
            if env.world_size() > 1:
                _average_over_ranks([total for _, total in merged], "eager gradient-merge state_dict")
            state[MERGE_KEY] = {"micro_steps": self._micro_steps, "accumulators": dict(merged)}
        return state

    def set_state_dict(self, state_dict: dict) -> None:
        """Restore what `state_dict` returned; a state saved with no accumulation under way starts a fresh one."""
        state_dict = dict(state_dict)
        merge = state_dict.pop(MERGE_KEY, {"micro_steps": 0, "accumulators": {}})
        self.inner.load_state_dict(state_dict)
        params = [p for g in self.inner.param_groups for p in g["params"]]
        self._micro_steps = merge["micro_steps"]
        self._merged = {params[i]: total.to(params[i].device, copy=True) for i, total in merge["accumulators"].items()}


def _average_over_ranks(tensors: list[torch.Tensor], label: str) -> None:
    """Average `tensors` in place over the ranks: one allreduce per dtype, each waited for at most the collective
    timeout (a CollectiveError naming `label` past it)."""
    timeout = env.collective_timeout()
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        try:
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, async_op=True).wait(timeout)
        except RuntimeError as exc:
            raise collective_failed(f"{label} ({dtype})", exc, timeout.total_seconds()) from exc
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
