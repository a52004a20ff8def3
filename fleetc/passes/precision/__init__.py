"""Mixed precision: the AMP pass and its parts.

- `amp`: the pass; white-listed ops in bf16/fp16, black-listed ones in float32, forward and backward.
- `amp_lists`: which aten ops are white, black or neither, and the user names for them.
- `loss_scaling`: dynamic loss scaling (scaled seed, one unscale-and-check op, the update skipped on overflow).
- `master_weights`: use_pure_fp16's low-precision parameters with float32 master copies.
"""
from fleetc.passes.precision.amp import AutoMixedPrecision

__all__ = ["AutoMixedPrecision"]
