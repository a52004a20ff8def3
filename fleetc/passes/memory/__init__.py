"""Memory planning passes (`build_strategy.enable_inplace`), last in the pass order.

- `inplace`: pointwise aten ops write their result over their first input when that input dies there.
"""
from fleetc.passes.memory.inplace import InplacePointwise

__all__ = ["InplacePointwise"]
