"""The process mesh: how data parallel, pipeline stages and sharding divide the ranks, in one documented order.

Axes, outermost first, as Paddle's hybrid parallel orders them: `dp`, `pp`, `sharding`, `mp`. A rank's
coordinates are its digits in that mixed radix (mp varies fastest), so with dp=2, pp=2 ranks 0 and 1 are
replica 0's stages 0 and 1, ranks 2 and 3 replica 1's. A group along an axis is the set of ranks that differ only
in that axis: the `pp` group of rank 2 is [2, 3], its `dp` group [0, 2].

Under a pipeline the ranks that hold the same stage are those that differ only in `dp` and `sharding`
(`groups("dp", "sharding")`): they average that stage's gradients. Each stage is sharded over its `sharding` group:
with pp=2 × sharding=2, ranks 0 and 1 hold stage 0 and shard its optimizer state, ranks 2 and 3 stage 1; the
pipelines are [0, 2] and [1, 3].

Degrees come from `hybrid_configs` (Paddle's names), with these rules (`resolve_mesh`):
- pp: the number of `device_guard("stage:i")` stages, or `hybrid_configs.pp_degree` when there are none; when
  both are given they must agree. pp > 1 needs `pipeline` on.
- sharding: with `sharding` on, `hybrid_configs.sharding_degree` if set, else `sharding_configs.sharding_degree`;
  when neither is set (Paddle's default, 8, is not taken literally), every rank the other axes leave, and the
  notes say so. Off: 1.
- dp: `hybrid_configs.dp_degree`, or (-1, the default) whatever the world size leaves.
- mp is 1 (tensor parallelism is not implemented). Every degree set must divide the world size, and the product
  must equal it; otherwise a StrategyError names the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fleetc.errors import StrategyError
from fleetc.strategy.fields import NEW_STYLE

AXES = ("dp", "pp", "sharding", "mp")  # outermost first
SHARDING_DEGREE_DEFAULT = 8  # sharding_configs.sharding_degree's Paddle default, read as "the rest of the world"
# The newer fleetc.Strategy's name of each DistributedStrategy path it sets, so that an error names the field in
# either style (sharding_configs.sharding_degree is sharding.degree there).
_NEW_STYLE_NAMES = {target: f"{section}.{key}" for section, _, keys in NEW_STYLE for key, target in keys
                    if isinstance(target, str)}


@dataclass(frozen=True)
class ProcessMesh:
    """Degrees along each axis; ranks are numbered in AXES order, the last axis varying fastest."""

    dp: int = 1
    pp: int = 1
    sharding: int = 1
    mp: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def coordinates(self, rank: int) -> dict[str, int]:
        """The rank's index along every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks ({self})")
        coords = {}
        for axis, size in zip(reversed(AXES), reversed(self.shape)):
            rank, coords[axis] = divmod(rank, size)
        return {axis: coords[axis] for axis in AXES}

    def rank(self, **coordinates: int) -> int:
        """The rank at the given coordinates (axes not named are 0)."""
        unknown = set(coordinates) - set(AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; axes: {AXES}")
        rank = 0
        for axis, size in zip(AXES, self.shape):
            index = coordinates.get(axis, 0)
            if not 0 <= index < size:
                raise ValueError(f"{axis} index {index} is outside 0..{size - 1}")
            rank = rank * size + index
        return rank

    def groups(self, *axes: str) -> list[list[int]]:
        """The world partitioned along `axes`: each list holds the ranks that differ only in those coordinates."""
        unknown = [axis for axis in axes if axis not in AXES]
        if unknown or not axes:
            raise ValueError(f"unknown mesh axis {unknown[0] if unknown else None!r}; axes: {AXES}")
        found: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            coords = self.coordinates(rank)
            key = tuple(index for name, index in coords.items() if name not in axes)
            found.setdefault(key, []).append(rank)
        return list(found.values())

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group along `axis` (itself included)."""
        return next(group for group in self.groups(axis) if rank in group)

    def __str__(self) -> str:
        return " × ".join(f"{axis}={size}" for axis, size in zip(AXES, self.shape)) + f" ({self.world_size} ranks)"


def resolve_mesh(config: Any, world_size: int, stages: int | None = None) -> tuple[ProcessMesh, list[str]]:
    """The mesh a strategy config asks for on `world_size` ranks, and notes on what was inferred.

    `stages` is the number of `device_guard` pipeline stages in the captured Program (None: no annotations).
    """
    hybrid = config.hybrid_configs
    notes: list[str] = []
    if hybrid.mp_degree != 1:
        raise StrategyError(f"hybrid_configs.mp_degree is {hybrid.mp_degree}: tensor (model) parallelism is not "
                            "implemented in fleetc; set it to 1")
    pp = pipeline_degree(config, hybrid.pp_degree, stages)
    vpp = config.pipeline_configs.vpp_degree if config.pipeline and stages else 1
    if vpp > 1:  # interleaved 1F1B: each pipeline rank holds vpp_degree of the device_guard stages
        if pp % vpp:
            raise StrategyError(f"pipeline_configs.vpp_degree={vpp} chunks per rank does not divide the model's "
                                f"{pp} device_guard stages")
        pp //= vpp
    _must_divide(world_size, pp, "the device_guard stage count" + (" / vpp_degree" if vpp > 1 else "")
                 if stages else "hybrid_configs.pp_degree")
    dp_given = hybrid.dp_degree if hybrid.dp_degree != -1 else None
    if dp_given == 0:
        raise StrategyError("hybrid_configs.dp_degree must be -1 (inferred) or at least 1, got 0")
    if dp_given is not None:
        _must_divide(world_size, dp_given, "hybrid_configs.dp_degree")
    sharding, source = _sharding_degree(config, hybrid.sharding_degree, world_size // (pp * (dp_given or 1)), notes)
    if pp > 1 and (sharding < 1 or (world_size // pp) % sharding):
        raise StrategyError(f"{source} is {sharding}, which does not divide the {world_size // pp} ranks of each "
                            f"pipeline stage (world size {world_size} / {pp} stages): each stage is sharded over "
                            f"its own ranks{_in_new_style(source)}")
    _must_divide(world_size // pp, sharding, source)
    dp = dp_given if dp_given is not None else world_size // (pp * sharding)
    if dp_given is None and dp > 1:
        notes.append(f"hybrid_configs.dp_degree is -1: {dp} data-parallel replicas (the world size left over)")
    mesh = ProcessMesh(dp=dp, pp=pp, sharding=sharding)
    if mesh.world_size != world_size:
        raise StrategyError(f"the process mesh {mesh} does not cover the {world_size} ranks of this job: "
                            "hybrid_configs.dp_degree × pp_degree × sharding_degree must equal the world size")
    return mesh, notes


def pipeline_degree(config: Any, pp_degree: int, stages: int | None) -> int:
    """The number of pipeline stages: 1 without `strategy.pipeline`, else the model's `device_guard` stage count
    (`stages`, None without annotations) or `hybrid_configs.pp_degree`; StrategyError when they disagree."""
    if not config.pipeline:
        if pp_degree > 1:
            raise StrategyError(f"hybrid_configs.pp_degree is {pp_degree} but strategy.pipeline is off: "
                                "set strategy.pipeline = True to split the model into stages")
        return 1
    if stages and pp_degree > 1 and stages != pp_degree:
        raise StrategyError(f"hybrid_configs.pp_degree is {pp_degree} but the model's device_guard marks {stages} "
                            "stages: make them agree, or leave pp_degree at 1 to take the annotations")
    return stages or pp_degree


def pipeline_layout(config: Any, stages: int | None) -> tuple[int | None, int, int] | None:
    """(pipeline ranks, chunks per rank, k_steps) of the pipeline the strategy builds for a training Program of
    `stages` device_guard stages (None: not captured yet, or no annotations), which a checkpoint's carried
    gradient-merge sums must fit (runtime/pipeline_checkpoint.py's `check_carried`). Known from the strategy alone
    when `hybrid_configs.pp_degree` gives the stage count; before the capture that finds the device_guard stages
    the rank count is None. None without `strategy.pipeline`."""
    if not config.pipeline:
        return None
    vpp = config.pipeline_configs.vpp_degree
    k_steps = config.gradient_merge_configs.k_steps if config.gradient_merge else 1
    if stages is None and config.hybrid_configs.pp_degree <= 1:
        return None, vpp, k_steps  # the device_guard annotations decide the depth, at capture
    return pipeline_degree(config, config.hybrid_configs.pp_degree, stages) // vpp, vpp, k_steps


def _sharding_degree(config: Any, hybrid_degree: int, rest: int, notes: list[str]) -> tuple[int, str]:
    """The sharding degree and the field it came from."""
    configured = config.sharding_configs.sharding_degree
    if not config.sharding:
        if hybrid_degree > 1:
            raise StrategyError(f"hybrid_configs.sharding_degree is {hybrid_degree} but strategy.sharding is off: "
                                "set strategy.sharding = True")
        return 1, "hybrid_configs.sharding_degree"
    if hybrid_degree > 1:
        if "sharding_configs.sharding_degree" in config.explicit_fields and configured != hybrid_degree:
            raise StrategyError(f"hybrid_configs.sharding_degree ({hybrid_degree}) and "
                                f"sharding_configs.sharding_degree ({configured}) disagree: set one of them")
        return hybrid_degree, "hybrid_configs.sharding_degree"
    if "sharding_configs.sharding_degree" in config.explicit_fields:
        return configured, "sharding_configs.sharding_degree"
    notes.append(f"sharding_configs.sharding_degree is not set (Paddle's default is {SHARDING_DEGREE_DEFAULT}): "
                 f"sharding across the {rest} rank(s) the other axes leave")
    return rest, "sharding_configs.sharding_degree"


def _must_divide(world_size: int, degree: int, field: str) -> None:
    if degree < 1 or world_size % degree:
        raise StrategyError(f"{field} is {degree}, which does not divide the world size {world_size}"
                            f"{_in_new_style(field)}")


def _in_new_style(field: str) -> str:
    """Where fleetc.Strategy sets `field`, its name there, as a suffix of an error message."""
    return f" (fleetc.Strategy: {_NEW_STYLE_NAMES[field]})" if field in _NEW_STYLE_NAMES else ""
