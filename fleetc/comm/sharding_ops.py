"""Sharding's collective ops (role collective): gather updated parameters from their owners, reduce-scatter gradients.

Both move one bucket through a padded flat buffer of `segment` elements per rank, so the collectives are the
fixed-size `all_gather_single` and `reduce_scatter_single` on the sharding group; each tensor's start in it
is given. Owner-major (whole parameters): rank r's segment holds, in bucket order, the tensors rank r owns.
Flat (stage 2 by default): the tensors one after another, so a tensor may straddle two segments. A rank that
owns nothing in a bucket sends padding.
With data-parallel replicas beside the sharding group (`dp_group` not empty) the reduce-scattered shard
is then summed over the replicas; the average is over every rank either way. The layout (owners and
offsets) is constant in the Program, so every rank can unpack what every other rank sent.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fleetc.comm import groups
from fleetc.comm.collectives import (
    blocking_collective,
    bucket_views,
    run_collective,
    wait_collective,
)
from fleetc.ir.registry import register_op


def owner_major_starts(numels: list[int], owners: list[int], segment: int) -> list[int]:
    """Start of each tensor in the owner-major padded buffer."""
    filled: dict[int, int] = {}
    starts = []
    for numel, owner in zip(numels, owners):
        starts.append(owner * segment + filled.get(owner, 0))
        filled[owner] = filled.get(owner, 0) + numel
    return starts


@register_op("c_sharding_allgather", "all-gather a bucket of parameters from their owners (after the owners' "
             "updates), in place into every rank's parameters")
def c_sharding_allgather(params: list, starts: list, segment: int, group: str, label: str) -> None:
    """`starts`: each parameter's place in the bucket's padded buffer (owner-major: whole parameters in their
    owner's segment; flat: one after another, split where a segment ends); rank r sends segment r."""
    me = dist.get_rank(groups.group(group))
    label = f"sharding parameter all-gather {label!r}"
    lo, hi = me * segment, (me + 1) * segment
    mine = torch.zeros(segment, dtype=params[0].dtype, device=params[0].device)
    for param, start in zip(params, starts):
        a, b = max(lo, start), min(hi, start + param.numel())
        if a < b:
            mine[a - lo:b - lo] = param.reshape(-1)[a - start:b - start]
    gathered = torch.empty(segment * len(groups.group_ranks(group)), dtype=mine.dtype, device=mine.device)
    blocking_collective(label, dist.all_gather_single, gathered, mine, group=groups.group(group))
    for param, start in zip(params, starts):
        if not lo <= start <= start + param.numel() <= hi:  # not wholly this rank's own
            param.copy_(gathered[start:start + param.numel()].view(param.shape))


@dataclass
class PendingReduceScatter:
    """An issued reduce-scatter: its work handle, the shard it fills and what is still to do after it."""

    work: object
    shard: torch.Tensor
    label: str
    dp_group: str
    world: int


@register_op("c_sharding_reduce_scatter_start", "pack a bucket's gradients owner-major into a padded flat buffer and "
             "issue its reduce-scatter over the sharding group (async); the buffer dies with the collective")
def c_sharding_reduce_scatter_start(grads: list, starts: list, segment: int, group: str, dp_group: str,
                                    label: str) -> PendingReduceScatter:
    """`starts`: each gradient's place in the padded buffer (owner-major or flat, as for the parameter all-gather)."""
    label = f"sharding gradient reduce-scatter {label!r}"
    ranks = len(groups.group_ranks(group))
    flat = torch.zeros(segment * ranks, dtype=grads[0].dtype, device=grads[0].device)
    for grad, start in zip(grads, starts):
        flat[start:start + grad.numel()].view(grad.shape).copy_(grad)
    shard = torch.empty(segment, dtype=flat.dtype, device=flat.device)
    work = run_collective(label, dist.reduce_scatter_single, shard, flat, op=dist.ReduceOp.SUM,
                          group=groups.group(group), async_op=True)
    world = ranks * (len(groups.group_ranks(dp_group)) if dp_group else 1)
    return PendingReduceScatter(work, shard, label, dp_group, world)


@register_op("c_sharding_reduce_scatter_wait", "wait for a bucket's reduce-scatter (and sum the shard over data-parallel "
             "replicas): this rank's shard of the averaged gradients")
def c_sharding_reduce_scatter_wait(pending: PendingReduceScatter) -> torch.Tensor:
    wait_collective(pending.label, pending.work)
    if pending.dp_group:
        blocking_collective(pending.label, dist.all_reduce, pending.shard, op=dist.ReduceOp.SUM,
                            group=groups.group(pending.dp_group))
    return pending.shard.div_(pending.world)


@register_op("shard_views", "views of the gradients this rank owns: consecutive at the start of its shard of a bucket")
def shard_views(shard: torch.Tensor, shapes: list) -> torch.Tensor | tuple:
    views = bucket_views(shard, shapes)
    return views[0] if len(views) == 1 else tuple(views)


@register_op("c_sharding_found_inf_max", "AMP under stage 2: any rank's overflow flag, so every rank skips the same "
             "steps (each checked only the gradient shards it keeps)")
def c_sharding_found_inf_max(found_inf: torch.Tensor, group: str, dp_group: str) -> torch.Tensor:
    flag = found_inf.clone()
    for name in (group, dp_group):
        if name:
            blocking_collective("sharding found_inf max-allreduce", dist.all_reduce, flag, op=dist.ReduceOp.MAX,
                                group=groups.group(name))
    return flag


@dataclass
class PendingParamGather:
    """An issued parameter all-gather: its work handle and the owner-major buffer it fills."""

    work: object
    gathered: torch.Tensor
    label: str


@register_op("c_sharding_param_gather_start", "stage 3: pack the bucket's parameters this rank owns into its segment "
             "and issue the bucket's all-gather over the sharding group (async)")
def c_sharding_param_gather_start(owned: list, segment: int, dtype: torch.dtype, device: str, group: str,
                                  label: str) -> PendingParamGather:
    label = f"sharding parameter gather {label!r}"
    ranks = len(groups.group_ranks(group))
    mine = torch.zeros(segment, dtype=dtype, device=device)
    if owned:  # consecutive at the start of this rank's segment, in bucket order
        packed = torch.cat([p.reshape(-1) for p in owned])
        mine[:packed.numel()] = packed
    gathered = torch.empty(segment * ranks, dtype=dtype, device=device)
    work = run_collective(label, dist.all_gather_single, gathered, mine, group=groups.group(group), async_op=True)
    return PendingParamGather(work, gathered, label)


@register_op("c_sharding_param_gather_wait", "stage 3: wait for a bucket's parameter all-gather; the owner-major "
             "buffer holding every parameter of the bucket")
def c_sharding_param_gather_wait(pending: PendingParamGather) -> torch.Tensor:
    wait_collective(pending.label, pending.work)
    return pending.gathered


@register_op("gathered_params", "stage 3: views of the parameters other ranks own, out of a gathered bucket")
def gathered_params(gathered: torch.Tensor, starts: list, shapes: list) -> torch.Tensor | tuple:
    views = []
    for start, shape in zip(starts, shapes):
        numel = 1
        for d in shape:
            numel *= d
        views.append(gathered[start:start + numel].view(shape))
    return views[0] if len(views) == 1 else tuple(views)


@register_op("c_sharding_norm_sum", "global-norm clipping under stages 2 and 3: the squared norm of every rank's "
             "gradient shards, summed over the sharding group")
def c_sharding_norm_sum(squared_norm: torch.Tensor, group: str) -> torch.Tensor:
    total = squared_norm.clone()
    blocking_collective("sharding gradient-norm allreduce", dist.all_reduce, total, op=dist.ReduceOp.SUM,
                        group=groups.group(group))
    return total
