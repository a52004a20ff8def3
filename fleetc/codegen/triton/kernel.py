"""Triton source for one `fleetc.fused_elementwise` op: a named kernel plus the hash of its source.

The source depends only on the op's expression, the rank of its iteration space and its input dtypes;
sizes and strides are `tl.constexpr` arguments, so the compiled binary is specialised per shape (and
Triton's cache keys it by source, constexprs, dtypes and device). Pointwise groups run a 1-D grid
over the flattened output with a tail mask; groups ending in a reduction run a 2-D tile of
(kept elements × reduced elements), looping over the reduced extent and accumulating in fp32.
Reductions combine with a helper jitted in the kernel's own module (see lowering.py for why).
Inputs are read through per-dimension strides (0 for broadcast dimensions) unless they are
contiguous at the full shape, in which case the flat offset is used directly.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from fleetc.ops.fused_elementwise import operand_index
from fleetc.ops.pointwise import REDUCTIONS, LoweringError, constant, lower

_FLOAT_DTYPES = {"float32", "float16", "bfloat16"}


@dataclass(frozen=True)
class KernelSource:
    """A generated kernel: `name` is the @triton.jit function in `source`; `source_hash` names it on disk."""

    name: str
    source: str
    rank: int
    reduce_dims: tuple[int, ...] | None  # None: pointwise kernel
    reduce_mean: bool = False

    @property
    def source_hash(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]


def reduction_of(steps: tuple, rank: int) -> tuple[tuple[int, ...], bool] | None:
    """(reduced dims, divides by count) of a trailing reduction step, or None for a pointwise group."""
    op_type, args, kwargs = steps[-1]
    if op_type not in REDUCTIONS:
        return None
    dims = args[1] if len(args) > 1 else dict(kwargs).get("dim")
    if dims is None or len(dims) == 0:
        dims = tuple(range(rank))
    return tuple(sorted({d % rank for d in dims})), REDUCTIONS[op_type]


def _decompose(linear: str, dims: list[int], prefix: str) -> list[str]:
    """Lines splitting a flat index over `dims` (last fastest) into per-dimension indices `i<d>`."""
    if not dims:
        return []
    lines, rest = [], linear
    for d in reversed(dims[1:]):
        lines.append(f"i{d} = {rest} % S{d}")
        lines.append(f"{prefix}_{d} = {rest} // S{d}")
        rest = f"{prefix}_{d}"
    lines.append(f"i{dims[0]} = {rest}")
    return lines


def _strided(k: int, rank: int, fallback: str) -> str:
    terms = [f"i{d} * IN{k}_T{d}" for d in range(rank)]
    return " + ".join(terms) if terms else f"{fallback} * 0"


def _contiguous_offset(rank: int) -> str:
    terms = []
    for d in range(rank):
        later = [f"S{e}" for e in range(d + 1, rank)]
        terms.append(" * ".join([f"i{d}", *later]))
    return " + ".join(terms) if terms else "0"


def _step_lines(steps: tuple, num_inputs: int, pointwise_steps: int) -> list[str]:
    lines = []
    for j, (op_type, args, kwargs) in enumerate(steps[:pointwise_steps]):
        def text(value):
            index = operand_index(value)
            if index is not None:
                return f"v{index}"
            return repr(value) if isinstance(value, str) else constant(value)

        expr = lower(op_type, [text(a) for a in args], {k: text(v) for k, v in kwargs})
        lines.append(f"v{num_inputs + j} = {expr}")
    return lines


def _load_lines(input_dtypes: tuple[str, ...], rank: int, flat: str, mask: str, indent: str) -> list[str]:
    lines = []
    for k, dtype in enumerate(input_dtypes):
        cast = ".to(tl.float32)" if dtype in _FLOAT_DTYPES else ""
        lines += [f"if IN{k}_CONTIG:",
                  f"    v{k} = tl.load(in{k} + {flat}, mask={mask}, other=0){cast}",
                  "else:",
                  f"    v{k} = tl.load(in{k} + ({_strided(k, rank, flat)}), mask={mask}, other=0){cast}"]
    return [indent + line for line in lines]


def generate_kernel(name: str, steps: tuple, results: tuple, input_dtypes: tuple[str, ...], rank: int) -> KernelSource:
    """The Triton source of a fused op; LoweringError when a step has no Triton form."""
    num_inputs = len(input_dtypes)
    reduction = reduction_of(steps, rank)
    pointwise_steps = len(steps) - (reduction is not None)
    reduced_value = num_inputs + len(steps) - 1 if reduction else None
    params = [f"in{k}" for k in range(num_inputs)] + [f"out{m}" for m in range(len(results))]
    params += [f"S{d}: tl.constexpr" for d in range(rank)]
    params += [f"IN{k}_T{d}: tl.constexpr" for k in range(num_inputs) for d in range(rank)]
    params += [f"IN{k}_CONTIG: tl.constexpr" for k in range(num_inputs)]
    body: list[str] = []
    ind = "    "
    if reduction is None:
        params += ["NUMEL: tl.constexpr", "BLOCK: tl.constexpr"]
        body += [f"{ind}offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)", f"{ind}mask = offs < NUMEL"]
        body += [ind + line for line in _decompose("offs", list(range(rank)), "rest")]
        body += _load_lines(input_dtypes, rank, "offs", "mask", ind)
        body += [ind + line for line in _step_lines(steps, num_inputs, pointwise_steps)]
        for m, r in enumerate(results):
            body.append(f"{ind}tl.store(out{m} + offs, v{r}.to(out{m}.dtype.element_ty), mask=mask)")
    else:
        dims, mean = reduction
        kept = [d for d in range(rank) if d not in dims]
        params += ["M: tl.constexpr", "N: tl.constexpr", "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"]
        inner = ind * 2
        body += [f"{ind}rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]",
                 f"{ind}row_mask = rows < M",
                 f"{ind}acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)",
                 f"{ind}for start in range(0, N, BLOCK_N):",
                 f"{inner}cols = start + tl.arange(0, BLOCK_N)[None, :]",
                 f"{inner}mask = row_mask & (cols < N)"]
        body += [inner + line for line in _decompose("rows", kept, "row_rest")]
        body += [inner + line for line in _decompose("cols", list(dims), "col_rest")]
        body.append(f"{inner}flat = {_contiguous_offset(rank)}")
        body += _load_lines(input_dtypes, rank, "flat", "mask", inner)
        body += [inner + line for line in _step_lines(steps, num_inputs, pointwise_steps)]
        for m, r in enumerate(results):
            if r != reduced_value:
                body.append(f"{inner}tl.store(out{m} + flat, v{r}.to(out{m}.dtype.element_ty), mask=mask)")
        summed = steps[-1][1][0]
        body.append(f"{inner}acc += tl.where(mask, v{operand_index(summed)}, 0.0)")
        body.append(f"{ind}total = tl.reduce(acc, 1, _add)[:, None]")
        if mean:
            body.append(f"{ind}total = total / N")
        for m, r in enumerate(results):
            if r == reduced_value:
                body.append(f"{ind}tl.store(out{m} + rows, total.to(out{m}.dtype.element_ty), mask=row_mask)")
    if not name.isidentifier():
        raise LoweringError(f"kernel name {name!r} is not a Python identifier")
    helpers = ["@triton.jit", "def _add(a, b):", "    return a + b", "", ""] if reduction else []
    source = "\n".join(["import triton", "import triton.language as tl", "", "", *helpers, "@triton.jit",
                        f"def {name}({', '.join(params)}):", *body]) + "\n"
    return KernelSource(name, source, rank, reduction[0] if reduction else None, bool(reduction and reduction[1]))
