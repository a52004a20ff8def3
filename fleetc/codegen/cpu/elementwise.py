"""C++ kernels for step lists (`fleetc.fused_elementwise`, and add+act through add_act_steps.py): one loop nest each.

A pointwise kernel walks the collapsed iteration space (layout.py) as rows × column blocks, one OpenMP work
item each; the innermost loop is contiguous and `#pragma omp simd` when every operand's innermost stride is
the planned one (1, or 0 for an operand broadcast along it), else strided. A kernel ending in `sum`/`mean`
either reduces rows (the reduced dims are innermost: one fp32 SIMD accumulator per kept element) or, when the
innermost dim is kept (a column sum such as a bias gradient), accumulates a block of columns at a time.

Each step's expression comes from the shared lowering table (fleetc/ops/pointwise.py) in its C dialect;
values are fp32 (bool for masks) and each step's result is rounded to the dtype aten would store it in
(bf16 steps round to bf16), so fp32 and bf16 chains of exact ops (add, mul, relu, where, ...) match the
unfused aten ops bit for bit; transcendental steps (exp, erf, tanh) use the prelude's inline approximations
and match within their stated error (source.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fleetc.codegen.add_act_steps import Launch, forward_launches, grad_launch
from fleetc.codegen.cpu.layout import broadcast_strides, contiguous_strides, layout, planned_inner_strides
from fleetc.codegen.cpu.plan import CpuPlan, Unsupported, int_array, num_threads, pointers, require_dtypes
from fleetc.codegen.cpu.source import GRAIN, C_TYPES, CppKernel, load, round_to, signature, store, value_type
from fleetc.codegen.triton.kernel import reduction_of
from fleetc.ir.program import Op, Var
from fleetc.ir.registry import resolve_callable
from fleetc.ops.fused_elementwise import operand_index
from fleetc.ops.pointwise import C, LoweringError, lower, source_text

POINTWISE_BLOCK = 4096  # columns per work item
COLUMN_BLOCK = 256  # kept columns accumulated at once by a column reduction
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.bool: "bool"}
# Steps whose C form is bit-identical to aten's kernel in fp32 (others: transcendental approximations).
EXACT_STEPS = {"aten.add.Tensor", "aten.add.Scalar", "aten.sub.Tensor", "aten.sub.Scalar", "aten.rsub.Scalar",
               "aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar", "aten.neg.default",
               "aten.relu.default", "aten.threshold_backward.default", "aten.leaky_relu.default",
               "aten.leaky_relu_backward.default", "aten.native_dropout_backward.default", "aten.masked_fill.Scalar",
               "aten.where.self", "aten.bitwise_not.default", "aten.eq.Scalar", "aten.ne.Scalar", "aten.gt.Scalar",
               "aten.ge.Scalar", "aten.lt.Scalar", "aten.le.Scalar", "aten.abs.default",
               "aten.sigmoid_backward.default", "aten.reciprocal.default"}


@dataclass(frozen=True)
class StepsSpec:
    """A step list specialised to its operands' static shapes and dtypes (what the generated source depends on)."""

    name: str
    steps: tuple
    results: tuple
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    step_dtypes: tuple[str, ...]
    output_shapes: tuple[tuple[int, ...], ...]
    full: tuple[int, ...]
    reduced_dims: tuple[int, ...]  # () for a pointwise kernel
    mean: bool

    @property
    def reduced_result(self) -> int | None:
        return len(self.input_dtypes) + len(self.steps) - 1 if self.reduced_dims else None

    @property
    def inner_is_reduced(self) -> bool:
        return bool(self.reduced_dims) and len(self.full) - 1 in self.reduced_dims

    def dtype_of(self, value: int) -> str:
        k = len(self.input_dtypes)
        return self.input_dtypes[value] if value < k else self.step_dtypes[value - k]

    @property
    def full_outputs(self) -> list[int]:
        """Indices (into results) of outputs that have the iteration shape (every result but the reduced one)."""
        return [m for m, r in enumerate(self.results) if r != self.reduced_result]

    @property
    def exact(self) -> bool:
        """Whether every pointwise step matches its aten kernel bit for bit (EXACT_STEPS). An add/sub with alpha != 1
        is only fp32-close: aten fuses `a + alpha * b` into one rounding in its vectorized loops but not in every
        scalar or broadcast loop (and rounds a bf16 alpha to bf16), so no single formula matches it everywhere."""
        pointwise = self.steps[:len(self.steps) - bool(self.reduced_dims)]
        return all(op_type in EXACT_STEPS and dict(kwargs).get("alpha", 1) == 1 for op_type, _, kwargs in pointwise)


