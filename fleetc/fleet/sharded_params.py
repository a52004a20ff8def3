"""The user's module under sharding stage 3: a rank keeps only its part of the parameters, whole when asked.

After the training Program is compiled, each parameter keeps only what this rank holds of it: on flat buckets
(`FlatShardedParameters`) its flat piece (1-D; empty where the rank holds none of it), under whole-parameter
ownership (`ShardedParameters`) all of it or nothing, in the dtype the Programs declare for it (`dtypes`: under
use_pure_fp16 low precision, also for a parameter this rank holds nothing of, whose Var its Programs drop, so no
binding converts it; the ranks' whole copies then agree in dtype and so do their gathers). The Parameter objects
stay, so the module's structure and the optimizer's references do not change. The Programs gather them where
they are used (passes/sharding/param_sharding.py). For whatever
needs every parameter whole (full_state_dict, checkpoints) `whole_parameters` gathers them from their owners
for the duration of a `with` block, then releases them again.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from fleetc.comm.sharding_ops import c_sharding_allgather, owner_major_starts
from fleetc.errors import StrategyError
from fleetc.passes.sharding.plan import FlatBucket, ShardedBucket

GROUP = "sharding"


class ShardedParameters:
    """Which of the module's parameters this rank owns (index `rank` in its sharding group) and their shapes."""

    def __init__(self, model: nn.Module, owners: dict[str, int], rank: int, degree: int,
                 dtypes: dict[str, str] | None = None):
        self.model, self.owners, self.rank, self.degree = model, owners, rank, degree
        self.shapes = {name: p.shape for name, p in model.named_parameters() if name in owners}
        self.dtypes = declared_dtypes(model, dtypes)

    def layout(self) -> dict[str, Any]:
        """What a later Program of the model must follow (stamped into its `metadata["sharding"]`)."""
        return {"param_layout": "whole"}

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
        for name, param in self.foreign():
            param.data = torch.empty(0, dtype=self.dtypes[name], device=param.device)

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


class FlatShardedParameters:
    """Stage 3 on flat buckets: this rank (index `rank` of `degree`) holds elements [lo, hi) of each parameter it
    has a piece of (`pieces`); `buckets` lay the parameters out, as in the Programs."""

    def __init__(self, model: nn.Module, buckets: list[list[str]], pieces: dict[str, list[int]], rank: int,
                 degree: int, dtypes: dict[str, str] | None = None):
        self.model, self.rank, self.degree = model, rank, degree
        self.shapes = {name: p.shape for name, p in model.named_parameters()}
        self.dtypes = declared_dtypes(model, dtypes)
        sizes = {name: shape.numel() for name, shape in self.shapes.items()}
        self.buckets = [FlatBucket.of(names, sizes, degree) for names in buckets]
        self.pieces = {name: (lo, hi) for name, (lo, hi) in pieces.items()}

    def layout(self) -> dict[str, Any]:
        return {"param_layout": "flat", "param_buckets": [list(bucket.names) for bucket in self.buckets]}

    def numel(self) -> int:
        return sum(shape.numel() for shape in self.shapes.values())

    def _sharded(self) -> list[tuple[str, nn.Parameter]]:
        names = {name for bucket in self.buckets for name in bucket.names}
        return [(name, p) for name, p in self.model.named_parameters() if name in names]

    def release(self) -> None:
        """Keep only this rank's piece of every parameter (the parameters are whole-shaped now)."""
        for name, param in self._sharded():
            lo, hi = self.pieces.get(name, (0, 0))
            if (lo, hi) != (0, self.shapes[name].numel()):
                param.data = param.data.reshape(-1)[lo:hi].to(self.dtypes[name], copy=True)

    def _whole_shaped(self) -> None:
        """Every parameter whole-shaped, this rank's pieces in place, the rest uninitialized."""
        for name, param in self._sharded():
            if param.shape != self.shapes[name]:
                whole = torch.empty(self.shapes[name], dtype=param.dtype, device=param.device)
                lo, hi = self.pieces.get(name, (0, 0))
                whole.view(-1)[lo:hi] = param.data
                param.data = whole

    @contextmanager
    def placeholders(self) -> Iterator[None]:
        """Every parameter whole-shaped inside the block (capture needs only shapes and dtypes)."""
        self._whole_shaped()
        try:
            yield
        finally:
            self.release()

    @contextmanager
    def whole_parameters(self) -> Iterator[None]:
        """Every parameter whole and current inside the block (a collective: every rank of the group enters it);
        what the block writes into them is what each rank keeps of them after it (a checkpoint load)."""
        self._whole_shaped()
        params = dict(self._sharded())
        with torch.no_grad():
            for bucket in self.buckets:  # one all-gather per bucket, through the Programs' flat layout
                c_sharding_allgather([params[n] for n in bucket.names], bucket.starts, bucket.segment, GROUP,
                                     "whole parameters")
        try:
            yield
        finally:
            self.release()


