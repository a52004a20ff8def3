"""Buffer reuse (`build_strategy.memory_optimize`): a matmul or sum writes its result into a temporary that just died.

`g = mm(a, b)` becomes `g = mm.out(a, b, out=d)` when `d` is a temporary of the same shape, dtype and device that
died earlier: the step then frees one buffer and allocates another of the same size less often (the allocator's
work, and on CPU the page faults of large buffers mapped afresh). Liveness (fleetc/ir/liveness.py) says where each
temporary dies; the generated step already frees every temporary after its last use, so holding `d` from its death
to its reuse adds its bytes to the ops in between. A reuse is taken only where those ops stay within the step's
planned peak (`estimate_memory`), so the planned peak does not change.

An op is rewritten only when that changes no bit:

- it is one of the out= overloads that write their result straight into `out` (`OUT_KERNELS`, shared with the
  data-parallel `allreduce_views` pass), limited to those whose functional result is always contiguous (mm, addmm,
  bmm, sum), so the result's strides, and every later kernel's choice, stay what they were;
- `d` and the result are temporaries of the global block made by one of those ops (so contiguous, and of exactly
  their size), that no other block reads, none of whose views is fetched, and that no fleetc op returning a
  temporary reads (its result might be a view liveness cannot see); `d` is dead, so it is not one of the op's
  arguments (out= must not alias an input).

The result is a view of `d` for liveness, so `d` lives until the result and every view of either dies, and can be
reused again after that.
The rewritten op writes `d` (its schema says so), so the multi-threaded scheduler orders it after every earlier
reader of `d` (fleetc/runtime/dependencies.py): a buffer is not reused while a worker may still read it.
"""
from __future__ import annotations

from typing import Any

from fleetc.ir.liveness import (
    block_reads,
    estimate_memory,
    last_use_index,
    storage_roots,
)
from fleetc.ir.program import Block, Program, Ref, VarKind
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel.views import OUT_KERNELS

# Functional ops whose result is always a new contiguous tensor: reusing a contiguous dead buffer for their out=
# overload gives a result with the same strides.
CONTIGUOUS_RESULT = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.sum.dim_IntList"})


def _reusable(program: Program, block: Block, keep: set[str]) -> set[str]:
    """Temporaries whose storage a later op may write: contiguous results of a `CONTIGUOUS_RESULT` op, none of whose
    views is kept, and whose readers are aten ops (whose schemas say what aliases them) or fleetc ops that return
    no temporary (a fleetc op's result may be a view of its input that liveness cannot see)."""
    made = {op.outputs[0] for op in block.ops if op.type in CONTIGUOUS_RESULT and len(op.outputs) == 1
            and program.var(op.outputs[0], block.idx).kind is VarKind.TEMP}
    roots = storage_roots(block)
    barred = {roots.get(name, name) for name in keep}
    for op in block.ops:
        if op.type.startswith("fleetc.") and any(
                name is not None and program.var(name, block.idx).kind is VarKind.TEMP for name in op.outputs):
            barred.update(roots.get(name, name) for name in block_reads(program, op))
    return made - barred


# How many of the most recently freed buffers of a result's type are tried: bounds the pass's work per op.
CANDIDATES = 4


def plan_reuse(program: Program, keep: set[str]) -> list[tuple[int, str]]:
    """(op index, dead temporary it writes its result into) for every op of the global block that can reuse one.

    A buffer freed after op j is taken by a later op i only if holding it over the ops between keeps the bytes
    live there within the step's planned peak (`estimate_memory`), which therefore does not change. A buffer's
    name is dead when offered, so it is never among the arguments of the op that takes it."""
    block = program.global_block
    estimate = estimate_memory(program)
    live = [bytes_live for _, bytes_live in estimate.live_after_op]
    dead_after = last_use_index(program, block, keep)
    reusable = _reusable(program, block, keep)
    dies_at: dict[int, list[str]] = {}
    for name, i in dead_after.items():
        dies_at.setdefault(i, []).append(name)
    buffer_of = {name: name for name in reusable}  # a temporary → the buffer it lives in
    free: dict[tuple, list[tuple[str, int]]] = {}  # (shape, dtype, device) → (buffer, freed after op) in order
    planned = []
    for i, op in enumerate(block.ops):
        if op.outputs and op.outputs[0] in reusable:
            var = program.var(op.outputs[0], block.idx)
            candidates = free.get((var.shape, var.dtype, var.device), [])
            size = var.nbytes(estimate.sizes)
            for k in range(len(candidates) - 1, max(len(candidates) - 1 - CANDIDATES, -1), -1):
                buffer, freed = candidates[k]
                if max(live[freed + 1:i], default=0) + size <= estimate.peak_bytes:
                    del candidates[k]
                    planned.append((i, buffer))
                    buffer_of[op.outputs[0]] = buffer
                    live[freed + 1:i] = [b + size for b in live[freed + 1:i]]
                    break
        for name in dies_at.get(i, ()):
            buffer = buffer_of.get(name)
            if buffer is not None and all(dead_after[o] <= i for o, b in buffer_of.items() if b == buffer):
                var = program.var(buffer, block.idx)
                free.setdefault((var.shape, var.dtype, var.device), []).append((buffer, i))
    return planned


class ReuseBuffers:
    name = "reuse_buffers"
    enabled_by = "build_strategy.memory_optimize"
    summary = "matmuls and sums write their result into a temporary of the same size that just died"
    reads: tuple[str, ...] = ("build_strategy.memory_optimize",)

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        block = program.global_block
        keep = set(program.fetches.values()) | {n for other in program.blocks[1:] for op in other.ops
                                                 for n in op.inputs}
        for i, buffer in plan_reuse(program, keep):
            op = block.ops[i]
            out_type, out_keyword = OUT_KERNELS[op.type]
            op.type = out_type
            op.kwargs = {**op.kwargs, out_keyword: Ref(buffer)}
            report.count("buffers_reused")
        report.changed = bool(report.stats)
        if not report.changed:
            report.skipped_reason = ("no matmul or sum result has a dead temporary of its size, dtype and device that "
                                     "it could write into without raising the planned peak")
        return program, report
