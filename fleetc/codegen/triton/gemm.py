"""Triton kernels of the gemm epilogue ops: tiled `tl.dot` matmuls with bias, activation and its grad fused in.

Forward (`fused_gemm_bias_<act>`): one program per (BLOCK_M × BLOCK_N) tile of `x @ w_t`, looping over K;
the bias add and the activation run on the fp32 accumulator before the tile is stored; the pre-activation
`h` is stored too only when the op keeps it for the backward (`..._keep_pre_act`). Backward: the activation
grad is computed from `dout` (and the saved `h` or `out`) as each tile of `g` is loaded, so `g` is never
written to memory; `..._grad_dx` computes `g @ w_t.T` and `..._grad_dw_dbias` computes `g.T @ x` while
summing the same tiles of `g` over M for dBias (the programs of the first K block store it), so dBias costs
no extra read.

Operands are read through their strides (`w_t` is usually the transposed view of a weight); sizes,
strides and block sizes are `tl.constexpr` arguments, as in the elementwise kernels, so binaries are
specialised per shape. Products accumulate in fp32; fp32 inputs multiply in IEEE fp32 unless
`torch.backends.cuda.matmul.allow_tf32` asks for TF32, as torch's own matmuls do. Under
TRITON_INTERPRET the dot operands are upcast to fp32 first: the interpreter (triton 3.9) multiplies
bf16 operands as their raw 16-bit patterns, and products of bf16 or fp16 values are exact in fp32,
so the upcast leaves the result unchanged.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from fleetc.codegen.triton.kernel import KernelSource
from fleetc.codegen.triton.launch import Launcher, interpreting, load_kernel, next_pow2
from fleetc.ir.program import Op, Var
from fleetc.ops import fused_gemm
from fleetc.ops.activations import ACTIVATIONS
from fleetc.ops.pointwise import activation_expression, activation_grad_expression

OUTPUT_TILE_MAX = 64  # rows and columns of a program's output tile
DEPTH_TILE_MAX = 32  # elements of the summed dimension loaded per loop iteration

_HEADER = '''import triton
import triton.language as tl


@triton.jit
def _dot(a, b, DOT_IN_FP32: tl.constexpr, PRECISION: tl.constexpr):
    if DOT_IN_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


'''
# Combines dBias's column sums (jitted in the kernel's own module: see lowering.py for why not tl.sum).
_ADD = '''@triton.jit
def _add(a, b):
    return a + b


'''


def _base_name(act: str | None, param: Any) -> str:
    name = "fused_gemm_bias" + (f"_{act}" if act else "")
    return name + "_tanh" if act == "gelu" and param == "tanh" else name


def _source(name: str, params: list[str], body: list[str], sums: bool = False) -> KernelSource:
    source = _HEADER + (_ADD if sums else "") + "@triton.jit\n" + f"def {name}({', '.join(params)}):\n"
    source += "".join(f"    {line}\n" for line in body)
    return KernelSource(name, source, rank=2, reduce_dims=None)  # rank/reduce_dims: elementwise launches only


_TILE_PARAMS = ["DOT_IN_FP32: tl.constexpr", "PRECISION: tl.constexpr",
                "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_K: tl.constexpr"]


def _constexprs(*names: str) -> list[str]:
    return [f"{n}: tl.constexpr" for n in names]


def _stores_pre_act(act: str | None, keep_pre_act: bool) -> bool:
    """Whether the forward kernel writes `h` besides `out` (without an act, `h` is `out`)."""
    return bool(act) and keep_pre_act


@functools.lru_cache(maxsize=None)
def forward_kernel(act: str | None, param: Any, keep_pre_act: bool) -> KernelSource:
    """`x[M,K] @ w_t[K,N] + bias`, then `act`: stores `out` (and `h`, the pre-activation, when it is kept)."""
    store_h = _stores_pre_act(act, keep_pre_act)
    outputs = ["out", "h_out"] if store_h else ["out"]
    params = ["x", "w_t", "bias", *outputs, *_constexprs("M", "N", "K", "X_S0", "X_S1", "W_S0", "W_S1", "BIAS_S0")]
    body = ["rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]",
            "cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]",
            "acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)",
            "for start in range(0, K, BLOCK_K):",
            "    ks = start + tl.arange(0, BLOCK_K)",
            "    a = tl.load(x + rows * X_S0 + ks[None, :] * X_S1, mask=(rows < M) & (ks[None, :] < K), other=0.0)",
            "    b = tl.load(w_t + ks[:, None] * W_S0 + cols * W_S1, mask=(ks[:, None] < K) & (cols < N), other=0.0)",
            "    acc += _dot(a, b, DOT_IN_FP32, PRECISION)",
            "h = acc + tl.load(bias + cols * BIAS_S0, mask=cols < N, other=0.0).to(tl.float32)",
            "mask = (rows < M) & (cols < N)"]
    if store_h:
        body.append("tl.store(h_out + rows * N + cols, h.to(h_out.dtype.element_ty), mask=mask)")
    result = activation_expression(act, param, "h") if act else "h"
    body.append(f"tl.store(out + rows * N + cols, {result}.to(out.dtype.element_ty), mask=mask)")
    return _source(_base_name(act, param) + ("_keep_pre_act" if store_h else ""), params + _TILE_PARAMS, body)


def _reads_saved(act: str | None) -> bool:
    """Whether the activation's grad reads a saved forward value (`h` or `out`)."""
    return act is not None and ACTIVATIONS[act].saves is not None