class WholeDuringRun:
    """A forward-only pipeline whose stages' parameters are made whole (`whole()`, a collective over the sharding
    group) for each run: sharding stage 3 × pipeline, where a rank holds pieces between steps."""

    def __init__(self, pipeline: Any, whole: Callable[[], AbstractContextManager[None]]):
        self.pipeline, self.whole = pipeline, whole

    def run(self, state: dict[str, torch.Tensor], inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        with self.whole():  # the state holds the module's Parameter objects: whole inside the block
            return self.pipeline.run(state, inputs)


HeldParameters = ShardedParameters | FlatShardedParameters  # what a stage-3 rank holds of the module's parameters


def sharded_parameters(model: nn.Module, metadata: dict, chunks: list[int] | None = None) -> HeldParameters | None:
    """The stage-3 bookkeeping for a compiled training Program's metadata (None: parameters are not sharded); under
    a pipeline, of the pipeline stages `chunks` this process runs (passes/pipeline_parallel/stage3.py)."""
    sharding = metadata.get("sharding") or {}
    if sharding.get("stage_layouts") and chunks:
        layouts = [sharding["stage_layouts"][s] for s in chunks]
        pieces: dict[str, list[int]] = {}
        for layout in layouts:
            for name, piece in layout["param_pieces"].items():
                if list(pieces.setdefault(name, piece)) != list(piece):
                    raise StrategyError(f"sharding stage 3 with pipeline: parameter {name!r} is cut into different "
                                        "pieces by two pipeline stages of this process; run one stage per process")
        return FlatShardedParameters(model, [b for layout in layouts for b in layout["param_buckets"]], pieces,
                                     sharding["rank"], sharding["degree"], sharding.get("param_dtypes"))
    if sharding.get("param_layout") == "flat":
        return FlatShardedParameters(model, sharding["param_buckets"], sharding["param_pieces"], sharding["rank"],
                                     sharding["degree"], sharding.get("param_dtypes"))
    if "param_owners" not in sharding:
        return None
    return ShardedParameters(model, sharding["param_owners"], sharding["rank"], sharding["degree"],
                             sharding.get("param_dtypes"))


def declared_dtypes(model: nn.Module, dtypes: dict[str, str] | None) -> dict[str, torch.dtype]:
    """Parameter → the dtype its Programs declare (`dtypes`, by torch name), else the one it has now."""
    dtypes = dtypes or {}
    return {name: getattr(torch, dtypes[name]) if name in dtypes else p.dtype for name, p in model.named_parameters()}


@contextmanager
def whole(sharded: HeldParameters | None, values: bool = True) -> Iterator[None]:
    """`sharded.whole_parameters()` (`values`) or `sharded.placeholders()`, or nothing to do when the parameters
    are not sharded."""
    if sharded is None:
        yield
    else:
        with sharded.whole_parameters() if values else sharded.placeholders():
            yield
