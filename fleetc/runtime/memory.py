"""Measures the peak bytes of the tensors a running step holds (each storage counted once), and eager PyTorch's."""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.utils._pytree import tree_flatten

from fleetc.capture.step_module import extract_loss


class MemoryTracker:
    """Fed by measuring-mode generated code: `track` when a local is bound, `drop` when deleted."""

    def __init__(self, persistent: list[torch.Tensor]):
        """`persistent`: tensors held all step (state); views of them add no bytes."""
        self.persistent = {self._key(t.untyped_storage()): t.untyped_storage().nbytes() for t in persistent}
        self.baseline = sum(self.persistent.values())
        self.names: dict[str, int] = {}  # local → storage key
        self.storages: dict[int, list[int]] = {}  # storage key → [refcount, nbytes]
        self.live = 0
        self.peak = self.baseline

    @staticmethod
    def _key(storage: torch.UntypedStorage) -> int:
        return storage.data_ptr() or id(storage)

    def track(self, name: str, value: object) -> None:
        if name in self.names:
            self.drop((name,))
        if not isinstance(value, torch.Tensor):
            return
        storage = value.untyped_storage()
        key = self._key(storage)
        if key in self.persistent:
            return
        self.names[name] = key
        entry = self.storages.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
        entry[0] += 1
        self.peak = max(self.peak, self.baseline + self.live)

    def drop(self, names: tuple[str, ...]) -> None:
        for name in names:
            key = self.names.pop(name, None)
            if key is None:
                continue
            entry = self.storages[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self.storages[key]



def allocation_peak_bytes(fn: Callable[[], object]) -> int:
    """The peak of tensor bytes `fn` holds allocated above what was live when it started, read from torch.profiler's
    allocation events (the CPU allocator's running total). Measures eager PyTorch and a compiled step alike, which
    the tracker above cannot (eager's autograd keeps saved tensors where no Python name holds them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.typed[1].total_allocated, event.typed[1].alloc_size))
    if not allocations:
        return 0
    allocations.sort()
    # The running total counts every allocation made under any profiler session of the process and still alive
    # (an earlier measurement's retained tensors): the peak is taken above the total before fn's first event.
    start = allocations[0][1] - allocations[0][2]
    return max(total for _, total, _ in allocations) - start


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each storage once."""
    storages = {MemoryTracker._key(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def eager_peak_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn: Callable | None,
                     args: tuple, kwargs: dict) -> int:
    """Peak live tensor bytes of the same training step run by eager PyTorch, counted as fleetc's measured peak is:
    parameters, buffers, optimizer state and input tensors held through the step, plus the step's allocation peak
    (`allocation_peak_bytes`). Runs on deep copies of the model and optimizer, with the random generators forked, so
    neither the model nor the draws of the compiled steps change."""
    model, optimizer = copy.deepcopy((model, optimizer))  # one memo: the copied optimizer updates the copied params
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    held = [*model.parameters(), *model.buffers(), *inputs]
    if optimizer is not None:
        held += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        output = model(*args, **kwargs) if loss_fn is None else loss_fn(model(*args[:-1], **kwargs), args[-1])
        extract_loss(output, loss_fn_given=loss_fn is not None).backward()
        if optimizer is not None:
            optimizer.step()

    with torch.random.fork_rng(devices=[]):
        return held_bytes(held) + allocation_peak_bytes(step)
