"""fleetc's own op types and how every op type in a Program resolves to something that runs."""
from fleetc.ops import accumulate, amp, fused_add_act, fused_elementwise, fused_gemm, fused_norm  # noqa: F401
from fleetc.ops import dropout_philox, fused_optimizer, optimizer, recompute, state  # noqa: F401  (registers the ops)
from fleetc.ops.registry import OpDef, op_def, register_op, registered_ops, resolve_callable

__all__ = ["OpDef", "op_def", "register_op", "registered_ops", "resolve_callable"]
