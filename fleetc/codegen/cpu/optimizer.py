"""C++ kernels of the multi-tensor optimizer updates (`fleetc.fused_sgd`, `fleetc.fused_adam`): one pass per group.

One kernel call updates every parameter of a group: OpenMP work items are chunks of the group's tensors, and
each element is read and written once (the `_foreach_*` reference makes ~8 passes over memory and ~10 aten calls
per tensor). Adam's step counters are incremented and its bias corrections computed inside the kernel, so no step
value is read back to Python.

Exact: the kernels repeat the reference's fp32 arithmetic operation for operation (and through it eager
torch.optim's single-tensor update): each hyperparameter is a double cast to float as aten casts a Python
scalar; `add(a, b, alpha)`, `lerp` and `addcmul` are the fused multiply-adds that aten's build makes of them
(`fmadd(b, alpha, a)`, `fmadd(w, end - self, self)` or `fmadd(w - 1, end - self, end)`, `fmadd(value * t1, t2,
self)`), written as `__builtin_fmaf` in a library built with `-ffp-contract=off`, and the bias corrections are
the same double `pow` Python computes. Parameters, gradients and state must be fp32 (others: the reference).
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Any, Callable

import torch

from fleetc.codegen.cpu.plan import CpuPlan, float_array, int_array, num_threads, pointers, require_dtypes
from fleetc.codegen.cpu.source import GRAIN, CppKernel, signature
from fleetc.ir.program import Op, Var
from fleetc.ops import fused_optimizer

CHUNK = 4096  # elements per OpenMP work item (Adam keeps a chunk's square roots on the stack)

# data = [list 0 pointers..., list 1 pointers..., ...]; meta = [n, chunk starts (n + 1)..., numel (n)...]
_PROLOGUE = '''  const int64_t n = meta[0];
  const int64_t* first_chunk = meta + 1;
  const int64_t* numel = meta + 2 + n;
  const int64_t chunks = first_chunk[n];
  #pragma omp parallel for num_threads(nthreads) schedule(static) if(chunks * {chunk} >= {grain})
  for (int64_t c = 0; c < chunks; ++c) {{
    int64_t t = 0;
    while (first_chunk[t + 1] <= c) ++t;
    const int64_t lo = (c - first_chunk[t]) * {chunk}, hi = fc_min(numel[t], lo + {chunk});
'''


def _lists(*names: str) -> list[str]:
    return [f"  float* const* {name}s = (float* const*)data + {k} * meta[0];" for k, name in enumerate(names)]


@functools.lru_cache(maxsize=None)
def sgd_kernel(momentum: bool, nesterov: bool, weight_decay: bool, maximize: bool) -> CppKernel:
    """SGD over a group; scalars = [lr, momentum, 1 - dampening, weight decay, fresh (0/1)]."""
    name = "fused_sgd" + "_momentum" * momentum + "_nesterov" * nesterov + "_wd" * weight_decay + "_max" * maximize
    lines = [signature(name) + " {", *_lists("param", "grad", "buf"),
             "  const float neg_lr = (float)(-scalars[0]), mom = (float)scalars[1], damp1m = (float)scalars[2];",
             "  const float wd = (float)scalars[3];",
             "  const bool fresh = scalars[4] != 0.0;",
             _PROLOGUE.format(chunk=CHUNK, grain=GRAIN).rstrip("\n"),
             "    float* __restrict__ p = params[t];",
             "    const float* __restrict__ gr = grads[t];"]
    if momentum:
        lines.append("    float* __restrict__ b = bufs[t];")
    lines += ["    #pragma omp simd", "    for (int64_t i = lo; i < hi; ++i) {",
              f"      float g = {'-gr[i]' if maximize else 'gr[i]'};"]
    if weight_decay:
        lines.append("      g = __builtin_fmaf(p[i], wd, g);")
    if momentum:
        lines += ["      const float m = fresh ? g : __builtin_fmaf(g, damp1m, b[i] * mom);", "      b[i] = m;",
                  "      g = " + ("__builtin_fmaf(m, mom, g);" if nesterov else "m;")]
    lines += ["      p[i] = __builtin_fmaf(g, neg_lr, p[i]);", "    }", "  }", "}"]
    return CppKernel(name, "\n".join(lines) + "\n")


@functools.lru_cache(maxsize=None)
def adam_kernel(weight_decay: bool, decoupled: bool, maximize: bool) -> CppKernel:
    """Adam/AdamW over a group; scalars = [lr, beta1, beta2, eps, weight decay]; data ends with torch's sqrt.

    Per chunk: one loop updates the moments (and decays the parameter), `sqrt` of the new second moments goes
    through the same routine `torch.sqrt` uses (MKL's vmsSqrt in torch's MKL builds, which is not IEEE sqrt on
    every CPU; `__builtin_sqrtf` when the pointer is NULL), a second loop updates the parameter; the chunk stays
    in cache between the two loops."""
    name = "fused_adam" + ("w" if decoupled else "") + "_wd" * weight_decay + "_max" * maximize
    lines = [signature(name) + " {", *_lists("param", "grad", "exp_avg", "exp_avg_sq", "step"),
             "  typedef void (*sqrt_fn_t)(int, const float*, float*, long long);",
             "  const sqrt_fn_t torch_sqrt = (sqrt_fn_t)data[5 * meta[0]];",
             "  const double lr = scalars[0], beta1 = scalars[1], beta2 = scalars[2];",
             "  const float eps = (float)scalars[3], wd = (float)scalars[4];",
             "  const float decay = (float)(1.0 - lr * scalars[4]);",
             "  const float w = (float)(1.0 - beta1), w1 = w - 1.0f, b2 = (float)beta2, b2_1m = (float)(1.0 - beta2);",
             "  const bool small_w = __builtin_fabsf(w) < 0.5f;",
             "  for (int64_t t = 0; t < meta[0]; ++t) steps[t][0] = steps[t][0] + 1.0f;",
             _PROLOGUE.format(chunk=CHUNK, grain=GRAIN).rstrip("\n"),
             "    const double s = (double)steps[t][0];",
             "    const float bc2_sqrt = (float)pow(1.0 - pow(beta2, s), 0.5);",
             "    const float step_size = (float)(-lr / (1.0 - pow(beta1, s)));",
             "    float* __restrict__ p = params[t];",
             "    const float* __restrict__ gr = grads[t];",
             "    float* __restrict__ m = exp_avgs[t];",
             "    float* __restrict__ v = exp_avg_sqs[t];",
             f"    float root[{CHUNK}];",
             "    #pragma omp simd",
             "    for (int64_t i = lo; i < hi; ++i) {",
             f"      float g = {'-gr[i]' if maximize else 'gr[i]'};"]
    if weight_decay:
        lines.append("      p[i] = p[i] * decay;" if decoupled else "      g = __builtin_fmaf(p[i], wd, g);")
    lines += ["      const float mi = m[i], diff = g - mi;",
              "      m[i] = small_w ? __builtin_fmaf(w, diff, mi) : __builtin_fmaf(w1, diff, g);",
              "      v[i] = __builtin_fmaf(b2_1m * g, g, v[i] * b2);",
              "    }",
              "    if (torch_sqrt) {",
              "      torch_sqrt((int)(hi - lo), v + lo, root, 0x140102LL);  // VML_HA | FTZDAZ_OFF | ERRMODE_IGNORE",
              "    } else {",
              "      #pragma omp simd",
              "      for (int64_t i = lo; i < hi; ++i) root[i - lo] = __builtin_sqrtf(v[i]);",
              "    }",
              "    #pragma omp simd",
              "    for (int64_t i = lo; i < hi; ++i) {",
              "      const float denom = root[i - lo] / bc2_sqrt + eps;",
              "      p[i] = p[i] + (step_size * m[i]) / denom;",
              "    }", "  }", "}"]
    return CppKernel(name, "\n".join(lines) + "\n")


@functools.lru_cache(maxsize=None)
def torch_sqrt_address() -> int | None:
    """The address of the fp32 sqrt routine torch.sqrt calls on CPU (MKL's vmsSqrt), None when torch has no MKL."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return ctypes.cast(library.vmsSqrt, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _group_meta(tensors: list[torch.Tensor]) -> Any:
    starts, total = [], 0
    for t in tensors:
        starts.append(total)
        total += -(-t.numel() // CHUNK)
    return int_array([len(tensors), *starts, total, *(t.numel() for t in tensors)])


def _check_vars(what: str, lists: list[list[Var] | None]) -> None:
    for group in lists:
        if group is None:
            continue
        require_dtypes(what, [v.dtype for v in group], ("float32",))


class _GroupRunner:
    """Calls a group kernel with the pointers of its tensor lists (the meta is cached: sizes never change)."""

    def __init__(self, function: Any):
        self.function = function
        self.meta = None

    def __call__(self, lists: list[list[torch.Tensor]], scalars: list[float], extra: tuple = ()) -> bool:
        """Runs the kernel; False (nothing done) when a tensor is not contiguous: the caller runs the reference."""
        if any(not t.is_contiguous() for group in lists for t in group):
            return False
        if self.meta is None:
            self.meta = _group_meta(lists[0])
        data = pointers([t for group in lists for t in group], extra)
        self.function(data, self.meta, float_array(scalars), num_threads())
        return True


def _list_vars(inputs: list, index: int) -> list[Var] | None:
    value = inputs[index]
    return list(value) if isinstance(value, (list, tuple)) else None


def plan_fused_sgd(op: Op, inputs: list) -> CpuPlan:
    """`fleetc.fused_sgd`: one kernel call per group."""
    params, grads, bufs = (_list_vars(inputs, k) for k in range(3))
    fresh, lr, momentum, dampening, nesterov, weight_decay, maximize = op.args[3:10]
    _check_vars("fused_sgd", [params, grads, bufs])
    kernel = sgd_kernel(momentum != 0, bool(nesterov), weight_decay != 0, bool(maximize))

    def bind(functions: list[Any]) -> Callable[..., Any]:
        runner = _GroupRunner(functions[0])

        def run(params, grads, momentum_buffers, fresh, lr, momentum, dampening, nesterov, weight_decay, maximize):
            lists = [params, grads] + ([momentum_buffers] if momentum != 0 else [])
            # The kernel takes one freshness for the group; mixed fresh and old buffers take the reference.
            uniform = all(fresh) or not any(fresh)
            if not uniform or not runner(lists, [lr, momentum, 1 - dampening, weight_decay, float(all(fresh))]):
                fused_optimizer.fused_sgd(params, grads, momentum_buffers, fresh, lr, momentum, dampening, nesterov,
                                          weight_decay, maximize)

        return run

    return CpuPlan((kernel,), bind, exact=True)


def plan_fused_adam(op: Op, inputs: list) -> CpuPlan:
    """`fleetc.fused_adam`: one kernel call per group, step counters included."""
    lists = [_list_vars(inputs, k) for k in range(5)]
    lr, beta1, beta2, eps, weight_decay, decoupled, maximize = op.args[5:12]
    _check_vars("fused_adam", lists)
    kernel = adam_kernel(weight_decay != 0, bool(decoupled), bool(maximize))

    def bind(functions: list[Any]) -> Callable[..., Any]:
        runner = _GroupRunner(functions[0])

        def run(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                decoupled_weight_decay, maximize):
            if not runner([params, grads, exp_avgs, exp_avg_sqs, steps], [lr, beta1, beta2, eps, weight_decay],
                          (torch_sqrt_address(),)):
                fused_optimizer.fused_adam(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps,
                                           weight_decay, decoupled_weight_decay, maximize)

        return run

    return CpuPlan((kernel,), bind, exact=True)
