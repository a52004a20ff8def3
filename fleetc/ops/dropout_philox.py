"""Counter-based (Philox) dropout: dropout + residual add whose keep mask is regenerated, never stored.

`fleetc.fused_dropout_add_philox(x, residual, p, train) -> (out, rng_state)` records a tiny int64
tensor `rng_state = [seed, offset]` instead of a bool mask; `fleetc.philox_dropout_mul(t, rng_state,
p, train, scale)` regenerates the same keep mask from it and returns `t * keep * scale` (the gradient
of the dropped input, and recompute's replay of the dropped value). Element i (flat, row-major) draws
`u = rand(seed, offset + i)`, exactly the float Triton's `tl.rand(seed, offsets)` returns (Philox
4x32-10, then Triton's uint32 → [0, 1) conversion), and is kept when `u >= p`.

The references below compute those numbers with int64 torch ops masked to 32 bits, so they are the
exact oracle of the Triton kernels (fleetc/codegen/triton/dropout.py) and the fallback on any device.
"""
from __future__ import annotations

import math

import torch

from fleetc.ir.registry import register_op

_MASK32 = 0xFFFFFFFF
_ROUNDS = 10
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox 4x32 multipliers
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
# Triton's uint_to_uniform_float scale for 32-bit draws: the largest float with (2**31 - 1) * scale < 1.
UNIFORM_SCALE = 4.6566127342e-10
_CHUNK = 1 << 14


def _mul_hi_lo(constant: int, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of `constant * value` (both < 2**32) without overflowing int64: split the constant."""
    high_part = (constant >> 16) * value  # < 2**48
    low_part = (constant & 0xFFFF) * value  # < 2**48
    hi = (high_part + (low_part >> 16)) >> 16
    lo = (((high_part & 0xFFFF) << 16) + low_part) & _MASK32
    return hi, lo


def philox_uniform(rng_state: torch.Tensor, numel: int) -> torch.Tensor:
    """`tl.rand(seed, offset + arange(numel))` as fp32 on rng_state's device: Philox 4x32-10 on int64 lanes.

    The key is the seed's two 32-bit halves; the counter is (low, high 32 bits of offset + i, 0, 0),
    as Triton builds it for int64 offsets. Only the first of the four outputs is used. Computed in
    chunks of `_CHUNK` counters, which keeps the dozens of int64 temporaries of a round in cache.
    """
    seed, offset = rng_state[0], rng_state[1]
    key = (seed & _MASK32, (seed >> 32) & _MASK32)
    out = torch.empty(numel, dtype=torch.float32, device=rng_state.device)
    for start in range(0, numel, _CHUNK):
        counter = offset + torch.arange(start, min(start + _CHUNK, numel), dtype=torch.int64, device=out.device)
        out[start:start + _CHUNK] = _philox_chunk(counter, *key)
    return out


def _philox_chunk(counter: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor) -> torch.Tensor:
    c0, c1 = counter & _MASK32, (counter >> 32) & _MASK32
    c2 = c3 = torch.zeros_like(c0)
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    # Triton reads the draw as int32 and folds negatives with `~x`: values 2**31.. map to 2**32 - 1 - x.
    folded = torch.where(c0 >= 2**31, _MASK32 - c0, c0)
    return folded.to(torch.float32) * torch.tensor(UNIFORM_SCALE, dtype=torch.float32, device=folded.device)


def keep_mask(rng_state: torch.Tensor, shape: torch.Size, p: float) -> torch.Tensor:
    """The bool keep mask of a tensor of `shape`: element i is kept when its uniform draw is >= p (in fp32)."""
    threshold = torch.tensor(p, dtype=torch.float32, device=rng_state.device)
    return (philox_uniform(rng_state, math.prod(shape)) >= threshold).view(shape)


def dropout_scale(p: float) -> float:
    """What kept elements are multiplied by: 1 / (1 - p), and 0 for p = 1 (as aten native_dropout)."""
    return 0.0 if p == 1 else 1.0 / (1.0 - p)


def new_rng_state(device: torch.device, train: bool | None) -> torch.Tensor:
    """[seed, offset] for one dropout call: in training a fresh 63-bit seed from the default generator of
    `device` (so `torch.manual_seed` reproduces it) and offset 0, the Philox counter of element 0; in eval
    mode [0, 0], drawing nothing (as native_dropout draws nothing)."""
    state = torch.zeros(2, dtype=torch.int64, device=device)
    if is_training(train):
        state[:1].random_()
    return state


def is_training(train: bool | None) -> bool:
    """native_dropout's `train` may be None, which means training."""
    return train is not False


@register_op("fused_dropout_add_philox", "dropout(x) + residual in one op; the keep mask comes from a recorded "
             "Philox seed/offset (returned as a 2-element int64 tensor), never stored",
             kernels={"cuda": "fleetc.codegen.triton.dropout:run_fused_dropout_add_philox"},
             kernel_sources="fleetc.codegen.triton.dropout:fused_dropout_add_philox_sources", draws_random=True)
def fused_dropout_add_philox(x: torch.Tensor, residual: torch.Tensor, p: float,
                             train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """aten: `out = add.Tensor(residual, where.self(keep, mul.Tensor(x, scale), 0))` with `keep` the Philox
    keep mask (`keep_mask`) of `rng_state = [seed, offset]`, freshly drawn from x's device; scale = 1 / (1 - p).

    Returns (out, rng_state). Eval mode (`train=False`) draws nothing: `add.Tensor(residual, x)`, rng_state [0, 0].
    """
    rng_state = new_rng_state(x.device, train)
    if not is_training(train):
        return residual + x, rng_state
    return residual + philox_dropout_mul(x, rng_state, p, train, dropout_scale(p)), rng_state


@register_op("philox_dropout_mul", "t * keep * scale with the keep mask regenerated from a Philox rng_state "
             "(dropout's gradient, and recompute's replay of the dropped value)",
             kernels={"cuda": "fleetc.codegen.triton.dropout:run_philox_dropout_mul"},
             kernel_sources="fleetc.codegen.triton.dropout:philox_dropout_mul_sources")
def philox_dropout_mul(t: torch.Tensor, rng_state: torch.Tensor, p: float, train: bool | None,
                       scale: float) -> torch.Tensor:
    """aten: `where.self(keep, mul.Tensor(t, scale), 0)` with `keep` regenerated from `rng_state` and p
    (`keep_mask`); `mul.Tensor(t, scale)` in eval mode."""
    scaled = t * torch.tensor(scale, dtype=torch.float32, device=t.device)  # the kernels' fp32 scale argument
    if not is_training(train):
        return scaled
    return torch.where(keep_mask(rng_state, t.shape, p), scaled, torch.zeros((), dtype=t.dtype, device=t.device))
