"""C++ kernels of the batch-norm fusion ops (`fused_bn_act`, `fused_bn_add_act`, `fused_bn_act_grad`).

Inputs are (N, C, *spatial) with channels in dim 1, read contiguous (a strided input is made contiguous
first); each OpenMP work item is one channel, whose elements are N runs of S = prod(spatial) contiguous values.

- forward, training: mean, then the sum of squared deviations (two passes, so a large mean does not cancel the
  variance; each run sums in fp32 SIMD lanes, runs add up in double), rstd = 1 / sqrt(var + eps), the running
  statistics updated in place (momentum, unbiased variance), then one pass writes the normalized value `bn`
  (rounded to the input dtype, as aten stores it), `pre` = bn + residual and `out` = act(pre);
- forward, eval: the running statistics, one pass;
- backward: one pass computes `dpre` = act grad of dout (stored: it is the residual's gradient) and the
  per-channel sums of dpre and dpre * (x - mean) (dbias, dweight), a second pass writes dx as aten's
  native_batch_norm_backward does.

A channels_last input (the op marked `attrs["memory_format"] = "channels_last"` by the layout pass,
fleetc/passes/layout/channels_last.py) has its own kernels, so it is not copied back to NCHW: the input is M = N *
prod(spatial) rows of C contiguous channel values. Rows are split evenly over the threads; each thread sums its rows
into its own row of a float64 scratch (one value per channel), and the threads' rows are added in thread order, so
the result depends on the thread count only. The same passes as above, with the channel loop innermost (SIMD):
mean, squared deviations, normalize (forward); act grad with the two sums, dx (backward). Outputs are channels_last.

Activations are the shared lowering's C expressions (fleetc/ops/pointwise.py). Statistics are fp32-close to
aten's, not bit-identical (aten accumulates in another order); fp32 and bf16 inputs, fp32 weights and stats.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from fleetc.codegen.cpu.plan import CpuPlan, Unsupported, float_array, int_array, num_threads, pointers, \
    require_dtypes
from fleetc.codegen.cpu.source import CppKernel, load, round_to, signature, store
from fleetc.ir.program import Op, Var
from fleetc.ops.activations import ACTIVATIONS
from fleetc.ops.pointwise import C, activation_expression, activation_grad_expression

_C_TYPE = {"float32": "float", "bfloat16": "uint16_t"}


def _act_tag(act: str, param: Any) -> str:
    return f"{act}_tanh" if act == "gelu" and param == "tanh" else act


def _channel_loop(body: list[str]) -> list[str]:
    """`body` once per channel c, with `row(n)` the offset of the channel's n-th run of S values."""
    return ["  const int64_t N = meta[0], C = meta[1], S = meta[2];",
            "  const double R = (double)(N * S);",
            "  #pragma omp parallel for num_threads(nthreads) schedule(static) if(N * C * S >= 32768)",
            "  for (int64_t c = 0; c < C; ++c) {",
            *("    " + line for line in body),
            "  }"]


def _run_sum(expr: str, out: str, indent: str = "") -> list[str]:
    """Lines summing `expr` (over s in [0, S) of run n) into the double `out`, run by run."""
    return [f"{indent}for (int64_t n = 0; n < N; ++n) {{",
            f"{indent}  const int64_t o = (n * C + c) * S;",
            f"{indent}  float part = 0.0f;",
            f"{indent}  #pragma omp simd reduction(+:part)",
            f"{indent}  for (int64_t s = 0; s < S; ++s) part += {expr};",
            f"{indent}  {out} += part;",
            f"{indent}}}"]


