"""Measures the peak bytes of the tensors a running step holds (each storage counted once)."""
from __future__ import annotations

from typing import Callable

import torch
from torch._C._profiler import _EventType


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
