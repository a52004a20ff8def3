"""Liveness over a block and a static estimate of peak live bytes (aliasing views share storage)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import sympy

from fleetc.ir.program import Block, Op, Program, VarKind
from fleetc.ir.registry import resolve_callable
from fleetc.ir.symbolic import hints, sym_nbytes


def block_reads(program: Program, op: Op) -> list[str]:
    """Vars an op reads, including everything its sub-block (recursively) reads from outside."""
    reads = list(op.inputs)
    if op.sub_block is not None:
        sub = program.blocks[op.sub_block]
        inner_defined: set[str] = set()
        for inner in sub.ops:
            reads += [n for n in block_reads(program, inner) if n not in inner_defined]
            inner_defined.update(inner.defined)
    return list(dict.fromkeys(reads))


def block_writes(program: Program, op: Op) -> list[str]:
    """Vars an op writes, including everything its sub-block (recursively) writes."""
    writes = list(op.defined)
    if op.sub_block is not None:
        for inner in program.blocks[op.sub_block].ops:
            writes += block_writes(program, inner)
    return list(dict.fromkeys(writes))


@functools.lru_cache(maxsize=None)
def _view_argument(op_type: str, output_index: int) -> int | str | None:
    """Position (keyword for keyword-only) of the argument whose storage output `output_index` of an aten op type
    shares: a view's base, or the tensor an out= overload writes (schema lookup)."""
    if not op_type.startswith("aten."):
        return None
    try:
        schema = resolve_callable(op_type)._schema
    except (KeyError, AttributeError):
        return None
    if output_index >= len(schema.returns):
        return None
    alias = schema.returns[output_index].alias_info
    if alias is None:
        return None
    for position, arg_schema in enumerate(schema.arguments):
        info = arg_schema.alias_info
        if info is not None and info.is_write == alias.is_write and set(info.before_set) & set(alias.before_set):
            return arg_schema.name if arg_schema.kwarg_only else position
    return None


def aliased_input(op: Op, output_index: int) -> str | None:
    """For a view op (`aten.t`, `aten.view`, …) or an out= overload the input Var whose storage output
    `output_index` shares."""
    where = _view_argument(op.type, output_index)
    if isinstance(where, str):
        return getattr(op.kwargs.get(where), "name", None)
    if where is None or where >= len(op.args):
        return None
    return getattr(op.args[where], "name", None)


