"""Triton kernels for the batch-norm fusion ops (`fleetc.fused_bn_act`, `fused_bn_add_act`, `fused_bn_act_grad`).

Tensors are (N, C, *spatial) and contiguous, so channel `c` of flat element `i` is `(i // S) % C` with S
the spatial size, and a channel's elements form N runs of S. Each op runs a few kernels:

- forward, training: `*_fwd_stats` (grid C × SPLIT) reduces chunks of each channel to a partial mean and
  sum of squared deviations (two passes over the chunk, fp32, so a large mean does not cancel the
  variance); `*_fwd_stats_finalize` (grid C) merges the chunks (Chan's parallel formula), writes mean
  and rstd and updates the running statistics in place as aten does (momentum; unbiased variance);
- forward: `*_fwd` (pointwise) normalizes with the batch (training) or running (eval) statistics,
  applies weight and bias, adds the residual and the activation;
- backward: `*_grad_reduce` (grid C × SPLIT) computes the activation's gradient `dpre` (stored: it is
  an output) and partial sums of `dpre` and `dpre * (x - mean)`; `*_grad_finalize` (grid C) writes
  dweight and dbias and four per-channel coefficients; `*_grad_dx` (pointwise) applies them.

Math runs in fp32; values the unfused aten sequence rounds to the input dtype (the bn output before
the residual add, `pre` before the activation, `dpre` before its reductions) are rounded the same way.
Kernels are built from source text (activations come from lowering.py) and cached by launch.py.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

from fleetc.codegen.triton.kernel import KernelSource
from fleetc.codegen.triton.launch import block_sizes, launch, load_kernel
from fleetc.ir.program import Op, Var
from fleetc.ops.activations import ACTIVATIONS
from fleetc.ops.pointwise import activation_expression, activation_grad_expression

# Reduction heuristic: each (channel, chunk) program loops over blocks of up to STATS_MAX_BLOCK elements, about
# MIN_BLOCKS_PER_CHUNK of them (more once a channel has MAX_SPLIT chunks): many programs even when C is small.
STATS_MAX_BLOCK = 512
MIN_BLOCKS_PER_CHUNK = 4
MAX_SPLIT = 256

_LOW_PRECISION = (torch.float16, torch.bfloat16)

_HEADER = '''import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


'''

# Element r (0 <= r < R = N*S) of channel c lives at flat offset (r // S) * C * S + c * S + r % S.
_STATS = _HEADER + '''@triton.jit
def {name}(x, part_mean, part_m2, C: tl.constexpr, S: tl.constexpr, R: tl.constexpr, SPLIT: tl.constexpr,
        CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    start = tl.program_id(1) * CHUNK
    count = tl.minimum(R - start, CHUNK).to(tl.float32)
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for k in range(0, CHUNK, BLOCK):
        r = start + k + tl.arange(0, BLOCK)
        acc += tl.load(x + (r // S) * (C * S) + c * S + r % S, mask=r < R, other=0.0).to(tl.float32)
    mean = tl.reduce(acc, 0, _add) / count
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for k in range(0, CHUNK, BLOCK):
        r = start + k + tl.arange(0, BLOCK)
        v = tl.load(x + (r // S) * (C * S) + c * S + r % S, mask=r < R, other=0.0).to(tl.float32)
        d = tl.where(r < R, v - mean, 0.0)
        acc += d * d
    tl.store(part_mean + c * SPLIT + tl.program_id(1), mean)
    tl.store(part_m2 + c * SPLIT + tl.program_id(1), tl.reduce(acc, 0, _add))
'''

_STATS_FINALIZE = _HEADER + '''@triton.jit
def {name}(part_mean, part_m2, mean_out, rstd_out, running_mean, running_var, momentum, eps, R: tl.constexpr,
        SPLIT: tl.constexpr, CHUNK: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    c = tl.program_id(0)
    j = tl.arange(0, SPLIT_BLOCK)
    valid = j < SPLIT
    count = tl.where(valid, tl.minimum(R - j * CHUNK, CHUNK), 0).to(tl.float32)
    chunk_mean = tl.load(part_mean + c * SPLIT + j, mask=valid, other=0.0)
    mean = tl.reduce(count * chunk_mean, 0, _add) / R
    d = chunk_mean - mean
    m2 = tl.reduce(tl.load(part_m2 + c * SPLIT + j, mask=valid, other=0.0) + count * d * d, 0, _add)
    tl.store(mean_out + c, mean)
    tl.store(rstd_out + c, 1.0 / tl.sqrt(m2 / R + eps))
    old_mean = tl.load(running_mean + c).to(tl.float32)
    old_var = tl.load(running_var + c).to(tl.float32)
    new_mean = (1.0 - momentum) * old_mean + momentum * mean
    new_var = (1.0 - momentum) * old_var + momentum * (m2 / (R - 1))
    tl.store(running_mean + c, new_mean.to(running_mean.dtype.element_ty))
    tl.store(running_var + c, new_var.to(running_var.dtype.element_ty))
'''

# STAT_IS_VAR: `stat` holds the running variance (eval), else the batch rstd (training).
_FORWARD = _HEADER + '''@triton.jit
def {name}(x, residual, weight, bias, mean, stat, out, pre, eps, C: tl.constexpr, S: tl.constexpr,
        NUMEL: tl.constexpr, BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
        STAT_IS_VAR: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    c = (offs // S) % C
    rstd = tl.load(stat + c, mask=mask, other=1.0).to(tl.float32)
    if STAT_IS_VAR:
        rstd = 1.0 / tl.sqrt(rstd + eps)
    y = (tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
         - tl.load(mean + c, mask=mask, other=0.0).to(tl.float32)) * rstd
    if HAS_WEIGHT:
        y = y * tl.load(weight + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias + c, mask=mask, other=0.0).to(tl.float32)
{residual}    y = y.to(pre.dtype.element_ty)
    tl.store(pre + offs, y, mask=mask)
    y = y.to(tl.float32)
    tl.store(out + offs, ({activation}).to(out.dtype.element_ty), mask=mask)
'''

_RESIDUAL_ADD = '''    y = y.to(pre.dtype.element_ty).to(tl.float32) + tl.load(residual + offs, mask=mask, other=0.0).to(tl.float32)
'''

_GRAD_REDUCE = _HEADER + '''@triton.jit
def {name}(dout, saved, x, mean, dpre, part_sum, part_dot, C: tl.constexpr, S: tl.constexpr, R: tl.constexpr,
        SPLIT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    start = tl.program_id(1) * CHUNK
    channel_mean = tl.load(mean + c).to(tl.float32)
    acc_sum = tl.full([BLOCK], 0.0, tl.float32)
    acc_dot = tl.full([BLOCK], 0.0, tl.float32)
    for k in range(0, CHUNK, BLOCK):
        r = start + k + tl.arange(0, BLOCK)
        mask = r < R
        offs = (r // S) * (C * S) + c * S + r % S
        g = tl.load(dout + offs, mask=mask, other=0.0).to(tl.float32)
{load_saved}        d = ({gradient}).to(dpre.dtype.element_ty)
        tl.store(dpre + offs, d, mask=mask)
        d = tl.where(mask, d.to(tl.float32), 0.0)
        acc_sum += d
        acc_dot += d * (tl.load(x + offs, mask=mask, other=0.0).to(tl.float32) - channel_mean)
    tl.store(part_sum + c * SPLIT + tl.program_id(1), tl.reduce(acc_sum, 0, _add))
    tl.store(part_dot + c * SPLIT + tl.program_id(1), tl.reduce(acc_dot, 0, _add))
'''

# coef[c] = (mean, a, k1, k2) with dx = (dpre - k1 - (x - mean) * k2) * a, aten's native_batch_norm_backward.
_GRAD_FINALIZE = _HEADER + '''@triton.jit
def {name}(part_sum, part_dot, stat, weight, dweight, dbias, mean, coef, eps, R: tl.constexpr,
        SPLIT: tl.constexpr, SPLIT_BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr, STAT_IS_VAR: tl.constexpr,
        TRAINING: tl.constexpr, WRITE_DWEIGHT: tl.constexpr, WRITE_DBIAS: tl.constexpr):
    c = tl.program_id(0)
    j = tl.arange(0, SPLIT_BLOCK)
    total = tl.reduce(tl.load(part_sum + c * SPLIT + j, mask=j < SPLIT, other=0.0), 0, _add)
    dot = tl.reduce(tl.load(part_dot + c * SPLIT + j, mask=j < SPLIT, other=0.0), 0, _add)
    rstd = tl.load(stat + c).to(tl.float32)
    if STAT_IS_VAR:
        rstd = 1.0 / tl.sqrt(rstd + eps)
    if WRITE_DWEIGHT:
        tl.store(dweight + c, (dot * rstd).to(dweight.dtype.element_ty))
    if WRITE_DBIAS:
        tl.store(dbias + c, total.to(dbias.dtype.element_ty))
    scale = rstd
    if HAS_WEIGHT:
        scale = scale * tl.load(weight + c).to(tl.float32)
    tl.store(coef + 4 * c, tl.load(mean + c).to(tl.float32))
    tl.store(coef + 4 * c + 1, scale)
    if TRAINING:
        tl.store(coef + 4 * c + 2, total / R)
        tl.store(coef + 4 * c + 3, rstd * rstd * dot / R)
    else:
        tl.store(coef + 4 * c + 2, 0.0)
        tl.store(coef + 4 * c + 3, 0.0)
'''

_GRAD_DX = _HEADER + '''@triton.jit
def {name}(dpre, x, coef, dx, C: tl.constexpr, S: tl.constexpr, NUMEL: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    c4 = ((offs // S) % C) * 4
    d = tl.load(dpre + offs, mask=mask, other=0.0).to(tl.float32)
    centered = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32) - tl.load(coef + c4, mask=mask, other=0.0)
    result = (d - tl.load(coef + c4 + 2, mask=mask, other=0.0)
              - centered * tl.load(coef + c4 + 3, mask=mask, other=0.0)) * tl.load(coef + c4 + 1, mask=mask, other=0.0)
    tl.store(dx + offs, result.to(dx.dtype.element_ty), mask=mask)
'''


def _kernel(name: str, template: str, reduce_over_channels: bool, **fields: str) -> KernelSource:
    source = template.format(name=name, **fields)
    # rank is not fixed by these sources (any rank >= 2 runs as N × C × S); the reductions keep dim 1 only
    return KernelSource(name, source, 3, (0, 2) if reduce_over_channels else None)


@functools.lru_cache(maxsize=None)
def forward_kernels(act_name: str, param: Any, with_residual: bool, training: bool) -> tuple[KernelSource, ...]:
    """The kernels of one fused_bn_act / fused_bn_add_act, in launch order (stats kernels only when training)."""
    prefix = f"fused_bn_{'add_' if with_residual else ''}{act_name}"
    stats = (_kernel(f"{prefix}_fwd_stats", _STATS, True),
             _kernel(f"{prefix}_fwd_stats_finalize", _STATS_FINALIZE, False)) if training else ()
    forward = _kernel(f"{prefix}_fwd", _FORWARD, False, residual=_RESIDUAL_ADD if with_residual else "",
                      activation=activation_expression(act_name, param, "y"))
    return (*stats, forward)


@functools.lru_cache(maxsize=None)
def backward_kernels(act_name: str, param: Any, with_dx: bool) -> tuple[KernelSource, ...]:
    """The kernels of one fused_bn_act_grad, in launch order (the dx kernel only when dx is requested)."""
    prefix = f"fused_bn_{act_name}_grad"
    saves = ACTIVATIONS[act_name].saves is not None
    load_saved = "        s = tl.load(saved + offs, mask=mask, other=0.0).to(tl.float32)\n" if saves else ""
    reduce = _kernel(f"{prefix}_reduce", _GRAD_REDUCE, True, load_saved=load_saved,
                     gradient=activation_grad_expression(act_name, param, "g", "s"))
    finalize = _kernel(f"{prefix}_finalize", _GRAD_FINALIZE, False)
    dx = (_kernel(f"{prefix}_dx", _GRAD_DX, False),) if with_dx else ()
    return (reduce, finalize, *dx)


def fused_bn_sources(op: Op, inputs: list[Var | None]) -> list[KernelSource]:
    """The kernels one batch-norm fusion op runs (the `kernel_sources` lister of all three op types)."""
    if op.type == "fleetc.fused_bn_act_grad":
        act_name, param, output_mask = op.args[-2], op.args[-1], op.args[-3]
        return list(backward_kernels(act_name, param, bool(output_mask[0])))
    with_residual = op.type == "fleetc.fused_bn_add_act"
    training = op.args[6 if with_residual else 5]
    return list(forward_kernels(op.args[-2], op.args[-1], with_residual, bool(training)))


def _launch(kernel: KernelSource, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
    launch(load_kernel(kernel), grid, *args, **constexprs)


def _layout(x: torch.Tensor) -> tuple[int, int, int]:
    """(N, C, S) of an (N, C, *spatial) tensor."""
    if x.dim() < 2:
        raise ValueError(f"batch norm kernels need an input of rank >= 2 with channels in dim 1, got shape "
                         f"{tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"batch norm kernels need at least one element per channel, got shape {tuple(x.shape)}")
    if x.numel() >= 2 ** 31:
        raise ValueError(f"batch norm kernels index with int32: input of {x.numel()} elements is too large")
    return x.shape[0], x.shape[1], math.prod(x.shape[2:])


def _reduction_split(per_channel: int) -> dict[str, int]:
    """Block, chunk and number of chunks for reducing `per_channel` elements of each channel."""
    block = min(STATS_MAX_BLOCK, max(16, 1 << max(0, (per_channel - 1).bit_length())))
    split = min(MAX_SPLIT, -(-per_channel // (block * MIN_BLOCKS_PER_CHUNK)))
    chunk = -(-per_channel // (split * block)) * block
    split = -(-per_channel // chunk)  # every chunk holds at least one element
    return {"R": per_channel, "SPLIT": split, "CHUNK": chunk, "BLOCK": block}


def _launch_pointwise(kernel: KernelSource, numel: int, *args: Any, **constexprs: Any) -> None:
    sizes = block_sizes(kernel, (numel,))
    _launch(kernel, (max(1, -(-sizes["NUMEL"] // sizes["BLOCK"])),), *args, **constexprs, **sizes)


def _split_block(split: dict[str, int]) -> int:
    """A power-of-two block (at least 2) holding every chunk's partial result of one channel."""
    return max(2, 1 << (split["SPLIT"] - 1).bit_length())