def _meta_value(value: Any, metas: list) -> Any:
    index = operand_index(value)
    if index is not None:
        return metas[index]
    if isinstance(value, tuple):
        return [_meta_value(v, metas) for v in value]
    return value


def specialise(name: str, steps: tuple, results: tuple, shapes: list[tuple[int, ...]], dtypes: list[str]) -> StepsSpec:
    """Run the steps on meta tensors for every intermediate's dtype and the outputs' shapes; Unsupported when the
    dtypes or steps have no C form."""
    require_dtypes(name, list(dtypes), tuple(C_TYPES))
    full = tuple(torch.broadcast_shapes(*shapes))
    values = [torch.empty(s, dtype=getattr(torch, d), device="meta") for s, d in zip(shapes, dtypes)]
    for op_type, args, kwargs in steps:
        fn = resolve_callable(op_type)
        values.append(fn(*(_meta_value(a, values) for a in args), **{k: _meta_value(v, values) for k, v in kwargs}))
    step_dtypes = tuple(_DTYPE_NAMES.get(v.dtype, str(v.dtype)) for v in values[len(shapes):])
    require_dtypes(f"{name} (intermediate)", list(step_dtypes), tuple(C_TYPES))
    reduction = reduction_of(steps, len(full)) if full else None
    reduced_dims, mean = reduction if reduction else ((), False)
    spec = StepsSpec(name, steps, results, tuple(tuple(s) for s in shapes), tuple(dtypes), step_dtypes,
                     tuple(tuple(values[r].shape) for r in results), full, reduced_dims, mean)
    if any(r < len(shapes) for r in results):
        raise Unsupported(f"{name}: a result that is an input")
    for m in spec.full_outputs:
        if spec.output_shapes[m] != full:
            raise Unsupported(f"{name}: result {m} does not have the iteration shape")
    return spec


def _step_lines(spec: StepsSpec) -> list[str]:
    k = len(spec.input_dtypes)
    lines = []
    pointwise = spec.steps[:len(spec.steps) - bool(spec.reduced_dims)]
    for j, (op_type, args, kwargs) in enumerate(pointwise):
        def text(value: Any) -> str:
            index = operand_index(value)
            return f"v{index}" if index is not None else source_text(value, C)

        try:
            expr = lower(op_type, [text(a) for a in args], {key: text(v) for key, v in kwargs}, C)
        except LoweringError as exc:
            raise Unsupported(f"{spec.name}: {exc}") from None
        dtype = spec.step_dtypes[j]
        lines.append(f"const {value_type(dtype)} v{k + j} = {round_to(dtype, expr)};")
    return lines


def _operands(spec: StepsSpec) -> list[tuple[str, str, bool]]:
    """(pointer name, dtype, is output) of every strided operand: inputs, then the full-shape outputs."""
    ops = [(f"in{i}", d, False) for i, d in enumerate(spec.input_dtypes)]
    return ops + [(f"out{m}", spec.dtype_of(spec.results[m]), True) for m in spec.full_outputs]


def _body(spec: StepsSpec, index: Callable[[int], str]) -> list[str]:
    """Loads, steps and stores of one element; `index(o)` is operand o's element offset."""
    lines = [f"const {value_type(d)} v{i} = {load(d, f'in{i}[{index(i)}]')};" for i, d in enumerate(spec.input_dtypes)]
    lines += _step_lines(spec)
    k = len(spec.input_dtypes)
    for o, m in enumerate(spec.full_outputs):
        r = spec.results[m]
        lines.append(f"out{m}[{index(k + o)}] = {store(spec.dtype_of(r), f'v{r}')};")
    return lines