@functools.lru_cache(maxsize=None)
def written_arguments(op_type: str) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, keyword-only) of each argument an aten op type writes in place (`add_`'s self, `out=`),
    per its schema; empty for functional ops and fleetc ops."""
    if not op_type.startswith("aten."):
        return ()
    schema = resolve_callable(op_type)._schema
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def mutated_inputs(op: Op) -> list[str]:
    """The Vars an aten op writes in place (its schema's written arguments)."""
    names = []
    for position, name, keyword in written_arguments(op.type):
        value = op.kwargs.get(name) if keyword or position >= len(op.args) else op.args[position]
        names += [value.name] if hasattr(value, "name") else []
    return names


def storage_roots(block: Block) -> dict[str, str]:
    """For every view (or out= result) defined in `block`, the Var that owns the storage it shares."""
    root: dict[str, str] = {}
    for op in block.ops:
        for j, name in enumerate(op.outputs):
            base = aliased_input(op, j) if name is not None else None
            if base is not None:
                root[name] = root.get(base, base)
    return root


def last_use_index(program: Program, block: Block, keep: set[str]) -> dict[str, int]:
    """For every temporary defined or read in `block`, the index of the op after which it is dead.

    Vars in `keep` (fetched results) never die. A storage stays alive while any view of it does,
    so a base's death is pushed to its views' last use.
    """
    last: dict[str, int] = {}
    for i, op in enumerate(block.ops):
        for name in block_reads(program, op):
            last[name] = i
        for name in op.outputs:
            if name is not None:
                last.setdefault(name, i)
    for view, base in storage_roots(block).items():
        last[base] = max(last.get(base, 0), last.get(view, 0))
    return {n: i for n, i in last.items()
            if n not in keep and (v := program.find_var(n, block.idx)) is not None and v.kind is VarKind.TEMP}


@dataclass
class MemoryEstimate:
    """Static peak of live bytes: persistables and feeds all step long, temporaries while live.

    For a dynamic Program the numbers are at `sizes` (its traced sizes unless asked for others) and `formula`
    is the peak in the dim names: the bytes live at the peak op, as a sympy expression (at other sizes another
    op may peak; `estimate_memory(program, sizes)` finds it)."""

    peak_bytes: int
    peak_op: str
    persistable_bytes: dict[str, int] = field(default_factory=dict)
    feed_bytes: int = 0
    peak_temporary_bytes: int = 0
    live_after_op: list[tuple[str, int]] = field(default_factory=list)
    formula: str = ""  # a dynamic Program's peak as a formula in its dims ("" when static)
    sizes: dict[str, int] = field(default_factory=dict)  # the dim sizes the numbers are for

    def as_dict(self) -> dict:
        stats = {"estimated_peak_bytes": self.peak_bytes, "peak_op": self.peak_op,
                 "persistable_bytes": dict(self.persistable_bytes), "feed_bytes": self.feed_bytes,
                 "peak_temporary_bytes": self.peak_temporary_bytes}
        if self.formula:
            stats.update(estimated_peak_formula=self.formula, estimated_for_sizes=dict(self.sizes))
        return stats


def _peak_formula(program: Program, block: Block, peak_index: int, free_at: dict[int, list[str]],
                  views: set[str]) -> str:
    """The bytes live just after op `peak_index`, as a formula in the dim names."""
    live = {v.name for v in program.persistables()} | set(program.feeds)
    for i, op in enumerate(block.ops[:peak_index + 1]):
        for name in op.defined:
            var = program.find_var(name, block.idx)
            if var is not None and var.kind is VarKind.TEMP and name not in views:
                live.add(name)
        if i < peak_index:
            live -= set(free_at.get(i, ()))
    total = sympy.Integer(0)
    for name in sorted(live):
        var = program.find_var(name, block.idx)
        total += sym_nbytes(var.shape, var.dtype) if var is not None else 0
    return str(sympy.factor_terms(sympy.expand(total)))


def estimate_memory(program: Program, sizes: dict[str, int] | None = None) -> MemoryEstimate:
    """Walk the global block, counting each storage once (views add no bytes). A dynamic Program's symbolic
    sizes count at `sizes` (default: the sizes it was traced with), and the peak is also given as a formula."""
    dynamic = "dynamic" in program.metadata
    sizes = dict(sizes if sizes is not None else hints(program)) if dynamic else {}
    block = program.global_block
    by_kind: dict[str, int] = {}
    for var in program.persistables():
        by_kind[var.kind.value] = by_kind.get(var.kind.value, 0) + var.nbytes(sizes)
    feeds = sum(program.var(n).nbytes(sizes) for n in program.feeds)
    base = sum(by_kind.values()) + feeds
    dead_after = last_use_index(program, block, set(program.fetches.values()))
    free_at: dict[int, list[str]] = {}
    for name, i in dead_after.items():
        free_at.setdefault(i, []).append(name)
    views = view_vars(block)
    live = 0
    peak, peak_op, peak_temp, peak_index = base, "", 0, -1
    timeline = []
    for i, op in enumerate(block.ops):
        for name in op.defined:
            var = program.find_var(name, block.idx)
            if var is not None and var.kind is VarKind.TEMP and name not in views:
                live += var.nbytes(sizes)
        if base + live > peak:
            peak, peak_op, peak_index = base + live, op.name, i
        peak_temp = max(peak_temp, live)
        timeline.append((op.name, base + live))
        live -= sum(program.var(n, block.idx).nbytes(sizes) for n in free_at.get(i, ()) if n not in views)
    formula = _peak_formula(program, block, peak_index, free_at, views) if dynamic else ""
    return MemoryEstimate(peak, peak_op, by_kind, feeds, peak_temp, timeline, formula, sizes)


def view_vars(block: Block) -> set[str]:
    """Temporaries that are views of another Var's storage."""
    return {name for op in block.ops for j, name in enumerate(op.outputs)
            if name is not None and aliased_input(op, j) is not None}
