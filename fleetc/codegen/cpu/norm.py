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


@functools.lru_cache(maxsize=None)
def forward_kernel(dtype: str, training: bool, residual: bool, act: str, param: Any) -> CppKernel:
    """data = [x, residual, weight, bias, running_mean, running_var, out, pre, mean, rstd]; scalars = [momentum, eps]."""
    t = _C_TYPE[dtype]
    name = f"fused_bn{'_add' * residual}_{_act_tag(act, param)}_{'train' if training else 'eval'}_{dtype}"
    x = load(dtype, "x[o + s]")
    lines = [signature(name) + " {",
             f"  const {t}* x = (const {t}*)data[0];",
             f"  const {t}* res = (const {t}*)data[1];",
             "  const float* weight = (const float*)data[2];",
             "  const float* bias = (const float*)data[3];",
             "  float* running_mean = (float*)data[4];",
             "  float* running_var = (float*)data[5];",
             f"  {t}* out = ({t}*)data[6];",
             f"  {t}* pre = ({t}*)data[7];",
             "  float* mean_out = (float*)data[8];",
             "  float* rstd_out = (float*)data[9];",
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
             f"  const {t}* dout = (const {t}*)data[0];",
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
             f"  {t}* dpre = ({t}*)data[11];",
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


def _check(x: Var, params: list[Var | None]) -> tuple[str, list[int]]:
    if len(x.shape) < 3:
        raise Unsupported("batch norm of a 2-D input (one value per channel and row): the reference is faster")
    require_dtypes("batch norm input", [x.dtype])
    require_dtypes("batch norm weight and statistics", [v.dtype for v in params if v is not None], ("float32",))
    return x.dtype, [x.shape[0], x.shape[1], math.prod(x.shape[2:])]


def _plan_forward(op: Op, inputs: list[Var | None], residual: bool) -> CpuPlan:
    x = inputs[0]
    rest = op.args[1 + residual:]
    training, act, param = rest[4], rest[7], rest[8]
    dtype, sizes = _check(x, inputs[1 + residual:5 + residual])
    if residual and (tuple(inputs[1].shape) != tuple(x.shape) or inputs[1].dtype != dtype):
        raise Unsupported("the residual does not have the input's shape and dtype")
    kernel = forward_kernel(dtype, bool(training), residual, act, param)
    meta = int_array(sizes)

    def bind(functions: list[Any]) -> Callable[..., Any]:
        function = functions[0]

        def run(x, *args):
            residual_t = args[0] if residual else None
            weight, bias, running_mean, running_var, training, momentum, eps, act, param = args[residual:]
            x = x.contiguous()
            residual_t = residual_t.contiguous() if residual_t is not None else None
            out, pre = torch.empty_like(x), torch.empty_like(x)
            channels = x.shape[1] if training else 0
            mean, rstd = torch.empty(channels), torch.empty(channels)
            data = pointers([x, residual_t, weight, bias, running_mean, running_var, out, pre, mean, rstd])
            function(data, meta, float_array([momentum, eps]), num_threads())
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
    kernel = grad_kernel(dtype, bool(training), act, param, bool(output_mask[0]))
    meta = int_array(sizes)

    def bind(functions: list[Any]) -> Callable[..., Any]:
        function = functions[0]

        def run(dout, saved, x, weight, running_mean, running_var, save_mean, save_rstd, training, eps, output_mask,
                act, param):
            dout, saved, x = dout.contiguous(), saved.contiguous(), x.contiguous()
            need_dx, need_dw, need_db = output_mask
            channels = x.shape[1]
            dx = torch.empty_like(x) if need_dx else None
            dw = torch.empty(channels, dtype=weight.dtype) if need_dw and weight is not None else None
            db = torch.empty(channels, dtype=weight.dtype if weight is not None else torch.float32) if need_db else None
            dpre = torch.empty_like(dout)
            data = pointers([dout, saved, x, weight, running_mean, running_var, save_mean, save_rstd, dx, dw, db, dpre])
            function(data, meta, float_array([eps]), num_threads())
            return dx, dw, db, dpre

        return run

    return CpuPlan((kernel,), bind)