def _forward_pointers(t: str) -> list[str]:
    """The forward kernels' first ten data pointers (NCHW and NHWC alike), element type `t`."""
    return [f"  const {t}* x = (const {t}*)data[0];",
            f"  const {t}* res = (const {t}*)data[1];",
            "  const float* weight = (const float*)data[2];",
            "  const float* bias = (const float*)data[3];",
            "  float* running_mean = (float*)data[4];",
            "  float* running_var = (float*)data[5];",
            f"  {t}* out = ({t}*)data[6];",
            f"  {t}* pre = ({t}*)data[7];",
            "  float* mean_out = (float*)data[8];",
            "  float* rstd_out = (float*)data[9];"]


def _grad_pointers(t: str) -> list[str]:
    """The backward kernels' first twelve data pointers (NCHW and NHWC alike), element type `t`."""
    return [f"  const {t}* dout = (const {t}*)data[0];",
            f"  const {t}* saved = (const {t}*)data[1];",
            f"  const {t}* x = (const {t}*)data[2];",
            "  const float* weight = (const float*)data[3];",
            "  const float* running_mean = (const float*)data[4];",
            "  const float* running_var = (const float*)data[5];",
            "  const float* save_mean = (const float*)data[6];",
            "  const float* save_rstd = (const float*)data[7];",
            f"  {t}* dx = ({t}*)data[8];",
            "  float* dweight = (float*)data[9];",
            "  float* dbias = (float*)data[10];",
            f"  {t}* dpre = ({t}*)data[11];"]


@functools.lru_cache(maxsize=None)
def forward_kernel(dtype: str, training: bool, residual: bool, act: str, param: Any) -> CppKernel:
    """data = [x, residual, weight, bias, running_mean, running_var, out, pre, mean, rstd]; scalars = [momentum, eps]."""
    t = _C_TYPE[dtype]
    name = f"fused_bn{'_add' * residual}_{_act_tag(act, param)}_{'train' if training else 'eval'}_{dtype}"
    x = load(dtype, "x[o + s]")
    lines = [signature(name) + " {",
             *_forward_pointers(t),
             "  const double momentum = scalars[0], eps = scalars[1];"]
    if training:
        stats = ["double total = 0.0, m2 = 0.0;", *_run_sum(x, "total"),
                 "const float mean = (float)(total / R);",
                 *_run_sum(f"({x} - mean) * ({x} - mean)", "m2"),
                 "const float rstd = (float)(1.0 / __builtin_sqrt(m2 / R + eps));",
                 "mean_out[c] = mean;", "rstd_out[c] = rstd;",
                 "running_mean[c] = (float)(momentum * mean + (1.0 - momentum) * running_mean[c]);",
                 "running_var[c] = (float)(momentum * (m2 / (R - 1.0)) + (1.0 - momentum) * running_var[c]);"]
    else:
        stats = ["const float mean = running_mean[c];",
                 "const float rstd = (float)(1.0 / __builtin_sqrt((double)running_var[c] + eps));"]
    normalize = ["const float scale = weight ? rstd * weight[c] : rstd;",
                 "const float shift = bias ? bias[c] : 0.0f;",
                 "for (int64_t n = 0; n < N; ++n) {",
                 "  const int64_t o = (n * C + c) * S;",
                 "  #pragma omp simd",
                 "  for (int64_t s = 0; s < S; ++s) {",
                 f"    float y = {round_to(dtype, f'({x} - mean) * scale + shift')};"]
    if residual:
        normalize.append(f"    y = {round_to(dtype, 'y + ' + load(dtype, 'res[o + s]'))};")
    normalize += [f"    pre[o + s] = {store(dtype, 'y')};",
                  f"    out[o + s] = {store(dtype, activation_expression(act, param, 'y', C))};",
                  "  }", "}"]
    lines += _channel_loop(stats + normalize) + ["}"]
    return CppKernel(name, "\n".join(lines) + "\n")


