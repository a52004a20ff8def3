"""C++ kernels of the row-wise aten ops: layer norm, softmax and log-softmax over the last dims, and their backward.

The input is read as M rows of N contiguous values (N = the normalized or softmax dims; a strided input is made
contiguous first); each OpenMP work item is a row. Every row is two or three SIMD passes over its N values,
accumulating in fp32 lanes whatever the tensor dtype (fp32 or bf16):

- layer norm: mean, then the sum of squared deviations (two passes, so a large mean does not cancel the variance),
  rstd = 1 / sqrt(var + eps), then y = (x - mean) * rstd * w + b; the backward computes
  dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w, and accumulates dw and db in one
  row of partial sums per thread, added up after the loop;
- softmax: the max, the sum of exp(x - max), then exp(x - max) / sum; log-softmax writes x - max - log(sum); the
  backwards are y * (dy - sum(dy * y)) and dy - exp(y) * sum(dy).

Results are fp32-close to aten's, not bit-identical: aten sums in another order and uses its own exp/log, ours the
prelude's inline fc_exp and libm's logf once per row (tests/codegen/test_cpu_rows.py states the tolerances).
Softmax over another dim than the last, and `half_to_float`, keep the reference, as do dtypes other than fp32 and
bf16.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from fleetc.codegen.cpu.plan import (
    CpuPlan,
    Unsupported,
    float_array,
    int_array,
    num_threads,
    pointers,
    require_dtypes,
)
from fleetc.codegen.cpu.source import C_TYPES, GRAIN, CppKernel, load, signature, store
from fleetc.ir.program import Op, Var

_SHORT = {"float32": "f32", "bfloat16": "bf16"}


def _pointer(index: int, name: str, dtype: str, const: bool = True) -> str:
    qualifier = "const " if const else ""
    return f"  {qualifier}{C_TYPES[dtype]}* {name} = ({qualifier}{C_TYPES[dtype]}*)data[{index}];"


def _row_loop(body: list[str]) -> list[str]:
    """`body` once per row i of N contiguous values, rows split over the threads."""
    return ["  const int64_t M = meta[0], N = meta[1];",
            f"  #pragma omp parallel for num_threads(nthreads) schedule(static) if(M * N >= {GRAIN})",
            "  for (int64_t i = 0; i < M; ++i) {",
            "    const int64_t o = i * N;",
            *("    " + line for line in body),
            "  }"]


def _simd_sum(expr: str, out: str, prologue: str = "") -> list[str]:
    return [f"float {out} = 0.0f;",
            f"#pragma omp simd reduction(+:{out})",
            f"for (int64_t j = 0; j < N; ++j) {{ {prologue}{out} += {expr}; }}"]


@functools.cache
def layer_norm_kernel(x_dtype: str, w_dtype: str | None, has_bias: bool, stat_dtype: str) -> CppKernel:
    """data = [x, weight, bias, y, mean, rstd]; meta = [M, N]; scalars = [eps]."""
    name = (f"layer_norm_{_SHORT[x_dtype]}{'_w' + _SHORT[w_dtype] if w_dtype else ''}{'_b' * has_bias}"
            f"_s{_SHORT[stat_dtype]}")
    x = load(x_dtype, "x[o + j]")
    value = "(" + x + " - mu) * rs"
    if w_dtype:
        value = f"{value} * {load(w_dtype, 'w[j]')}"
    if has_bias:
        value = f"{value} + {load(w_dtype or x_dtype, 'b[j]')}"
    lines = [signature(name) + " {", _pointer(0, "x", x_dtype),
             _pointer(1, "w", w_dtype or x_dtype), _pointer(2, "b", w_dtype or x_dtype),
             _pointer(3, "y", x_dtype, const=False), _pointer(4, "mean", stat_dtype, const=False),
             _pointer(5, "rstd", stat_dtype, const=False),
             "  const float eps = (float)scalars[0];"]
    body = [*_simd_sum(x, "total"), "const float mu = total / (float)N;",
            *_simd_sum("d * d", "m2", prologue=f"const float d = {x} - mu; "),
            "const float rs = 1.0f / __builtin_sqrtf(m2 / (float)N + eps);",
            f"mean[i] = {store(stat_dtype, 'mu')};", f"rstd[i] = {store(stat_dtype, 'rs')};",
            "#pragma omp simd",
            f"for (int64_t j = 0; j < N; ++j) y[o + j] = {store(x_dtype, value)};"]
    lines += _row_loop(body) + ["}"]
    return CppKernel(name, "\n".join(lines) + "\n")


@functools.cache
def layer_norm_grad_kernel(x_dtype: str, w_dtype: str | None, stat_dtype: str, need_dx: bool) -> CppKernel:
    """data = [dy, x, mean, rstd, weight, dx, dw_partial, db_partial]; meta = [M, N].

    dw_partial / db_partial (fp32, one row of N per thread, zeroed) may be NULL; the caller adds their rows up."""
    name = (f"layer_norm_grad_{_SHORT[x_dtype]}{'_w' + _SHORT[w_dtype] if w_dtype else ''}_s{_SHORT[stat_dtype]}"
            f"{'_dx' * need_dx}")
    dy, x = load(x_dtype, "dy[o + j]"), load(x_dtype, "x[o + j]")
    g = f"{dy} * {load(w_dtype, 'w[j]')}" if w_dtype else dy
    xhat = f"({x} - mu) * rs"
    lines = [signature(name) + " {", _pointer(0, "dy", x_dtype), _pointer(1, "x", x_dtype),
             _pointer(2, "mean", stat_dtype), _pointer(3, "rstd", stat_dtype), _pointer(4, "w", w_dtype or x_dtype),
             _pointer(5, "dx", x_dtype, const=False),
             "  float* dw_partial = (float*)data[6];", "  float* db_partial = (float*)data[7];",
             "  const int64_t M = meta[0], N = meta[1];",
             f"  #pragma omp parallel num_threads(nthreads) if(M * N >= {GRAIN})",
             "  {",
             "    float* dw_row = dw_partial ? dw_partial + omp_get_thread_num() * N : 0;",
             "    float* db_row = db_partial ? db_partial + omp_get_thread_num() * N : 0;",
             "    #pragma omp for schedule(static)",
             "    for (int64_t i = 0; i < M; ++i) {",
             "      const int64_t o = i * N;"]
    body = [f"const float mu = {load(stat_dtype, 'mean[i]')}, rs = {load(stat_dtype, 'rstd[i]')};"]
    if need_dx:
        body += ["float sum_g = 0.0f, sum_gx = 0.0f;",
                 "#pragma omp simd reduction(+:sum_g, sum_gx)",
                 f"for (int64_t j = 0; j < N; ++j) {{ const float g = {g}; sum_g += g; sum_gx += g * {xhat}; }}",
                 "const float a = sum_g / (float)N, c = sum_gx / (float)N;",
                 "#pragma omp simd",
                 f"for (int64_t j = 0; j < N; ++j) dx[o + j] = {store(x_dtype, f'rs * ({g} - a - {xhat} * c)')};"]
    body += ["if (dw_row) {", "  #pragma omp simd",
             f"  for (int64_t j = 0; j < N; ++j) dw_row[j] += {dy} * {xhat};", "}",
             "if (db_row) {", "  #pragma omp simd", f"  for (int64_t j = 0; j < N; ++j) db_row[j] += {dy};", "}"]
    lines += ["      " + line for line in body] + ["    }", "  }", "}"]
    return CppKernel(name, "\n".join(lines) + "\n")


@functools.cache
def softmax_kernel(dtype: str, log: bool) -> CppKernel:
    """data = [x, y]; meta = [M, N]: softmax (or log-softmax) of each row.

    An fp32 softmax writes exp(x - max) into y while summing it, then scales y in place (one exp per value, as
    aten); a bf16 one computes the exp again in the scaling pass rather than round it to bf16 twice."""
    name = f"{'log_' * log}softmax_{_SHORT[dtype]}"
    x = load(dtype, "x[o + j]")
    body = ["float mx = -__builtin_inff();",
            "#pragma omp simd reduction(max:mx)",
            f"for (int64_t j = 0; j < N; ++j) mx = {x} > mx ? {x} : mx;"]
    if log:
        body += [*_simd_sum(f"fc_exp({x} - mx)", "total"), "const float lse = logf(total);", "#pragma omp simd",
                 f"for (int64_t j = 0; j < N; ++j) y[o + j] = {store(dtype, f'{x} - mx - lse')};"]
    elif dtype == "float32":
        body += [*_simd_sum("e", "total", prologue=f"const float e = fc_exp({x} - mx); y[o + j] = e; "),
                 "const float inv = 1.0f / total;", "#pragma omp simd",
                 "for (int64_t j = 0; j < N; ++j) y[o + j] *= inv;"]
    else:
        body += [*_simd_sum(f"fc_exp({x} - mx)", "total"), "const float inv = 1.0f / total;", "#pragma omp simd",
                 f"for (int64_t j = 0; j < N; ++j) y[o + j] = {store(dtype, f'fc_exp({x} - mx) * inv')};"]
    lines = [signature(name) + " {", _pointer(0, "x", dtype), _pointer(1, "y", dtype, const=False),
             *_row_loop(body), "}"]
    return CppKernel(name, "\n".join(lines) + "\n")


@functools.cache
def softmax_grad_kernel(dtype: str, log: bool) -> CppKernel:
    """data = [dy, y, dx]; meta = [M, N]: the gradient of softmax (or log-softmax) from its output y."""
    name = f"{'log_' * log}softmax_grad_{_SHORT[dtype]}"
    dy, y = load(dtype, "dy[o + j]"), load(dtype, "y[o + j]")
    if log:
        body = [*_simd_sum(dy, "total"), "#pragma omp simd",
                f"for (int64_t j = 0; j < N; ++j) dx[o + j] = {store(dtype, f'{dy} - fc_exp({y}) * total')};"]
    else:
        body = [*_simd_sum(f"{dy} * {y}", "total"), "#pragma omp simd",
                f"for (int64_t j = 0; j < N; ++j) dx[o + j] = {store(dtype, f'{y} * ({dy} - total)')};"]
    lines = [signature(name) + " {", _pointer(0, "dy", dtype), _pointer(1, "y", dtype),
             _pointer(2, "dx", dtype, const=False), *_row_loop(body), "}"]
    return CppKernel(name, "\n".join(lines) + "\n")


def _rows(x: Var, row_dims: int) -> list[int]:
    """[M, N]: the rows of `x` when its last `row_dims` dims form one row."""
    if not all(isinstance(d, int) for d in x.shape):
        raise Unsupported(f"{x.name} has a symbolic shape")
    if row_dims < 1 or row_dims > len(x.shape):
        raise Unsupported(f"{row_dims} row dims of a {len(x.shape)}-D input")
    n = math.prod(x.shape[len(x.shape) - row_dims:])
    return [math.prod(x.shape) // n if n else 0, n]


def layer_norm_stat_dtype(x: Var, weight: Var | None) -> str:
    """The dtype of aten's mean and rstd on CPU: fp32 when a bf16 input meets fp32 parameters, else the input's."""
    if weight is not None and weight.dtype != x.dtype:
        if (x.dtype, weight.dtype) != ("bfloat16", "float32"):
            raise Unsupported(f"layer norm of a {x.dtype} input with {weight.dtype} parameters")
        return "float32"
    return x.dtype


def _last_dim(x: Var, dim: int) -> None:
    if dim not in (-1, len(x.shape) - 1):
        raise Unsupported(f"softmax over dim {dim}, not the last: the reference handles it")


def plan_layer_norm(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`aten.native_layer_norm`: statistics and the affine normalization in one kernel per row."""
    x, weight, bias = inputs[0], inputs[2], inputs[3]
    normalized_shape = op.args[1]
    require_dtypes("layer norm input", [x.dtype])
    require_dtypes("layer norm weight and bias", [v.dtype for v in (weight, bias) if v is not None])
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise Unsupported("layer norm weight and bias of different dtypes")
    if weight is None and bias is not None:
        raise Unsupported("a layer norm bias without a weight")
    sizes = _rows(x, len(normalized_shape))
    stat_dtype = layer_norm_stat_dtype(x, weight)
    kernel = layer_norm_kernel(x.dtype, weight.dtype if weight is not None else None, bias is not None, stat_dtype)
    meta = int_array(sizes)
    stats_dtype = getattr(torch, stat_dtype)

    def bind(functions: list[Any]) -> Callable[..., Any]:
        function = functions[0]

        def run(x, normalized_shape, weight=None, bias=None, eps=1e-5):
            x = x.contiguous()
            y = torch.empty_like(x)
            stat_shape = list(x.shape[:x.dim() - len(normalized_shape)]) + [1] * len(normalized_shape)
            mean = torch.empty(stat_shape, dtype=stats_dtype)
            rstd = torch.empty(stat_shape, dtype=stats_dtype)
            function(pointers([x, weight, bias, y, mean, rstd]), meta, float_array([eps]), num_threads())
            return y, mean, rstd

        return run

    return CpuPlan((kernel,), bind)


