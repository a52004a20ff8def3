"""Recompute (activation checkpointing): the pass, its planners and its replaceable policy.

- `recompute`: the pass; picks a plan and applies it.
- `plan`: what a plan is, and the forward region every planner works from.
- `checkpoints`: user checkpoints (module paths or Var names) → a plan.
- `auto`: the min-cut planner and the memory-budget search.
- `pieces`: the min-cut solved once per distinct piece of the repeated blocks (reuse of repeated blocks).
- `policy`: per op, whether it may be re-run and what that costs (`RecomputePolicy`).
- `rewrite`: re-emits the planned forward ops inside backward.
"""
from fleetc.passes.recompute.policy import Choice, RecomputePolicy
from fleetc.passes.recompute.recompute import Recompute

__all__ = ["Choice", "Recompute", "RecomputePolicy"]
