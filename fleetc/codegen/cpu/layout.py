"""The iteration space of a pointwise/reduction kernel: kept dims then reduced dims, with mergeable dims collapsed.

Like aten's TensorIterator: the output shape is the broadcast of the inputs; reduced dims move after the kept
ones; two adjacent dims of one group merge when every operand's strides allow it (stride[d] == stride[d+1] *
size[d+1]); size-1 dims drop. A contiguous tensor becomes one dim, a bias added to rows stays two. The
kernel receives the collapsed sizes and every operand's element strides (0 where it broadcasts) in `meta`;
it takes its vectorized path when each operand's innermost stride is the one planned for it from the static
shapes (1, or 0 for an operand broadcast along the innermost dim), else a strided loop.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Collapsed sizes of the kept dims and of the reduced dims, and each operand's strides over both."""

    kept: tuple[int, ...]
    reduced: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]

    def meta(self) -> list[int]:
        """[number of kept dims, number of reduced dims, sizes..., strides of operand 0..., operand 1..., ...]."""
        return [len(self.kept), len(self.reduced), *self.kept, *self.reduced, *(x for s in self.strides for x in s)]


def broadcast_strides(shape: tuple[int, ...], strides: tuple[int, ...], full: tuple[int, ...]) -> tuple[int, ...]:
    """An operand's strides over the full shape: leading dims it lacks and its size-1 dims broadcast (stride 0)."""
    pad = len(full) - len(shape)
    return tuple(0 if d < pad or shape[d - pad] == 1 and full[d] != 1 else strides[d - pad] for d in range(len(full)))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _collapse(sizes: list[int], strides: list[list[int]]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    keep = [d for d, size in enumerate(sizes) if size != 1]
    out_sizes: list[int] = []
    out_strides: list[list[int]] = [[] for _ in strides]
    for d in keep:
        if out_sizes and all(s[-1] == st[d] * sizes[d] for s, st in zip(out_strides, strides)):
            out_sizes[-1] *= sizes[d]
            for s, st in zip(out_strides, strides):
                s[-1] = st[d]
            continue
        out_sizes.append(sizes[d])
        for s, st in zip(out_strides, strides):
            s.append(st[d])
    if not out_sizes:
        return (1,), [(0,) for _ in strides]
    return tuple(out_sizes), [tuple(s) for s in out_strides]


def layout(full: tuple[int, ...], operand_strides: list[tuple[int, ...]], reduced_dims: tuple[int, ...] = ()) -> Layout:
    """The collapsed iteration space over `full` for operands with these (broadcast) strides."""
    kept_dims = [d for d in range(len(full)) if d not in reduced_dims]
    red_dims = [d for d in range(len(full)) if d in reduced_dims]
    kept, kept_strides = _collapse([full[d] for d in kept_dims], [[s[d] for d in kept_dims] for s in operand_strides])
    if not red_dims:
        return Layout(kept, (), tuple(kept_strides))
    red, red_strides = _collapse([full[d] for d in red_dims], [[s[d] for d in red_dims] for s in operand_strides])
    return Layout(kept, red, tuple(k + r for k, r in zip(kept_strides, red_strides)))


def planned_inner_strides(full: tuple[int, ...], shapes: list[tuple[int, ...]], reduced_dims: tuple[int, ...],
                          inner_is_reduced: bool) -> tuple[int, ...]:
    """The innermost stride of each operand when every operand is contiguous (what the fast path assumes)."""
    strides = [broadcast_strides(s, contiguous_strides(s), full) for s in shapes]
    planned = layout(full, strides, reduced_dims)
    n_kept = len(planned.kept)
    return tuple(s[-1] if inner_is_reduced or not reduced_dims else s[n_kept - 1] for s in planned.strides)
