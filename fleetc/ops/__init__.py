"""fleetc's own op types and how every op type in a Program resolves to something that runs."""
from fleetc.ops import fused_elementwise, fused_gemm, fused_norm, fused_optimizer  # noqa: F401  (registers the ops)
from fleetc.ops import optimizer, state  # noqa: F401  (registers the ops)
from fleetc.ops.registry import OpDef, op_def, register_op, registered_ops, resolve_callable

__all__ = ["OpDef", "op_def", "register_op", "registered_ops", "resolve_callable"]