def _grad_inputs(act: str | None) -> list[str]:
    return ["dout", "saved"] if _reads_saved(act) else ["dout"]


def _grad_strides(act: str | None) -> list[str]:
    return ["DOUT_S0", "DOUT_S1"] + (["SAVED_S0", "SAVED_S1"] if _reads_saved(act) else [])


def _load_g(act: str | None, param: Any, rows: str, cols: str) -> list[str]:
    """Lines loading the [rows × cols] tile of `g` = act grad of `dout` (zero outside the matrix, so it adds
    nothing to dots or sums)."""
    lines = [f"g_mask = ({rows} < M) & ({cols} < N)",
             f"g = tl.load(dout + {rows} * DOUT_S0 + {cols} * DOUT_S1, mask=g_mask, other=0.0).to(tl.float32)"]
    if _reads_saved(act):
        lines.append(f"s = tl.load(saved + {rows} * SAVED_S0 + {cols} * SAVED_S1, mask=g_mask, other=0.0)"
                     ".to(tl.float32)")
    if act:
        lines.append(f"g = tl.where(g_mask, {activation_grad_expression(act, param, 'g', 's')}, 0.0)")
    return lines


@functools.lru_cache(maxsize=None)
def grad_dx_kernel(act: str | None, param: Any) -> KernelSource:
    """dX[M,K] = g[M,N] @ w_t[K,N].T, with `g` the act grad of `dout` computed on load."""
    params = [*_grad_inputs(act), "w_t", "dx", *_constexprs("M", "N", "K", *_grad_strides(act), "W_S0", "W_S1")]
    body = ["rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)",
            "ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)",
            "acc = tl.full([BLOCK_M, BLOCK_K], 0.0, tl.float32)",
            "for start in range(0, N, BLOCK_N):",
            "    ns = start + tl.arange(0, BLOCK_N)",
            *("    " + line for line in _load_g(act, param, "rows[:, None]", "ns[None, :]")),
            "    w = tl.load(w_t + ks[None, :] * W_S0 + ns[:, None] * W_S1, "
            "mask=(ks[None, :] < K) & (ns[:, None] < N), other=0.0)",
            "    acc += _dot(g.to(w_t.dtype.element_ty), w, DOT_IN_FP32, PRECISION)",
            "tl.store(dx + rows[:, None] * K + ks[None, :], acc.to(dx.dtype.element_ty), "
            "mask=(rows[:, None] < M) & (ks[None, :] < K))"]
    return _source(_base_name(act, param) + "_grad_dx", params + _TILE_PARAMS, body)


@functools.lru_cache(maxsize=None)
def grad_dw_dbias_kernel(act: str | None, param: Any, need_dw: bool, need_db: bool) -> KernelSource:
    """dW[N,K] = g.T @ x and/or dBias[N] = column sums of g, from one pass over the tiles of `g`."""
    outputs = (["dw"] if need_dw else []) + (["db"] if need_db else [])
    params = [*_grad_inputs(act), *(["x"] if need_dw else []), *outputs,
              *_constexprs("M", "N", "K", *_grad_strides(act), "X_S0", "X_S1")]
    body = ["ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)"]
    if need_dw:
        body += ["ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)",
                 "acc = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)"]
    if need_db:
        body.append("col_sums = tl.full([BLOCK_N], 0.0, tl.float32)")
    body += ["for start in range(0, M, BLOCK_M):",
             "    ms = start + tl.arange(0, BLOCK_M)",
             *("    " + line for line in _load_g(act, param, "ms[:, None]", "ns[None, :]"))]
    if need_dw:
        body += ["    xs = tl.load(x + ms[:, None] * X_S0 + ks[None, :] * X_S1, "
                 "mask=(ms[:, None] < M) & (ks[None, :] < K), other=0.0)",
                 "    acc += _dot(tl.trans(g.to(x.dtype.element_ty)), xs, DOT_IN_FP32, PRECISION)"]
    if need_db:
        body.append("    col_sums += tl.reduce(g, 0, _add)")
    if need_dw:
        body.append("tl.store(dw + ns[:, None] * K + ks[None, :], acc.to(dw.dtype.element_ty), "
                    "mask=(ns[:, None] < N) & (ks[None, :] < K))")
    if need_db:
        body += ["if tl.program_id(1) == 0:  # every K block summed the same g; the first stores it",
                 "    tl.store(db + ns, col_sums.to(db.dtype.element_ty), mask=ns < N)"]
    suffix = "_grad_" + "_".join((["dw"] if need_dw else []) + (["dbias"] if need_db else []))
    return _source(_base_name(act, param) + suffix, params + _TILE_PARAMS, body, sums=need_db)


