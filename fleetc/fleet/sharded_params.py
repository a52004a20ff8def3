"""The user's module under sharding stage 3: a rank keeps only the parameters it owns, whole when asked.

After the training Program is compiled, the parameters another rank owns are released (their storage
becomes empty; the Parameter objects stay, so the module's structure and the optimizer's references do not
change). The Programs gather them where they are used (passes/sharding/param_sharding.py). For whatever
needs every parameter whole (full_state_dict, checkpoints) `whole_parameters` gathers them from their owners
for the duration of a `with` block, then releases them again.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fleetc.comm.sharding_ops import c_sharding_allgather, owner_major_starts
from fleetc.passes.sharding.plan import ShardedBucket

GROUP = "sharding"


class ShardedParameters:
    """Which of the module's parameters this rank owns (index `rank` in its sharding group) and their shapes."""

    def __init__(self, model: nn.Module, owners: dict[str, int], rank: int, degree: int):
        self.model, self.owners, self.rank, self.degree = model, owners, rank, degree
        self.shapes = {name: p.shape for name, p in model.named_parameters() if name in owners}

    def _allocate(self) -> None:
        for name, param in self.foreign():
            param.data = torch.empty(self.shapes[name], dtype=param.dtype, device=param.device)

    def numel(self) -> int:
        """Elements of every sharded parameter, whole (Ψ)."""
        return sum(shape.numel() for shape in self.shapes.values())

    def foreign(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for name, p in self.model.named_parameters()
                if name in self.owners and self.owners[name] != self.rank]

    def release(self) -> None:
        """Free the storage of every parameter another rank owns."""
        for _, param in self.foreign():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    @contextmanager
    def placeholders(self) -> Iterator[None]:
        """Every parameter whole-shaped inside the block, the foreign ones uninitialized: capturing a step needs
        only shapes and dtypes (no communication; the memory of the whole model, for the capture's duration)."""
        self._allocate()
        try:
            yield
        finally:
            self.release()

    @contextmanager
    def whole_parameters(self) -> Iterator[None]:
        """Every parameter whole and current inside the block (a collective: every rank of the group enters it)."""
        self._allocate()
        params = {name: p for name, p in self.model.named_parameters() if name in self.owners}
        for dtype in sorted({p.dtype for p in params.values()}, key=str):  # one all-gather per dtype
            names = [name for name, p in params.items() if p.dtype == dtype]
            bucket = ShardedBucket.of(names, self.owners, {n: self.shapes[n].numel() for n in names}, self.degree)
            with torch.no_grad():
                starts = owner_major_starts([self.shapes[n].numel() for n in names], list(bucket.owners),
                                            bucket.segment)
                c_sharding_allgather([params[n] for n in names], starts, bucket.segment, GROUP,
                                     "whole parameters")
        try:
            yield
        finally:
            self.release()


def sharded_parameters(model: nn.Module, metadata: dict) -> ShardedParameters | None:
    """The stage-3 bookkeeping for a compiled training Program's metadata (None: parameters are not sharded)."""
    sharding = metadata.get("sharding") or {}
    if "param_owners" not in sharding:
        return None
    return ShardedParameters(model, sharding["param_owners"], sharding["rank"], sharding["degree"])


@contextmanager
def whole(sharded: ShardedParameters | None, values: bool = True) -> Iterator[None]:
    """`sharded.whole_parameters()` (`values`) or `sharded.placeholders()`, or nothing to do when the parameters
    are not sharded."""
    if sharded is None:
        yield
    else:
        with sharded.whole_parameters() if values else sharded.placeholders():
            yield
