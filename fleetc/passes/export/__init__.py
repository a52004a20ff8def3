"""Export passes: turn an eval Program into the deployable one `fleet.save_inference_model` writes.

- `lower_to_aten`: fleetc's own ops become the aten ops of their reference decompositions.
- `prune`: the Program returns the named targets, and dead-code elimination drops what they do not need.
"""
from fleetc.passes.export.lower_to_aten import LowerToAten
from fleetc.passes.export.prune import PruneToTargets

__all__ = ["LowerToAten", "PruneToTargets"]
