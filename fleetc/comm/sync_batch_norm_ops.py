"""Batch norm over every data-parallel rank's samples: statistics (forward) and gradient sums (backward) over all ranks.

Same results and outputs as aten's `_native_batch_norm_legit_functional` / `native_batch_norm_backward`
on the concatenation of all ranks' batches. The weight and bias gradients stay each rank's own sums,
as aten's are; the gradient allreduce then averages them like every other gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fleetc.comm.collectives import blocking_collective
from fleetc.ir.registry import register_op


def _channel_dims(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """Dimensions to reduce over and the shape that broadcasts a per-channel vector against `x`."""
    return [0, *range(2, x.dim())], [1, x.shape[1], *([1] * (x.dim() - 2))]


def _sum_over_ranks(label: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    blocking_collective(label, dist.all_reduce, flat, op=dist.ReduceOp.SUM)
    return list(flat.split([t.numel() for t in tensors]))


@register_op("sync_batch_norm", "training-mode batch norm with mean and variance over all data-parallel ranks")
def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float, eps: float,
                    label: str) -> tuple[torch.Tensor, ...]:
    dims, shape = _channel_dims(x)
    label = f"sync_batch_norm statistics of {label!r}"
    count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.float32)
    total_sum, total = _sum_over_ranks(label, x.sum(dims, dtype=torch.float32), count)
    mean = total_sum / total
    centered = x - mean.view(shape)
    (squares,) = _sum_over_ranks(label, centered.square().sum(dims, dtype=torch.float32))
    var = squares / total
    invstd = torch.rsqrt(var + eps)
    out = centered * invstd.view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    new_mean = running_mean * (1 - momentum) + mean * momentum
    new_var = running_var * (1 - momentum) + var * (total / (total - 1)) * momentum
    return out.to(x.dtype), mean, invstd, new_mean, new_var


@register_op("sync_batch_norm_backward", "batch-norm backward with gradient sums over all data-parallel ranks")
def sync_batch_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                             mean: torch.Tensor, invstd: torch.Tensor, output_mask: list, label: str) -> tuple:
    dims, shape = _channel_dims(x)
    label = f"sync_batch_norm gradients of {label!r}"
    xhat = (x - mean.view(shape)) * invstd.view(shape)
    sum_dy = grad_out.sum(dims)
    sum_dy_xhat = (grad_out * xhat).sum(dims)
    count = torch.tensor([x.numel() // x.shape[1]], dtype=sum_dy.dtype)
    all_dy, all_dy_xhat, total = _sum_over_ranks(label, sum_dy, sum_dy_xhat, count)
    scale = invstd if weight is None else invstd * weight
    grad_in = (grad_out - (all_dy / total).view(shape) - xhat * (all_dy_xhat / total).view(shape)) * scale.view(shape)
    return (grad_in if output_mask[0] else None, sum_dy_xhat if output_mask[1] else None,
            sum_dy if output_mask[2] else None)
