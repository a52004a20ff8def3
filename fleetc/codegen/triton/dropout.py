"""Triton kernels of the Philox dropout ops: `fused_dropout_add_philox` and `philox_dropout_mul`.

Both regenerate the keep mask in registers from `rng_state = [seed, offset]` (read from device
memory, so no host sync): element i draws Philox 4x32-10 at counter `offset + i` and is kept when
its uniform float is >= p. The Philox rounds are written out in the kernel's own module rather than
calling `tl.rand`: Triton's library helpers are jitted when triton is first imported and then fail in
interpreted kernels (see lowering.py), and the tests check the kernels under TRITON_INTERPRET=1.
fleetc/ops/dropout_philox.py is the reference both kernels are checked against, bit for bit in fp32;
its tests also check that reference against `tl.rand` itself.

Tensors are processed flat (inputs made contiguous); p and scale are fp32 runtime arguments, so one
compiled kernel serves every dropout rate; `TRAIN`, sizes and block are constexprs.
"""
from __future__ import annotations

from typing import Callable

import torch

from fleetc.codegen.triton.kernel import KernelSource
from fleetc.codegen.triton.launch import (
    Launcher,
    block_sizes,
    interpreting,
    load_kernel,
)
from fleetc.ir.program import Op, Var
from fleetc.ops.dropout_philox import dropout_scale, is_training, new_rng_state

_PHILOX = '''import triton
import triton.language as tl


@triton.jit
def _uniform(rng_state, index):
    """tl.rand(seed, offset + index) with rng_state = [seed, offset]: Philox 4x32-10, first output as [0, 1)."""
    seed = tl.load(rng_state).to(tl.uint64)
    counter = tl.load(rng_state + 1) + index
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = counter.to(tl.uint32)
    c1 = (counter >> 32).to(tl.uint32)
    c2 = c0 * 0
    c3 = c0 * 0
    for _ in tl.static_range(10):
        _c0 = c0
        _c2 = c2
        c0 = tl.math.umulhi(0xCD9E8D57, _c2) ^ c1 ^ k0
        c2 = tl.math.umulhi(0xD2511F53, _c0) ^ c3 ^ k1
        c1 = _c2 * 0xCD9E8D57
        c3 = _c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    x = c0.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, ~x, x)
    return x * 4.6566127342e-10


@triton.jit
def _load(pointer, offs, mask):
    """Float math in fp32 (low precision upcast, rounded once on store); fp64 stays fp64."""
    value = tl.load(pointer + offs, mask=mask, other=0)
    if value.dtype != tl.float64:
        value = value.to(tl.float32)
    return value


'''

_FORWARD = _PHILOX + '''@triton.jit
def fused_dropout_add_philox(x, residual, rng_state, out, p, scale, TRAIN: tl.constexpr, NUMEL: tl.constexpr,
                             BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    p = tl.cast(p, tl.float32)
    scale = tl.cast(scale, tl.float32)
    dropped = _load(x, offs, mask)
    if TRAIN:
        dropped = tl.where(_uniform(rng_state, offs) >= p, dropped * scale, 0.0)
    kept = _load(residual, offs, mask) + dropped
    tl.store(out + offs, kept.to(out.dtype.element_ty), mask=mask)
'''

_MUL = _PHILOX + '''@triton.jit
def philox_dropout_mul(t, rng_state, out, p, scale, TRAIN: tl.constexpr, NUMEL: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    p = tl.cast(p, tl.float32)
    scaled = _load(t, offs, mask) * tl.cast(scale, tl.float32)
    if TRAIN:
        scaled = tl.where(_uniform(rng_state, offs) >= p, scaled, 0.0)
    tl.store(out + offs, scaled.to(out.dtype.element_ty), mask=mask)
'''

FORWARD_KERNEL = KernelSource("fused_dropout_add_philox", _FORWARD, rank=1, reduce_dims=None)
MUL_KERNEL = KernelSource("philox_dropout_mul", _MUL, rank=1, reduce_dims=None)

_LAUNCHERS: dict[tuple, Launcher] = {}


def _launcher(kernel: KernelSource, like: torch.Tensor, dtype: torch.dtype, p: float, scale: float,
              train: bool) -> Launcher:
    """A launcher over `like.numel()` elements writing one output of `like`'s shape and `dtype`."""
    key = (kernel.source_hash, tuple(like.shape), dtype, like.device, p, scale, train, interpreting())
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        sizes = block_sizes(kernel, (like.numel(),))
        grid = (-(-sizes["NUMEL"] // sizes["BLOCK"]),)
        arguments = {"p": float(p), "scale": float(scale), "TRAIN": train, **sizes}
        launcher = _LAUNCHERS[key] = Launcher(load_kernel(kernel), grid, arguments, [(tuple(like.shape), dtype)])
    return launcher


def run_fused_dropout_add_philox(x: torch.Tensor, residual: torch.Tensor, p: float,
                                 train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`fleetc.fused_dropout_add_philox` in one kernel (CUDA tensors, or any under TRITON_INTERPRET=1)."""
    rng_state = new_rng_state(x.device, train)
    dtype = torch.promote_types(x.dtype, residual.dtype)
    launcher = _launcher(FORWARD_KERNEL, x, dtype, p, dropout_scale(p), is_training(train))
    return launcher((x.contiguous(), residual.expand_as(x).contiguous(), rng_state)), rng_state


def run_philox_dropout_mul(t: torch.Tensor, rng_state: torch.Tensor, p: float, train: bool | None,
                           scale: float) -> torch.Tensor:
    """`fleetc.philox_dropout_mul` in one kernel (CUDA tensors, or any under TRITON_INTERPRET=1)."""
    return _launcher(MUL_KERNEL, t, t.dtype, p, scale, is_training(train))((t.contiguous(), rng_state))


def _sources(kernel: KernelSource) -> Callable[[Op, list[Var | None]], list[KernelSource]]:
    def sources(op: Op, inputs: list[Var | None]) -> list[KernelSource]:
        """The op's one kernel (the source does not depend on shapes or dtypes: Triton specialises on them)."""
        return [kernel]

    return sources


fused_dropout_add_philox_sources = _sources(FORWARD_KERNEL)
philox_dropout_mul_sources = _sources(MUL_KERNEL)