def _pointer_lines(spec: StepsSpec) -> list[str]:
    lines = [f"const {C_TYPES[d]}* in{i} = (const {C_TYPES[d]}*)data[{i}];"
             for i, d in enumerate(spec.input_dtypes)]
    k = len(spec.input_dtypes)
    for m, r in enumerate(spec.results):
        # no __restrict__ on outputs: `StepsRunner.into` may write a result over an input
        lines.append(f"{C_TYPES[spec.dtype_of(r)]}* out{m} = ({C_TYPES[spec.dtype_of(r)]}*)data[{k + m}];")
    return lines


def _bases(n: int, first: str, count: str, index: str, indent: str, prefix: str = "b") -> list[str]:
    """Lines adding the strided offsets of multi-index `index` over dims [first, first + count) to the operands'
    offsets `<prefix>0`..`<prefix>{n-1}`."""
    adds = " ".join(f"{prefix}{o} += i * st[{o} * nd + d];" for o in range(n))
    return [f"{indent}for (int64_t d = {first} + {count} - 1, rest = {index}; d >= {first}; --d) {{",
            f"{indent}  const int64_t i = rest % size[d]; rest /= size[d]; {adds}",
            f"{indent}}}"]


def _inner_loop(spec: StepsSpec, planned: tuple[int, ...], lo: str, hi: str, indent: str,
                simd_clause: str = "", accumulate: str = "") -> list[str]:
    """Fast (planned inner strides, `omp simd`) and strided versions of the innermost loop over j in [lo, hi)."""
    n = len(planned)

    def fast(o: int) -> str:
        return f"b{o} + j" if planned[o] == 1 else f"b{o}"

    def strided(o: int) -> str:
        return f"b{o} + j * s{o}"

    out = [f"{indent}if (fast) {{", f"{indent}  #pragma omp simd{simd_clause}",
           f"{indent}  for (int64_t j = {lo}; j < {hi}; ++j) {{"]
    out += [f"{indent}    {line}" for line in _body(spec, fast)] + ([f"{indent}    {accumulate}"] if accumulate else [])
    out += [f"{indent}  }}", f"{indent}}} else {{"]
    out += [f"{indent}  const int64_t s{o} = st[{o} * nd + inner];" for o in range(n)]
    out += [f"{indent}  for (int64_t j = {lo}; j < {hi}; ++j) {{"]
    out += [f"{indent}    {line}" for line in _body(spec, strided)] + ([f"{indent}    {accumulate}"] if accumulate else [])
    out += [f"{indent}  }}", f"{indent}}}"]
    return out