def block_sizes(rows: tuple[str, int], cols: tuple[str, int], depth: tuple[str, int]) -> dict[str, int]:
    """The tile heuristic: (dim name, extent) of a program's output rows and columns and of the summed dim;
    powers of two covering small extents, capped for large ones, and at least 16 (tl.dot's smallest tile)."""
    def tile(extent: int, cap: int) -> int:
        return min(cap, max(16, next_pow2(extent)))

    return {f"BLOCK_{rows[0]}": tile(rows[1], OUTPUT_TILE_MAX), f"BLOCK_{cols[0]}": tile(cols[1], OUTPUT_TILE_MAX),
            f"BLOCK_{depth[0]}": tile(depth[1], DEPTH_TILE_MAX)}


def _cdiv(a: int, b: int) -> int:
    return max(1, -(-a // b))


def _dot_settings() -> dict[str, Any]:
    return {"DOT_IN_FP32": interpreting(),
            "PRECISION": "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"}


def _metas(tensors: tuple) -> tuple:
    return tuple(None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                 for t in tensors)


def _output_specs(produced: tuple) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(p.shape), p.dtype) for p in produced if p is not None]


def forward_launcher(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor, out_shape: list | None,
                     act: str | None, param: Any, keep_pre_act: bool) -> Launcher:
    """The forward kernel bound to operands like these (meta tensors will do); outputs as the reference's."""
    (m, k), n = x.shape, w_t.shape[1]
    out, h = fused_gemm.fused_gemm_epilogue(*_metas((x, w_t, bias)), out_shape, act, param, keep_pre_act)
    sizes = block_sizes(("M", m), ("N", n), ("K", k))
    constexprs = {"M": m, "N": n, "K": k, "X_S0": x.stride(0), "X_S1": x.stride(1), "W_S0": w_t.stride(0),
                  "W_S1": w_t.stride(1), "BIAS_S0": bias.stride(0), **_dot_settings(), **sizes}
    grid = (_cdiv(m, sizes["BLOCK_M"]), _cdiv(n, sizes["BLOCK_N"]))
    store_h = _stores_pre_act(act, keep_pre_act)
    return Launcher(load_kernel(forward_kernel(act, param, keep_pre_act)), grid, constexprs,
                    _output_specs((out, h) if store_h else (out,)))


def _grad_strides_values(g_inputs: tuple[torch.Tensor, ...]) -> dict[str, int]:
    values = {"DOUT_S0": g_inputs[0].stride(0), "DOUT_S1": g_inputs[0].stride(1)}
    if len(g_inputs) == 2:
        values |= {"SAVED_S0": g_inputs[1].stride(0), "SAVED_S1": g_inputs[1].stride(1)}
    return values