def stats_dtype(x: torch.Tensor, *params: torch.Tensor | None) -> torch.dtype:
    """The dtype aten gives saved mean/rstd and dweight/dbias: fp32 when low-precision input meets fp32
    parameters (mixed precision), else the input's dtype."""
    mixed = x.dtype in _LOW_PRECISION and any(p is not None and p.dtype == torch.float32 for p in params)
    return torch.float32 if mixed else x.dtype


def _batch_statistics(kernels: tuple[KernelSource, ...], x: torch.Tensor, running_mean: torch.Tensor,
                      running_var: torch.Tensor, momentum: float, eps: float) -> tuple[torch.Tensor, ...]:
    """fp32 (mean, rstd) per channel; updates the running statistics in place."""
    _, channels, spatial = _layout(x)
    split = _reduction_split(x.numel() // channels)
    part_mean = torch.empty(channels, split["SPLIT"], dtype=torch.float32, device=x.device)
    part_m2 = torch.empty_like(part_mean)
    _launch(kernels[0], (channels, split["SPLIT"]), x, part_mean, part_m2, C=channels, S=spatial, **split)
    mean = torch.empty(channels, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    _launch(kernels[1], (channels,), part_mean, part_m2, mean, rstd, running_mean, running_var, float(momentum),
            float(eps), R=split["R"], SPLIT=split["SPLIT"], CHUNK=split["CHUNK"], SPLIT_BLOCK=_split_block(split))
    return mean, rstd


def _forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None,
             running_mean: torch.Tensor, running_var: torch.Tensor, training: bool, momentum: float, eps: float,
             act: str, param: Any) -> tuple[torch.Tensor, ...]:
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    _, channels, spatial = _layout(x)
    kernels = forward_kernels(act, param, residual is not None, bool(training))
    saved_dtype = stats_dtype(x, weight, bias, running_mean, running_var)
    if training:
        mean, stat = _batch_statistics(kernels, x, running_mean, running_var, momentum, eps)
        saved = (mean.to(saved_dtype), stat.to(saved_dtype))
    else:
        mean, stat = running_mean, running_var
        saved = tuple(torch.empty(0, dtype=saved_dtype, device=x.device) for _ in range(2))
    out, pre = torch.empty_like(x), torch.empty_like(x)
    # absent operands are passed as x (never read: HAS_* are off) so every launch has the same arity
    _launch_pointwise(kernels[-1], x.numel(), x, residual if residual is not None else x,
                      weight if weight is not None else x, bias if bias is not None else x, mean, stat, out, pre,
                      float(eps), C=channels, S=spatial, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                      STAT_IS_VAR=not training)
    return out, pre, *saved


def fused_bn_act(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, running_mean: torch.Tensor,
                 running_var: torch.Tensor, training: bool, momentum: float, eps: float, act: str,
                 param: Any) -> tuple[torch.Tensor, ...]:
    """`fleetc.fused_bn_act` on the Triton kernels: (out, bn, mean, rstd); training updates the running stats."""
    return _forward(x, None, weight, bias, running_mean, running_var, training, momentum, eps, act, param)


def fused_bn_add_act(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     running_mean: torch.Tensor, running_var: torch.Tensor, training: bool, momentum: float,
                     eps: float, act: str, param: Any) -> tuple[torch.Tensor, ...]:
    """`fleetc.fused_bn_add_act` on the Triton kernels: (out, pre, mean, rstd)."""
    return _forward(x, residual, weight, bias, running_mean, running_var, training, momentum, eps, act, param)


def fused_bn_act_grad(dout: torch.Tensor, saved: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None,
                      running_mean: torch.Tensor | None, running_var: torch.Tensor | None, save_mean: torch.Tensor | None,
                      save_rstd: torch.Tensor | None, training: bool, eps: float, output_mask: list, act: str,
                      param: Any) -> tuple[torch.Tensor, ...]:
    """`fleetc.fused_bn_act_grad` on the Triton kernels: (dx, dweight, dbias, dpre), None where output_mask is off."""
    dout, x = dout.contiguous(), x.contiguous()
    saved = saved.contiguous() if saved is not None else dout  # unread when the activation saves nothing
    _, channels, spatial = _layout(x)
    mean, stat = (save_mean, save_rstd) if training else (running_mean, running_var)
    if mean is None or stat is None:
        mode = "training needs save_mean and save_rstd" if training else "eval needs running_mean and running_var"
        raise ValueError(f"fused_bn_act_grad: {mode}")
    kernels = backward_kernels(act, param, bool(output_mask[0]))
    split = _reduction_split(x.numel() // channels)
    dpre = torch.empty_like(dout)
    part_sum = torch.empty(channels, split["SPLIT"], dtype=torch.float32, device=x.device)
    part_dot = torch.empty_like(part_sum)
    _launch(kernels[0], (channels, split["SPLIT"]), dout, saved, x, mean, dpre, part_sum, part_dot,
            C=channels, S=spatial, **split)
    grad_dtype = stats_dtype(x, weight, running_mean, running_var, save_mean, save_rstd)
    dweight = torch.empty(channels, dtype=grad_dtype, device=x.device) if output_mask[1] else None
    dbias = torch.empty(channels, dtype=grad_dtype, device=x.device) if output_mask[2] else None
    coef = torch.empty(channels, 4, dtype=torch.float32, device=x.device)
    _launch(kernels[1], (channels,), part_sum, part_dot, stat, weight if weight is not None else stat,
            dweight if dweight is not None else coef, dbias if dbias is not None else coef, mean, coef, float(eps),
            R=split["R"], SPLIT=split["SPLIT"], SPLIT_BLOCK=_split_block(split),
            HAS_WEIGHT=weight is not None, STAT_IS_VAR=not training, TRAINING=bool(training),
            WRITE_DWEIGHT=dweight is not None, WRITE_DBIAS=dbias is not None)
    dx = None
    if output_mask[0]:
        dx = torch.empty_like(x)
        _launch_pointwise(kernels[2], x.numel(), dpre, x, coef, dx, C=channels, S=spatial)
    return dx, dweight, dbias, dpre