@functools.lru_cache(maxsize=None)
def grad_kernel(dtype: str, training: bool, act: str, param: Any, need_dx: bool) -> CppKernel:
    """data = [dout, saved, x, weight, running_mean, running_var, save_mean, save_rstd, dx, dweight, dbias, dpre];
    scalars = [eps]. dweight/dbias may be NULL."""
    t = _C_TYPE[dtype]
    name = f"fused_bn_{_act_tag(act, param)}_grad_{'train' if training else 'eval'}{'_dx' * need_dx}_{dtype}"
    x = load(dtype, "x[o + s]")
    dy = activation_grad_expression(act, param, load(dtype, "dout[o + s]"), load(dtype, "saved[o + s]"), C)
    lines = [signature(name) + " {",
             *_grad_pointers(t),
             "  const double eps = scalars[0];"]
    if training:
        stats = ["const float mean = save_mean[c], rstd = save_rstd[c];"]
    else:
        stats = ["const float mean = running_mean[c];",
                 "const float rstd = (float)(1.0 / __builtin_sqrt((double)running_var[c] + eps));"]
    body = stats + ["double sum_dy = 0.0, dot = 0.0;",
                    "for (int64_t n = 0; n < N; ++n) {",
                    "  const int64_t o = (n * C + c) * S;",
                    "  float part_dy = 0.0f, part_dot = 0.0f;",
                    "  #pragma omp simd reduction(+:part_dy, part_dot)",
                    "  for (int64_t s = 0; s < S; ++s) {",
                    f"    const float g = {round_to(dtype, dy)};",
                    f"    dpre[o + s] = {store(dtype, 'g')};",
                    "    part_dy += g;",
                    f"    part_dot += g * ({x} - mean);",
                    "  }",
                    "  sum_dy += part_dy;", "  dot += part_dot;",
                    "}",
                    "if (dweight) dweight[c] = (float)(dot * rstd);",
                    "if (dbias) dbias[c] = (float)sum_dy;"]
    if need_dx:
        body += ["const float w_rstd = weight ? rstd * weight[c] : rstd;"]
        if training:
            body += ["const float grad_mean = (float)(sum_dy / R);",
                     "const float proj = (float)(dot / R) * rstd * rstd;"]
            dx = f"({load(dtype, 'dpre[o + s]')} - grad_mean - ({x} - mean) * proj) * w_rstd"
        else:
            dx = f"{load(dtype, 'dpre[o + s]')} * w_rstd"
        body += ["for (int64_t n = 0; n < N; ++n) {",
                 "  const int64_t o = (n * C + c) * S;",
                 "  #pragma omp simd",
                 f"  for (int64_t s = 0; s < S; ++s) dx[o + s] = {store(dtype, dx)};",
                 "}"]
    lines += _channel_loop(body) + ["}"]
    return CppKernel(name, "\n".join(lines) + "\n")


CHANNELS_LAST = "channels_last"  # the value of op.attrs["memory_format"] that selects the NHWC kernels


def _nhwc_rows(body: list[str]) -> list[str]:
    """`body` once per row r (its C channel values start at `o`), rows split evenly over the threads; `acc` is the
    thread's row of the float64 scratch `part` (W values)."""
    return ["#pragma omp parallel num_threads(T)",
            "{",
            "  const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();",
            "  double* acc = part + t * W;",
            "  for (int64_t r = M * t / nt; r < M * (t + 1) / nt; ++r) {",
            "    const int64_t o = r * C;",
            "    #pragma omp simd",
            "    for (int64_t c = 0; c < C; ++c) {",
            *("      " + line for line in body),
            "    }",
            "  }",
            "}"]


def _nhwc_sums(body: list[str]) -> list[str]:
    """Zero the scratch, then accumulate `body` into it over all rows (the totals: `_nhwc_total(i)`)."""
    return ["for (int64_t i = 0; i < nthreads * W; ++i) part[i] = 0.0;", *_nhwc_rows(body)]


def _nhwc_total(index: str) -> str:
    return f"fc_total(part, nthreads, W, {index})"


_NHWC_HEAD = ["  const int64_t M = meta[0], C = meta[1];",
              "  const double R = (double)M;",
              "  const int T = M * C >= 32768 ? (int)nthreads : 1;"]

