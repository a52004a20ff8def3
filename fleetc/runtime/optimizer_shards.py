"""Joining a checkpoint's optimizer shard files into one optimizer state, checking that every entry fits.

Sharding writes one optimizer file per shard (fleet/sharded_state.py). On flat buckets a file may hold only a piece
of a parameter's state, elements [lo, hi) of each flattened tensor, and other files the rest. Merging joins the
pieces into whole state of the loading optimizer's parameter shapes, whatever mesh wrote them, so a checkpoint loads
into any number of ranks. Pieces are checked as they are joined, since a misfit would otherwise fail inside torch or
load silently: a piece outside its parameter (another model, another parameter order), pieces that overlap or leave
elements out, and a parameter whose state two files hold are CheckpointErrors naming the file, parameter and key.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from fleetc.errors import CheckpointError

# (file path, its entries {parameter index: {key: value}}, its pieces [[index, lo, hi], ...])
ShardFile = tuple[str, Mapping[Any, Mapping[str, Any]], list[list[int]]]


def merge_optimizer_shards(state: dict, files: Iterable[ShardFile], shape_of: Callable[[int], tuple],
                           describe: Callable[[Any], str], wanted: set[int] | None = None) -> dict[Any, str]:
    """Add each shard file's entries to `state` (`optimizer.state_dict()["state"]`, in place), joining pieces into
    tensors of `shape_of(index)`; `describe(index)` names a parameter in errors. `wanted`: the parameters whose
    state must be whole (None: all); the files read for them may hold pieces of others, whose other pieces were
    not read. Returns the file each merged parameter's state came from (for later errors about it)."""
    origin: dict[Any, str] = {}
    covered: dict[Any, list[tuple[int, int, str]]] = {}
    for where, entries, pieces in files:
        split = _pieces(where, pieces)
        for index, slots in entries.items():
            if index in origin and index not in covered or index in covered and index not in split:
                raise CheckpointError(f"{where}: holds the optimizer state of {describe(index)}, which "
                                      f"{origin[index]} holds too: a parameter's state belongs to one shard")
            origin.setdefault(index, where)
            if index not in split:
                state[index] = slots
                continue
            lo, hi = split[index]
            numel = math.prod(shape_of(index))
            if hi > numel:
                raise CheckpointError(f"{where}: holds elements [{lo}, {hi}) of the optimizer state of "
                                      f"{describe(index)}, which has {numel} elements (another model or another "
                                      "parameter order?)")
            covered.setdefault(index, []).append((lo, hi, where))
            _join(state.setdefault(index, {}), slots, lo, hi, shape_of(index), f"{where}: {describe(index)}")
    for index, spans in covered.items():
        if wanted is None or index in wanted:
            _check_covered(index, sorted(spans), math.prod(shape_of(index)), describe)
    return origin


def _pieces(where: str, pieces: Any) -> dict[Any, tuple[int, int]]:
    """{index: (lo, hi)} from a manifest's piece list, checked."""
    split = {}
    for piece in pieces:
        if not isinstance(piece, list | tuple) or len(piece) != 3 or not all(type(v) is int for v in piece) \
                or not 0 <= piece[1] < piece[2]:
            raise CheckpointError(f"{where}: the manifest gives it the piece {piece!r}; expected [parameter index, "
                                  "lo, hi] with 0 <= lo < hi")
        split[piece[0]] = (piece[1], piece[2])
    return split


def _join(whole: dict[str, Any], slots: Mapping[str, Any], lo: int, hi: int, shape: tuple, where: str) -> None:
    """Copy one piece's tensors into elements [lo, hi) of the whole state's flattened tensors (scalars as they are)."""
    for key, value in slots.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            whole[key] = value
            continue
        if value.numel() != hi - lo:
            raise CheckpointError(f"{where}: state {key!r} holds {value.numel()} values for the {hi - lo} elements "
                                  f"[{lo}, {hi}) the manifest gives it")
        if key not in whole:
            whole[key] = value.new_zeros(shape)
        whole[key].view(-1)[lo:hi] = value.reshape(-1)


def _check_covered(index: Any, spans: list[tuple[int, int, str]], numel: int,
                   describe: Callable[[Any], str]) -> None:
    """CheckpointError unless the pieces of a parameter's state cover its elements once each."""
    end = 0
    for lo, hi, where in spans:
        if lo != end:
            problem = f"elements [{end}, {lo}) are in no file" if lo > end else f"overlaps elements [{lo}, {end})"
            raise CheckpointError(f"{where}: holds elements [{lo}, {hi}) of the optimizer state of "
                                  f"{describe(index)}, and {problem} of it")
        end = hi
    if end != numel:
        raise CheckpointError(f"{spans[-1][2]}: the optimizer shards hold elements [0, {end}) of the state of "
                              f"{describe(index)}, which has {numel}: the rest is in no file")