def generate(spec: StepsSpec) -> CppKernel:
    """The C++ kernel of a specialised step list."""
    n = len(_operands(spec))
    planned = planned_inner_strides(spec.full, list(spec.input_shapes) + [spec.full] * len(spec.full_outputs),
                                    spec.reduced_dims, spec.inner_is_reduced)
    head = [signature(spec.name) + " {", *("  " + line for line in _pointer_lines(spec)),
            "  const int64_t nk = meta[0], nr = meta[1], nd = nk + nr;",
            "  const int64_t* size = meta + 2;",
            "  const int64_t* st = meta + 2 + nd;  // operand o's stride along dim d: st[o * nd + d]"]
    inner = "nd - 1" if spec.inner_is_reduced or not spec.reduced_dims else "nk - 1"
    head.append(f"  const int64_t inner = {inner};")
    head.append("  const bool fast = " + " && ".join(f"st[{o} * nd + inner] == {p}" for o, p in enumerate(planned)) + ";")
    zero_bases = "int64_t " + ", ".join(f"b{o} = 0" for o in range(n)) + ";"
    if not spec.reduced_dims:
        body = ["  const int64_t cols = size[nk - 1];",
                "  int64_t rows = 1; for (int64_t d = 0; d < nk - 1; ++d) rows *= size[d];",
                f"  const int64_t nblk = (cols + {POINTWISE_BLOCK} - 1) / {POINTWISE_BLOCK};",
                f"  #pragma omp parallel for num_threads(nthreads) schedule(static) if(rows * cols >= {GRAIN})",
                "  for (int64_t item = 0; item < rows * nblk; ++item) {",
                f"    const int64_t row = item / nblk, c0 = (item % nblk) * {POINTWISE_BLOCK};",
                f"    const int64_t c1 = fc_min(cols, c0 + {POINTWISE_BLOCK});",
                f"    {zero_bases}",
                *_bases(n, "0", "nk - 1", "row", "    "),
                *_inner_loop(spec, planned, "c0", "c1", "    "),
                "  }", "}"]
        return CppKernel(spec.name, "\n".join(head + body) + "\n")
    summed = operand_index(spec.steps[-1][1][0])
    reduced_out = spec.results.index(spec.reduced_result)
    out_dtype = spec.dtype_of(spec.reduced_result)
    count = "(float)red_n"
    total = lambda acc: f"{acc} / {count}" if spec.mean else acc  # noqa: E731
    common = ["  int64_t kept_n = 1; for (int64_t d = 0; d < nk; ++d) kept_n *= size[d];",
              "  int64_t red_n = 1; for (int64_t d = nk; d < nd; ++d) red_n *= size[d];"]
    if spec.inner_is_reduced:
        body = common + [
            "  const int64_t red_inner = size[nd - 1], red_rows = red_n / red_inner;",
            f"  #pragma omp parallel for num_threads(nthreads) schedule(static) if(kept_n * red_n >= {GRAIN})",
            "  for (int64_t k = 0; k < kept_n; ++k) {",
            "    int64_t " + ", ".join(f"k{o} = 0" for o in range(n)) + ";",
            *_bases(n, "0", "nk", "k", "    ", prefix="k"),
            "    float acc = 0.0f;",
            "    for (int64_t r = 0; r < red_rows; ++r) {",
            "      int64_t " + ", ".join(f"b{o} = k{o}" for o in range(n)) + ";",
            *_bases(n, "nk", "nr - 1", "r", "      "),
            *_inner_loop(spec, planned, "0", "red_inner", "      ", " reduction(+:acc)", f"acc += v{summed};"),
            "    }",
            f"    out{reduced_out}[k] = {store(out_dtype, total('acc'))};",
            "  }", "}"]
    else:
        body = common + [
            "  const int64_t cols = size[nk - 1], rows = kept_n / cols;",
            f"  const int64_t nblk = (cols + {COLUMN_BLOCK} - 1) / {COLUMN_BLOCK};",
            f"  #pragma omp parallel for num_threads(nthreads) schedule(static) if(kept_n * red_n >= {GRAIN})",
            "  for (int64_t item = 0; item < rows * nblk; ++item) {",
            f"    const int64_t row = item / nblk, c0 = (item % nblk) * {COLUMN_BLOCK};",
            f"    const int64_t c1 = fc_min(cols, c0 + {COLUMN_BLOCK});",
            f"    float acc[{COLUMN_BLOCK}];",
            "    for (int64_t j = 0; j < c1 - c0; ++j) acc[j] = 0.0f;",
            "    int64_t " + ", ".join(f"k{o} = 0" for o in range(n)) + ";",
            *_bases(n, "0", "nk - 1", "row", "    ", prefix="k"),
            "    for (int64_t r = 0; r < red_n; ++r) {",
            "      int64_t " + ", ".join(f"b{o} = k{o}" for o in range(n)) + ";",
            *_bases(n, "nk", "nr", "r", "      "),
            *_inner_loop(spec, planned, "c0", "c1", "      ", "", f"acc[j - c0] += v{summed};"),
            "    }",
            f"    for (int64_t j = c0; j < c1; ++j) out{reduced_out}[row * cols + j] = "
            f"{store(out_dtype, total('acc[j - c0]'))};",
            "  }", "}"]
    return CppKernel(spec.name, "\n".join(head + body) + "\n")


