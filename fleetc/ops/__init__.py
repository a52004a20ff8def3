"""fleetc's own op types and how every op type in a Program resolves to something that runs."""
from fleetc.ir.registry import (
    OpDef,
    op_def,
    register_op,
    registered_ops,
    resolve_callable,
)
from fleetc.ops import (  # noqa: F401  (registers the ops)
    accumulate,
    amp,
    clip,
    dropout_philox,
    fused_add_act,
    fused_elementwise,
    fused_gemm,
    fused_norm,
    fused_optimizer,
    layerwise,
    local_sgd,
    optimizer,
    recompute,
    scalar,
    state,
)

__all__ = ["OpDef", "op_def", "register_op", "registered_ops", "resolve_callable"]
