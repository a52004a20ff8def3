"""Cleanup passes: what capture or other passes leave behind and nothing needs.

- `dce`: dead-code elimination (results nobody reads, ops without side effects).
- `noop_views`: ops that only re-expose a value (detach, clone of a temporary, same-shape views, t(t(x))).
"""
from fleetc.passes.cleanup.dce import DeadCodeElimination
from fleetc.passes.cleanup.noop_views import RemoveNoopViews

__all__ = ["DeadCodeElimination", "RemoveNoopViews"]
