"""Optimizer passes: rewrites of the optimize section and what surrounds it.

- `clip`: gradient clipping (ClipGradByGlobalNorm / ByNorm / ByValue) before the updates.
- `layerwise`: `lars` and `lamb`, Momentum and Adam updates replaced by their layer-wise adaptive forms.
- `local_sgd`: `localsgd` / `adaptive_localsgd`, local updates with parameters averaged every k steps.
"""
from fleetc.passes.optimizers.clip import (
    ClipGradByGlobalNorm,
    ClipGradByNorm,
    ClipGradByValue,
    GradClip,
    GradientClip,
)
from fleetc.passes.optimizers.layerwise import Lamb, Lars
from fleetc.passes.optimizers.local_sgd import AdaptiveLocalSGD, LocalSGD

__all__ = ["AdaptiveLocalSGD", "ClipGradByGlobalNorm", "ClipGradByNorm", "ClipGradByValue", "GradClip", "GradientClip", "Lamb", "Lars",
           "LocalSGD"]
