"""Memory planning passes (`build_strategy.enable_inplace`, `build_strategy.memory_optimize`), last in the pass order.

- `inplace`: pointwise aten ops write their result over their first input when that input dies there.
- `reuse`: matmuls and sums write their result into a temporary of the same size that just died.
"""
from fleetc.passes.memory.inplace import InplacePointwise
from fleetc.passes.memory.reuse import ReuseBuffers

__all__ = ["InplacePointwise", "ReuseBuffers"]