def plan_layer_norm_backward(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`aten.native_layer_norm_backward`: dx in two passes per row, dw and db from per-thread partial rows."""
    dy, x, mean, weight = inputs[0], inputs[1], inputs[3], inputs[5]
    normalized_shape, output_mask = op.args[2], op.args[7]
    require_dtypes("layer norm gradient", [dy.dtype, x.dtype])
    if dy.dtype != x.dtype:
        raise Unsupported("layer norm gradient and input of different dtypes")
    require_dtypes("layer norm statistics", [mean.dtype])
    if weight is not None:
        require_dtypes("layer norm weight", [weight.dtype])
    sizes = _rows(x, len(normalized_shape))
    planned_dx = bool(output_mask[0])
    kernel = layer_norm_grad_kernel(x.dtype, weight.dtype if weight is not None else None, mean.dtype, planned_dx)
    meta = int_array(sizes)

    def bind(functions: list[Any]) -> Callable[..., Any]:
        function = functions[0]

        def run(dy, x, normalized_shape, mean, rstd, weight, bias, output_mask):
            dy, x, mean, rstd = dy.contiguous(), x.contiguous(), mean.contiguous(), rstd.contiguous()
            need_dx, need_dw, need_db = output_mask
            threads = num_threads()
            n = sizes[1]
            dx = torch.empty_like(x) if planned_dx else None  # the kernel writes dx when planned to
            dw_partial = torch.zeros(threads, n) if need_dw and weight is not None else None
            db_partial = torch.zeros(threads, n) if need_db and bias is not None else None
            function(pointers([dy, x, mean, rstd, weight, dx, dw_partial, db_partial]), meta, float_array([]),
                     threads)
            dw = dw_partial.sum(0).view(weight.shape).to(weight.dtype) if dw_partial is not None else None
            db = db_partial.sum(0).view(bias.shape).to(bias.dtype) if db_partial is not None else None
            return dx if need_dx else None, dw, db

        return run

    return CpuPlan((kernel,), bind)


def _plan_softmax(op: Op, inputs: list[Var | None], log: bool) -> CpuPlan:
    x, dim, half_to_float = inputs[0], op.args[1], op.args[2]
    if half_to_float:
        raise Unsupported("half_to_float softmax: the reference handles it")
    require_dtypes("softmax input", [x.dtype])
    _last_dim(x, dim)
    kernel = softmax_kernel(x.dtype, log)
    meta = int_array(_rows(x, 1))

    def bind(functions: list[Any]) -> Callable[..., Any]:
        function = functions[0]

        def run(x, dim, half_to_float):
            x = x.contiguous()
            y = torch.empty_like(x)
            function(pointers([x, y]), meta, float_array([]), num_threads())
            return y

        return run

    return CpuPlan((kernel,), bind)


def _plan_softmax_grad(op: Op, inputs: list[Var | None], log: bool) -> CpuPlan:
    dy, y, dim, input_dtype = inputs[0], inputs[1], op.args[2], op.args[3]
    require_dtypes("softmax gradient", [dy.dtype])
    if y.dtype != dy.dtype or str(input_dtype).removeprefix("torch.") != dy.dtype:
        raise Unsupported("softmax gradient, output and input of different dtypes")
    _last_dim(y, dim)
    kernel = softmax_grad_kernel(dy.dtype, log)
    meta = int_array(_rows(y, 1))

    def bind(functions: list[Any]) -> Callable[..., Any]:
        function = functions[0]

        def run(dy, y, dim, input_dtype):
            dy, y = dy.contiguous(), y.contiguous()
            dx = torch.empty_like(y)
            function(pointers([dy, y, dx]), meta, float_array([]), num_threads())
            return dx

        return run

    return CpuPlan((kernel,), bind)


def plan_softmax(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`aten._softmax` over the last dim."""
    return _plan_softmax(op, inputs, log=False)


def plan_log_softmax(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`aten._log_softmax` over the last dim."""
    return _plan_softmax(op, inputs, log=True)


def plan_softmax_backward(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`aten._softmax_backward_data` over the last dim."""
    return _plan_softmax_grad(op, inputs, log=False)


def plan_log_softmax_backward(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`aten._log_softmax_backward_data` over the last dim."""
    return _plan_softmax_grad(op, inputs, log=True)