# Sums scratch column i over the threads' rows in thread order (deterministic for a given thread count).
_NHWC_TOTAL = """static inline double fc_total(const double* part, int64_t nthreads, int64_t W, int64_t i) {
  double s = 0.0;
  for (int64_t t = 0; t < nthreads; ++t) s += part[t * W + i];
  return s;
}
"""


@functools.lru_cache(maxsize=None)
def forward_kernel_nhwc(dtype: str, training: bool, residual: bool, act: str, param: Any) -> CppKernel:
    """As `forward_kernel` on channels_last tensors; data adds [part (nthreads * C float64), coef (3 * C float32)]."""
    t = _C_TYPE[dtype]
    name = f"fused_bn{'_add' * residual}_{_act_tag(act, param)}_{'train' if training else 'eval'}_nhwc_{dtype}"
    x = load(dtype, "x[o + c]")
    lines = [signature(name) + " {",
             *_forward_pointers(t),
             "  double* part = (double*)data[10];",
             *_NHWC_HEAD,
             "  float* mean = (float*)data[11];",
             "  float* scale = mean + C;",
             "  float* shift = mean + 2 * C;",
             "  const int64_t W = C;",
             "  const double momentum = scalars[0], eps = scalars[1];"]
    if training:
        body = [*_nhwc_sums([f"acc[c] += (double){x};"]),
                f"for (int64_t c = 0; c < C; ++c) mean[c] = (float)({_nhwc_total('c')} / R);",
                *_nhwc_sums([f"const float d = {x} - mean[c];", "acc[c] += (double)(d * d);"]),
                "for (int64_t c = 0; c < C; ++c) {",
                f"  const double m2 = {_nhwc_total('c')};",
                "  const float rstd = (float)(1.0 / __builtin_sqrt(m2 / R + eps));",
                "  mean_out[c] = mean[c];", "  rstd_out[c] = rstd;",
                "  running_mean[c] = (float)(momentum * mean[c] + (1.0 - momentum) * running_mean[c]);",
                "  running_var[c] = (float)(momentum * (m2 / (R - 1.0)) + (1.0 - momentum) * running_var[c]);",
                "  scale[c] = weight ? rstd * weight[c] : rstd;",
                "  shift[c] = bias ? bias[c] : 0.0f;",
                "}"]
    else:
        body = ["for (int64_t c = 0; c < C; ++c) {",
                "  mean[c] = running_mean[c];",
                "  const float rstd = (float)(1.0 / __builtin_sqrt((double)running_var[c] + eps));",
                "  scale[c] = weight ? rstd * weight[c] : rstd;",
                "  shift[c] = bias ? bias[c] : 0.0f;",
                "}"]
    normalize = [f"float y = {round_to(dtype, f'({x} - mean[c]) * scale[c] + shift[c]')};"]
    if residual:
        normalize.append(f"y = {round_to(dtype, 'y + ' + load(dtype, 'res[o + c]'))};")
    normalize += [f"pre[o + c] = {store(dtype, 'y')};",
                  f"out[o + c] = {store(dtype, activation_expression(act, param, 'y', C))};"]
    lines += ["  " + line for line in body + _nhwc_rows(normalize)] + ["}"]
    return CppKernel(name, _NHWC_TOTAL + "\n".join(lines) + "\n")


