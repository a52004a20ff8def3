"""Gradient clipping inside the compiled step: `fleetc.compile(..., grad_clip=ClipGradByGlobalNorm(1.0))`.

Paddle's three clip classes and semantics (ops in fleetc/ops/clip.py). The pass puts the clip ops
(role optimize) right before the first update and points the updates at the clipped gradients. Since
they belong to the optimize section, the later passes place them as Paddle does: AMP moves them into
its skip-on-overflow block, after the unscaling and the found-inf check; gradient merge moves them
into its update block, after the averaging, so they clip the merged gradient; under data parallel
they read the allreduced gradients, so every rank clips by the same global norm. The squared global
norm is its own Var, named in `program.metadata["grad_clip"]["squared_norm"]`: a sharding or pipeline
pass, whose ranks each hold only part of the gradients, sums it across them before the clip.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fleetc.errors import StrategyError
from fleetc.ir.program import Op, OpRole, Program, Ref, Var
from fleetc.passes.base import PassReport


def _positive(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise StrategyError(f"grad_clip: {owner}({name}={value!r}): {name} must be a positive finite number")
    return float(value)


@dataclass(frozen=True)
class ClipGradByGlobalNorm:
    """Scale all gradients by `clip_norm / max(global_norm, clip_norm)`, global_norm the norm of all of them."""

    clip_norm: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip_norm", _positive(type(self).__name__, "clip_norm", self.clip_norm))


@dataclass(frozen=True)
class ClipGradByNorm:
    """Scale each gradient by `clip_norm / max(norm, clip_norm)`, norm its own L2 norm."""

    clip_norm: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip_norm", _positive(type(self).__name__, "clip_norm", self.clip_norm))


@dataclass(frozen=True)
class ClipGradByValue:
    """Clamp every gradient element into `[min, max]`; `min` defaults to `-max`."""

    max: float
    min: float | None = None

    def __post_init__(self) -> None:
        high = _positive(type(self).__name__, "max", self.max)
        low = -high if self.min is None else self.min
        if isinstance(low, bool) or not isinstance(low, (int, float)) or not low < high:
            raise StrategyError(f"grad_clip: ClipGradByValue(max={self.max!r}, min={self.min!r}): min must be a "
                                "number below max")
        object.__setattr__(self, "max", high)
        object.__setattr__(self, "min", float(low))


GradClip = ClipGradByGlobalNorm | ClipGradByNorm | ClipGradByValue


class GradientClip:
    name = "grad_clip"
    enabled_by = None  # switched on by fleetc.compile(grad_clip=...), not by a strategy field
    summary = "clip the gradients the optimizer update reads (Paddle's ClipGradByGlobalNorm / ByNorm / ByValue)"
    reads: tuple[str, ...] = ()

    def __init__(self, clip: GradClip):
        if not isinstance(clip, (ClipGradByGlobalNorm, ClipGradByNorm, ClipGradByValue)):
            raise StrategyError(f"grad_clip must be fleetc.ClipGradByGlobalNorm, ClipGradByNorm or ClipGradByValue, "
                                f"not {type(clip).__name__}")
        self.clip = clip

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        block = program.global_block
        grads = list(program.metadata.get("optimizer", {}).get("grads", {}).values())
        first = next((i for i, op in enumerate(block.ops) if OpRole.OPTIMIZE in op.role), None)
        if first is None or not grads:
            report.skipped_reason = "the Program has no optimizer update (compiled with optimizer=None, or no " \
                                    "parameter gets a gradient)"
            return program, report
        clipped = {g: program.unique_name(f"{g}@CLIP") for g in grads}
        for grad, name in clipped.items():
            source = program.var(grad)
            block.add_var(Var(name, source.shape, source.dtype, source.device))
        for op in block.ops[first:]:
            if OpRole.OPTIMIZE in op.role:
                op.rename_inputs(clipped)
        block.ops[first:first] = self._clip_ops(program, grads, list(clipped.values()))
        report.changed = True
        report.count("gradients_clipped", len(grads))
        report.notes.append(f"{self.clip}: {len(grads)} gradient(s), after AMP's unscaling, on gradient merge's "
                            "merged gradients, and on the allreduced gradients under data parallel")
        return program, report

    def _clip_ops(self, program: Program, grads: list[str], clipped: list[str]) -> list[Op]:
        attrs = {"op_role": int(OpRole.OPTIMIZE), "module_path": "", "provenance": self.name}
        refs = [Ref(g) for g in grads]
        if isinstance(self.clip, ClipGradByGlobalNorm):
            first = program.var(grads[0])
            squared = program.unique_name("grad_clip@squared_norm")
            dtype = "float64" if any(program.var(g).dtype == "float64" for g in grads) else "float32"
            program.global_block.add_var(Var(squared, (), dtype, first.device))
            program.metadata["grad_clip"] = {"kind": type(self.clip).__name__, "squared_norm": squared}
            return [Op(program.unique_name("grad_clip.squared_global_norm"), "fleetc.squared_global_norm", (refs,),
                       outputs=[squared], attrs=dict(attrs)),
                    Op(program.unique_name("grad_clip.clip_by_global_norm"), "fleetc.clip_by_global_norm",
                       (refs, Ref(squared), self.clip.clip_norm), outputs=clipped, attrs=dict(attrs))]
        if isinstance(self.clip, ClipGradByNorm):
            return [Op(program.unique_name("grad_clip.clip_by_norm"), "fleetc.clip_by_norm",
                       (refs, self.clip.clip_norm), outputs=clipped, attrs=dict(attrs))]
        return [Op(program.unique_name("grad_clip.clip_by_value"), "fleetc.clip_by_value",
                   (refs, self.clip.min, self.clip.max), outputs=clipped, attrs=dict(attrs))]
