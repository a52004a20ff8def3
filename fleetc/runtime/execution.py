"""How a trainer runs its compiled steps, read from `execution_strategy` and `build_strategy` (docs/execution.md)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fleetc.errors import StrategyError


@dataclass(frozen=True)
class ExecutionPlan:
    """`threads`: compute threads per step (1: the generated straight-line function). `iterations_per_run`: batches
    one `step()` call trains on. `drop_scope_every`: iterations between releases of cached allocator blocks."""

    threads: int
    sequential: bool
    iterations_per_run: int
    drop_scope_every: int

    @classmethod
    def from_config(cls, config: Any) -> ExecutionPlan:
        execution = config.execution_strategy
        sequential = bool(config.build_strategy.enable_sequential_execution)
        return cls(1 if sequential else execution.num_threads, sequential, execution.num_iteration_per_run,
                   execution.num_iteration_per_drop_scope)

    def lines(self) -> list[str]:
        """The compile report's `execution:` lines: what the runtime does with these settings."""
        if self.sequential:
            runner = "program order on one thread (build_strategy.enable_sequential_execution; num_threads ignored)"
        elif self.threads > 1:
            runner = (f"multi-threaded scheduler, {self.threads} compute threads (execution_strategy.num_threads); "
                      "collectives in Program order on one communication thread")
        else:
            runner = "the generated straight-line function, program order on one thread (num_threads=1)"
        return [runner,
                f"{self.iterations_per_run} iteration(s) per step() call (execution_strategy.num_iteration_per_run)",
                f"cached allocator blocks released every {self.drop_scope_every} iterations "
                "(execution_strategy.num_iteration_per_drop_scope; temporaries themselves are freed after last use)"]

    def batches(self, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        """The (args, kwargs) of each iteration of one `step()` call: the call itself when `iterations_per_run` is 1;
        else its one argument, a list or iterator of batches (a tuple of positional arguments, a dict of keyword
        arguments, or one tensor), of which `iterations_per_run` are taken."""
        if self.iterations_per_run == 1:
            return [(args, kwargs)]
        if kwargs or len(args) != 1 or isinstance(args[0], torch.Tensor) or not isinstance(args[0], Iterable):
            raise StrategyError(
                f"execution_strategy.num_iteration_per_run is {self.iterations_per_run}: step() takes one argument, a "
                "list or iterator of batches (each a tuple of positional arguments, a dict of keyword arguments or a "
                "tensor)")
        source: Iterator = iter(args[0])
        batches = []
        for batch in source:
            if isinstance(batch, dict):
                batches.append(((), batch))
            elif isinstance(batch, tuple):
                batches.append((batch, {}))
            else:
                batches.append(((batch,), {}))
            if len(batches) == self.iterations_per_run:
                break
        if len(batches) < self.iterations_per_run:
            raise StrategyError(f"execution_strategy.num_iteration_per_run is {self.iterations_per_run}, but step() "
                                f"got only {len(batches)} batch(es)")
        return batches

    def drop_scope(self, iteration: int) -> bool:
        """After `iteration` (counted from 1): release the caching allocator's free blocks when one is due. CPU tensors
        have no cache to release; returns whether a drop was due."""
        if iteration % self.drop_scope_every:
            return False
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return True