@functools.lru_cache(maxsize=None)
def grad_kernel_nhwc(dtype: str, training: bool, act: str, param: Any, need_dx: bool) -> CppKernel:
    """As `grad_kernel` on channels_last tensors; data adds [part (nthreads * 2C float64), coef (5 * C float32)]."""
    t = _C_TYPE[dtype]
    name = f"fused_bn_{_act_tag(act, param)}_grad_{'train' if training else 'eval'}{'_dx' * need_dx}_nhwc_{dtype}"
    x = load(dtype, "x[o + c]")
    dy = activation_grad_expression(act, param, load(dtype, "dout[o + c]"), load(dtype, "saved[o + c]"), C)
    lines = [signature(name) + " {",
             *_grad_pointers(t),
             "  double* part = (double*)data[12];",
             *_NHWC_HEAD,
             "  float* mean = (float*)data[13];",
             "  float* rstd = mean + C;",
             "  float* grad_mean = mean + 2 * C;",
             "  float* proj = mean + 3 * C;",
             "  float* w_rstd = mean + 4 * C;",
             "  const int64_t W = 2 * C;",
             "  const double eps = scalars[0];"]
    if training:
        body = ["for (int64_t c = 0; c < C; ++c) { mean[c] = save_mean[c]; rstd[c] = save_rstd[c]; }"]
    else:
        body = ["for (int64_t c = 0; c < C; ++c) {",
                "  mean[c] = running_mean[c];",
                "  rstd[c] = (float)(1.0 / __builtin_sqrt((double)running_var[c] + eps));",
                "}"]
    body += [*_nhwc_sums([f"const float g = {round_to(dtype, dy)};",
                          f"dpre[o + c] = {store(dtype, 'g')};",
                          "acc[c] += (double)g;",
                          f"acc[C + c] += (double)(g * ({x} - mean[c]));"]),
             "for (int64_t c = 0; c < C; ++c) {",
             f"  const double sum_dy = {_nhwc_total('c')}, dot = {_nhwc_total('C + c')};",
             "  if (dweight) dweight[c] = (float)(dot * rstd[c]);",
             "  if (dbias) dbias[c] = (float)sum_dy;",
             "  w_rstd[c] = weight ? rstd[c] * weight[c] : rstd[c];",
             "  grad_mean[c] = (float)(sum_dy / R);",
             "  proj[c] = (float)(dot / R) * rstd[c] * rstd[c];",
             "}"]
    if need_dx:
        if training:
            dx = f"({load(dtype, 'dpre[o + c]')} - grad_mean[c] - ({x} - mean[c]) * proj[c]) * w_rstd[c]"
        else:
            dx = f"{load(dtype, 'dpre[o + c]')} * w_rstd[c]"
        body += _nhwc_rows([f"dx[o + c] = {store(dtype, dx)};"])
    lines += ["  " + line for line in body] + ["}"]
    return CppKernel(name, _NHWC_TOTAL + "\n".join(lines) + "\n")


def _check(x: Var, params: list[Var | None]) -> tuple[str, list[int]]:
    if len(x.shape) < 3:
        raise Unsupported("batch norm of a 2-D input (one value per channel and row): the reference is faster")
    require_dtypes("batch norm input", [x.dtype])
    require_dtypes("batch norm weight and statistics", [v.dtype for v in params if v is not None], ("float32",))
    return x.dtype, [x.shape[0], x.shape[1], math.prod(x.shape[2:])]


def _channels_last(op: Op, x: Var) -> bool:
    """Whether the layout pass marked the op's (4-D) input channels_last: then the NHWC kernels run."""
    return op.attrs.get("memory_format") == CHANNELS_LAST and len(x.shape) == 4


def _nhwc_sizes(sizes: list[int]) -> list[int]:
    """The NHWC kernels' meta: rows (N * S) and channels."""
    n, c, s = sizes
    return [n * s, c]


def _nhwc_scratch(threads: int, channels: int, sums: int, coefficients: int) -> list[torch.Tensor]:
    """The NHWC kernels' scratch: per-thread float64 sums (`sums` per channel) and per-channel float32 values."""
    return [torch.empty(threads * sums * channels, dtype=torch.float64),
            torch.empty(coefficients * channels, dtype=torch.float32)]


