"""Sharding passes (ZeRO): optimizer state, and with stage 2 gradients, split across the ranks of the sharding group.

- `plan`: which rank owns which parameter, and the owner-major padded bucket layout.
- `optimizer_sharding`: stages 1 and 2 as a rewrite of the data-parallel Program.
"""
from fleetc.passes.sharding.optimizer_sharding import Sharding

__all__ = ["Sharding"]
