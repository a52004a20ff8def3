"""Op fusion: the named fusion passes (one per BuildStrategy flag) and automatic pointwise fusion.

- `match`: shared matching machinery (who reads what; swapping a matched group for one fused op).
- `norm`: batch norm + activation, batch norm + residual add + activation.
- `gemm`: gemm epilogue (bias, reshape, activation) and its backward.
- `dropout`: dropout + residual add; `dropout_rng`: which random-number form a fused dropout takes.
- `elementwise`: add + activation.
- `optimizer`: per-parameter updates → one multi-tensor update per group.
- `auto`: chains of pointwise ops → one generated kernel, decided by `FusionChoices`.
"""
from fleetc.passes.fusion.auto import AutoFusion, FusionChoices
from fleetc.passes.fusion.dropout import FuseDropoutAdd
from fleetc.passes.fusion.elementwise import FuseElementwiseAddAct
from fleetc.passes.fusion.gemm import FuseGemmEpilogue
from fleetc.passes.fusion.norm import FuseBnAct, FuseBnAddAct
from fleetc.passes.fusion.optimizer import FuseOptimizerOps

__all__ = ["AutoFusion", "FuseBnAct", "FuseBnAddAct", "FuseDropoutAdd", "FuseElementwiseAddAct", "FuseGemmEpilogue",
           "FuseOptimizerOps", "FusionChoices"]
