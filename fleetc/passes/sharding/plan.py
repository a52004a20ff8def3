"""Who owns what under sharding: whole parameters given to the ranks of the sharding group, balanced by size.

Ownership is decided once, from sizes and names only, so every rank computes the same plan without
talking (the cross-rank plan check then confirms it). A bucket of tensors moves through an
owner-major padded buffer: each rank's segment holds the bucket's tensors it owns, in bucket order,
padded to the bucket's largest segment (fleetc/comm/sharding_ops.py).
"""
from __future__ import annotations

from dataclasses import dataclass


def assign_owners(sizes: dict[str, int], degree: int) -> dict[str, int]:
    """Parameter → owning rank (in the sharding group): largest first, each to the least-loaded rank (lowest on ties).

    Deterministic: ties in size are broken by name. With more ranks than parameters some ranks own nothing.
    """
    loads = [0] * degree
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(degree), key=lambda r: (loads[r], r))
        owners[name] = rank
        loads[rank] += sizes[name]
    return owners


@dataclass(frozen=True)
class ShardedBucket:
    """Tensors moved together; `owners[i]` owns `names[i]`; every rank's segment is `segment` elements long."""

    names: tuple[str, ...]
    owners: tuple[int, ...]
    segment: int
    total: int  # elements of the tensors themselves (the buffer is segment × degree)

    @classmethod
    def of(cls, names: list[str], owners: dict[str, int], sizes: dict[str, int], degree: int) -> "ShardedBucket":
        per_rank = [0] * degree
        for name in names:
            per_rank[owners[name]] += sizes[name]
        return cls(tuple(names), tuple(owners[n] for n in names), max(per_rank), sum(sizes[n] for n in names))

    def owned_by(self, rank: int) -> list[str]:
        return [n for n, owner in zip(self.names, self.owners) if owner == rank]

    def padding(self, degree: int) -> int:
        """Elements of padding in the bucket's buffer."""
        return self.segment * degree - self.total
