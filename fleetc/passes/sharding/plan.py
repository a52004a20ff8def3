"""Who owns what under sharding: whole parameters given to the ranks of the sharding group, balanced by size.

Ownership is decided once, from sizes and names only, so every rank computes the same plan without
talking (the cross-rank plan check then confirms it). A bucket of tensors moves through an
owner-major padded buffer: each rank's segment holds the bucket's tensors it owns, in bucket order,
padded to the bucket's largest segment (fleetc/comm/sharding_ops.py).
"""
from __future__ import annotations

from dataclasses import dataclass


def assign_owners(sizes: dict[str, int], degree: int, buckets: list[list[str]] | None = None) -> dict[str, int]:
    """Parameter → owning rank (in the sharding group): largest first, each to the least-loaded rank.

    With `buckets` (stage 2's gradient buckets) the load that counts first is the bucket's, then the overall one,
    so every bucket's segments come out nearly even (little padding in its reduce-scatter) and the total stays
    balanced; parameters in no bucket come last. Deterministic: ties go by name, then to the lowest rank. With
    more ranks than parameters some ranks own nothing.
    """
    loads = [0] * degree
    owners: dict[str, int] = {}
    covered = {name for bucket in buckets or () for name in bucket}
    for group in [*(buckets or ()), [n for n in sizes if n not in covered]]:
        local = [0] * degree
        for name in sorted(group, key=lambda n: (-sizes[n], n)):
            rank = min(range(degree), key=lambda r: (local[r], loads[r], r))
            owners[name] = rank
            local[rank] += sizes[name]
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
    def of(cls, names: list[str], owners: dict[str, int], sizes: dict[str, int], degree: int) -> ShardedBucket:
        per_rank = [0] * degree
        for name in names:
            per_rank[owners[name]] += sizes[name]
        return cls(tuple(names), tuple(owners[n] for n in names), max(per_rank), sum(sizes[n] for n in names))

    def owned_by(self, rank: int) -> list[str]:
        return [n for n, owner in zip(self.names, self.owners) if owner == rank]

    def padding(self, degree: int) -> int:
        """Elements of padding in the bucket's buffer."""
        return self.segment * degree - self.total


@dataclass(frozen=True)
class FlatBucket:
    """A bucket sharded evenly (stage 2): its tensors one after another in bucket order, padded at the end to
    `segment × degree` elements; rank r owns elements [r·segment, (r+1)·segment), so a tensor may be split between
    ranks and a rank's range may be all padding."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    segment: int

    @classmethod
    def of(cls, names: list[str], sizes: dict[str, int], degree: int) -> FlatBucket:
        total = sum(sizes[n] for n in names)
        return cls(tuple(names), tuple(sizes[n] for n in names), -(-total // degree))

    @property
    def starts(self) -> list[int]:
        """Start of each tensor in the flat buffer."""
        out, at = [], 0
        for numel in self.numels:
            out.append(at)
            at += numel
        return out

    def pieces(self, rank: int) -> list[tuple[str, int, int]]:
        """(tensor, lo, hi): the elements [lo, hi) of each tensor (flattened) rank `rank` owns, in bucket order; they
        are consecutive from the start of its segment."""
        lo, hi = rank * self.segment, (rank + 1) * self.segment
        return [(name, max(lo, start) - start, min(hi, start + numel) - start)
                for name, start, numel in zip(self.names, self.starts, self.numels) if start < hi and start + numel > lo]

    def padding(self, degree: int) -> int:
        return self.segment * degree - sum(self.numels)