class StepsRunner:
    """Runs a built step-list kernel on tensors: collapses the layout (cached per stride signature) and
    allocates the outputs."""

    def __init__(self, spec: StepsSpec, function: Any):
        self.spec = spec
        self.function = function
        self.metas: dict[tuple, Any] = {}
        self.out_specs = [(shape, getattr(torch, spec.dtype_of(r))) for shape, r in zip(spec.output_shapes, spec.results)]
        self.out_strides = [broadcast_strides(spec.full, contiguous_strides(spec.full), spec.full)
                            for _ in spec.full_outputs]

    def meta(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        key = tuple(t.stride() for t in inputs)
        meta = self.metas.get(key)
        if meta is None:
            full = self.spec.full
            strides = [broadcast_strides(tuple(t.shape), t.stride(), full) for t in inputs] + self.out_strides
            meta = self.metas[key] = int_array(layout(full, strides, self.spec.reduced_dims).meta())
        return meta

    def __call__(self, *inputs: torch.Tensor) -> Any:
        outs = [torch.empty(shape, dtype=dtype) for shape, dtype in self.out_specs]
        self.function(pointers([*inputs, *outs]), self.meta(inputs), None, num_threads())
        return outs[0] if len(outs) == 1 else tuple(outs)

    def into(self, *inputs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Run a one-result pointwise kernel writing into `out` (contiguous; it may be an input, for an in-place
        update: each element is read before it is written, by the same iteration)."""
        self.function(pointers([*inputs, out]), self.meta(inputs), None, num_threads())
        return out


def _spec_for(launch: Launch, inputs: list[Var | None]) -> StepsSpec:
    used = [inputs[i] for i in launch.inputs]
    return specialise(launch.name, launch.steps, launch.results, [tuple(v.shape) for v in used], [v.dtype for v in used])


@functools.lru_cache(maxsize=None)
def kernel_of(spec: StepsSpec) -> CppKernel:
    """The kernel of a spec (generated once per spec)."""
    return generate(spec)


def _plan_launches(launches: list[Launch], inputs: list[Var | None], combine: Callable) -> CpuPlan:
    specs = [_spec_for(launch, inputs) for launch in launches]
    kernels = tuple(kernel_of(spec) for spec in specs)

    def bind(functions: list[Any]) -> Callable[..., Any]:
        runners = [StepsRunner(spec, fn) for spec, fn in zip(specs, functions)]
        return combine([(runner, launch.inputs) for runner, launch in zip(runners, launches)])

    return CpuPlan(kernels, bind, exact=all(spec.exact for spec in specs))


def plan_fused_elementwise(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`fleetc.fused_elementwise`: one kernel over all the op's inputs."""
    name, steps, results = op.kwargs["name"], op.kwargs["steps"], op.kwargs["results"]
    spec = specialise(name, steps, results, [tuple(v.shape) for v in inputs], [v.dtype for v in inputs])

    def bind(functions: list[Any]) -> Callable[..., Any]:
        runner = StepsRunner(spec, functions[0])
        return lambda *tensors, steps, results, name: runner(*tensors)

    return CpuPlan((kernel_of(spec),), bind, exact=spec.exact)


def plan_add_act(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`fleetc.fused_elemwise_add_act`: (out, inter) from one kernel, or two when act(y) is smaller than out."""
    x, y = inputs[0], inputs[1]
    act_first, act, param = op.args[2], op.args[3], op.args[4]
    launches = forward_launches(tuple(x.shape), tuple(y.shape), act_first, act, param)

    def combine(runners: list) -> Callable[..., Any]:
        def run(x: torch.Tensor, y: torch.Tensor, act_first: bool, act: str, param: Any) -> Any:
            tensors = (x, y)
            results = [runner(*(tensors[i] for i in used)) for runner, used in runners]
            return results[0] if len(results) == 1 else (results[0], results[1])

        return run

    return _plan_launches(launches, inputs, combine)


def plan_add_act_grad(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`fleetc.fused_elemwise_add_act_grad`: one kernel."""
    has_saved = inputs[1] is not None
    launch = grad_launch(has_saved, op.args[2], op.args[3])

    def combine(runners: list) -> Callable[..., Any]:
        [(runner, used)] = runners

        def run(dout: torch.Tensor, saved: torch.Tensor | None, act: str, param: Any) -> torch.Tensor:
            tensors = (dout, saved)
            return runner(*(tensors[i] for i in used))

        return run

    return _plan_launches([launch], inputs, combine)