def grad_launchers(g_inputs: tuple[torch.Tensor, ...], x: torch.Tensor, w_t: torch.Tensor, act: str | None,
                   param: Any, output_mask: tuple[bool, bool, bool]) -> tuple[Launcher | None, Launcher | None]:
    """(dX launcher, dW/dBias launcher), None where `output_mask` needs neither; `g_inputs` is `dout` (and the
    saved tensor) as [M, N] matrices."""
    need_dx, need_dw, need_db = output_mask
    (m, k), n = x.shape, w_t.shape[1]
    dout, saved = g_inputs[0], g_inputs[1] if len(g_inputs) == 2 else None
    dx, dw, db = fused_gemm.fused_gemm_epilogue_grad(*_metas((dout, saved, x, w_t)), act, param, list(output_mask))
    shared = {"M": m, "N": n, "K": k, **_grad_strides_values(g_inputs), **_dot_settings()}
    dx_launcher = dw_launcher = None
    if need_dx:
        sizes = block_sizes(("M", m), ("K", k), ("N", n))
        dx_launcher = Launcher(load_kernel(grad_dx_kernel(act, param)),
                               (_cdiv(m, sizes["BLOCK_M"]), _cdiv(k, sizes["BLOCK_K"])),
                               {**shared, "W_S0": w_t.stride(0), "W_S1": w_t.stride(1), **sizes},
                               _output_specs((dx,)))
    if need_dw or need_db:
        sizes = block_sizes(("N", n), ("K", k), ("M", m))
        k_blocks = _cdiv(k, sizes["BLOCK_K"]) if need_dw else 1  # dBias alone: one program per column block
        dw_launcher = Launcher(load_kernel(grad_dw_dbias_kernel(act, param, need_dw, need_db)),
                               (_cdiv(n, sizes["BLOCK_N"]), k_blocks),
                               {**shared, "X_S0": x.stride(0), "X_S1": x.stride(1), **sizes},
                               _output_specs((dw, db)))
    return dx_launcher, dw_launcher


_LAUNCHERS: dict[tuple, Any] = {}


def _signature(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors)


def _cached(key: tuple, build: Callable[[], Any]) -> Any:
    key = (*key, interpreting(), torch.backends.cuda.matmul.allow_tf32)
    if key not in _LAUNCHERS:
        _LAUNCHERS[key] = build()
    return _LAUNCHERS[key]


def fused_gemm_epilogue(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor, out_shape: list | None,
                        act: str | None, param: Any, keep_pre_act: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fleetc.fused_gemm_epilogue` on CUDA tensors (any tensors under TRITON_INTERPRET=1): returns (out, h),
    h None unless `keep_pre_act`."""
    shape = tuple(out_shape) if out_shape is not None else None
    launcher = _cached(("forward", act, param, keep_pre_act, shape, _signature(x, w_t, bias)),
                       lambda: forward_launcher(x, w_t, bias, out_shape, act, param, keep_pre_act))
    produced = launcher((x, w_t, bias))
    if _stores_pre_act(act, keep_pre_act):
        return produced
    return produced, (produced if keep_pre_act else None)  # without an act, the kept pre-activation is `out`


def fused_gemm_epilogue_grad(dout: torch.Tensor, saved: torch.Tensor | None, x: torch.Tensor, w_t: torch.Tensor,
                             act: str | None, param: Any, output_mask: list) -> tuple[torch.Tensor | None, ...]:
    """`fleetc.fused_gemm_epilogue_grad` on CUDA tensors (any tensors under TRITON_INTERPRET=1): (dx, dw, db)."""
    mask = tuple(bool(b) for b in output_mask)
    if not any(mask):
        return None, None, None
    n = w_t.shape[1]
    # leading batch dims flatten into M; reshape copies only when they cannot be viewed as one
    g_inputs = (dout.reshape(-1, n),) + ((saved.reshape(-1, n),) if _reads_saved(act) else ())
    dx_launcher, dw_launcher = _cached(("grad", act, param, mask, _signature(*g_inputs, x, w_t)),
                                       lambda: grad_launchers(g_inputs, x, w_t, act, param, mask))
    dx = dx_launcher(g_inputs + (w_t,)) if dx_launcher else None
    dw_db = dw_launcher(g_inputs + ((x,) if mask[1] else ())) if dw_launcher else ()
    dw_db = dw_db if isinstance(dw_db, tuple) else (dw_db,)
    dw = dw_db[0] if mask[1] else None
    db = dw_db[-1] if mask[2] else None
    return dx, dw, db


def fused_gemm_epilogue_sources(op: Op, inputs: list[Var | None]) -> list[KernelSource]:
    """The forward kernel of a `fleetc.fused_gemm_epilogue` op (for `dump-ir --kernels`)."""
    _, _, _, _, act, param, keep_pre_act = op.args
    return [forward_kernel(act, param, keep_pre_act)]


def fused_gemm_epilogue_grad_sources(op: Op, inputs: list[Var | None]) -> list[KernelSource]:
    """The kernels a `fleetc.fused_gemm_epilogue_grad` op launches, per its output_mask."""
    _, _, _, _, act, param, (need_dx, need_dw, need_db) = op.args
    kernels = [grad_dx_kernel(act, param)] if need_dx else []
    if need_dw or need_db:
        kernels.append(grad_dw_dbias_kernel(act, param, bool(need_dw), bool(need_db)))
    return kernels