def _plan_forward(op: Op, inputs: list[Var | None], residual: bool) -> CpuPlan:
    x = inputs[0]
    rest = op.args[1 + residual:]
    training, act, param = rest[4], rest[7], rest[8]
    dtype, sizes = _check(x, inputs[1 + residual:5 + residual])
    if residual and (tuple(inputs[1].shape) != tuple(x.shape) or inputs[1].dtype != dtype):
        raise Unsupported("the residual does not have the input's shape and dtype")
    nhwc = _channels_last(op, x)
    kernel = (forward_kernel_nhwc if nhwc else forward_kernel)(dtype, bool(training), residual, act, param)
    meta = int_array(_nhwc_sizes(sizes) if nhwc else sizes)
    layout = torch.channels_last if nhwc else torch.contiguous_format

    def bind(functions: list[Any]) -> Callable[..., Any]:
        function = functions[0]

        def run(x, *args):
            residual_t = args[0] if residual else None
            weight, bias, running_mean, running_var, training, momentum, eps, act, param = args[residual:]
            x = x.contiguous(memory_format=layout)
            residual_t = residual_t.contiguous(memory_format=layout) if residual_t is not None else None
            out, pre = torch.empty_like(x), torch.empty_like(x)
            channels = x.shape[1] if training else 0
            mean, rstd = torch.empty(channels), torch.empty(channels)
            threads = num_threads()
            tensors = [x, residual_t, weight, bias, running_mean, running_var, out, pre, mean, rstd]
            if nhwc:
                tensors += _nhwc_scratch(threads, x.shape[1], 1, 3)
            function(pointers(tensors), meta, float_array([momentum, eps]), threads)
            return out, pre, mean, rstd

        return run

    return CpuPlan((kernel,), bind)


def plan_bn_act(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`fleetc.fused_bn_act`: statistics, running-stat update, normalize and activation in one kernel."""
    return _plan_forward(op, inputs, residual=False)


def plan_bn_add_act(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`fleetc.fused_bn_add_act`: as fused_bn_act, with the residual added before the activation."""
    return _plan_forward(op, inputs, residual=True)


def plan_bn_act_grad(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`fleetc.fused_bn_act_grad`: dpre, dweight, dbias in one pass, dx in a second."""
    dout, saved, x = inputs[0], inputs[1], inputs[2]
    training, eps, output_mask, act, param = op.args[8:13]
    dtype, sizes = _check(x, [inputs[3], inputs[4], inputs[5], inputs[6], inputs[7]])
    if ACTIVATIONS[act].saves is None or saved is None:
        raise Unsupported(f"{act}'s gradient reads no saved value: the reference handles it")
    require_dtypes("batch norm gradient", [dout.dtype, saved.dtype], (dtype,))
    nhwc = _channels_last(op, x)
    kernel = (grad_kernel_nhwc if nhwc else grad_kernel)(dtype, bool(training), act, param, bool(output_mask[0]))
    meta = int_array(_nhwc_sizes(sizes) if nhwc else sizes)
    layout = torch.channels_last if nhwc else torch.contiguous_format

    def bind(functions: list[Any]) -> Callable[..., Any]:
        function = functions[0]

        def run(dout, saved, x, weight, running_mean, running_var, save_mean, save_rstd, training, eps, output_mask,
                act, param):
            dout, saved, x = (t.contiguous(memory_format=layout) for t in (dout, saved, x))
            need_dx, need_dw, need_db = output_mask
            channels = x.shape[1]
            dx = torch.empty_like(x) if need_dx else None
            dw = torch.empty(channels, dtype=weight.dtype) if need_dw and weight is not None else None
            db = torch.empty(channels, dtype=weight.dtype if weight is not None else torch.float32) if need_db else None
            dpre = torch.empty_like(dout)
            threads = num_threads()
            tensors = [dout, saved, x, weight, running_mean, running_var, save_mean, save_rstd, dx, dw, db, dpre]
            if nhwc:
                tensors += _nhwc_scratch(threads, channels, 2, 5)
            function(pointers(tensors), meta, float_array([eps]), threads)
            return dx, dw, db, dpre

        return run

    return CpuPlan((kernel,), bind)

