"""`fuse_all_reduce_ops`: gradient allreduces grouped into buckets, one flat buffer and one collective per bucket.

Gradients are taken in the order backward produces them (reverse layer order) and grouped by dtype.
A bucket closes at `fuse_grad_size_in_MB` or at `fuse_grad_size_in_TFLOPS` gradients (Paddle uses
that field as a count); the first bucket of each dtype closes at `last_comm_group_size_MB`, so the
first collective starts early in backward. A bucket is issued right after its last gradient is
produced; buckets go to the `nccl_comm_num` communicators round-robin. An op that reads a gradient
before its bucket is issued (a view of it, say) moves down past the bucket's wait, so it
reads the averaged gradient, as it does without fusion. Under gradient merge the accumulators'
allreduces in the update block are bucketed the same way (passes/allreduce_merged.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetc.ir.liveness import block_reads
from fleetc.ir.program import Op, Program
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel.allreduce import (
    ALLOC,
    SINGLE_PROCESS,
    START,
    WAIT,
    allreduce_ops,
    data_parallel_world,
)
from fleetc.passes.data_parallel.merged import (
    insert_update_block_allreduces,
    merged_values,
    note_moved,
    update_block_allreduces,
)

MB = 1 << 20


@dataclass
class Bucket:
    dtype: str
    grads: list[str] = field(default_factory=list)
    nbytes: int = 0


def plan_buckets(grads: list[tuple[str, str, int]], cap_bytes: float, first_cap_bytes: float,
                 max_grads: int) -> list[Bucket]:
    """Buckets of (name, dtype, bytes) gradients given in production order, in the order they close."""
    closed: list[Bucket] = []
    open_by_dtype: dict[str, Bucket] = {}
    closed_dtypes: set[str] = set()
    for name, dtype, nbytes in grads:
        bucket = open_by_dtype.setdefault(dtype, Bucket(dtype))
        cap = cap_bytes if dtype in closed_dtypes else first_cap_bytes
        if bucket.grads and (bucket.nbytes + nbytes > cap or len(bucket.grads) >= max_grads):
            closed.append(bucket)
            closed_dtypes.add(dtype)
            bucket = open_by_dtype[dtype] = Bucket(dtype)
        bucket.grads.append(name)
        bucket.nbytes += nbytes
    last_grad_position = {name: i for i, (name, _, _) in enumerate(grads)}
    leftovers = sorted(open_by_dtype.values(), key=lambda b: last_grad_position[b.grads[-1]])
    return sorted(closed + leftovers, key=lambda b: last_grad_position[b.grads[-1]])


def _writes(program: Program, op: Op) -> set[str]:
    """Vars an op defines, including inside its sub-block (recursively)."""
    names = set(op.defined)
    if op.sub_block is not None:
        for inner in program.blocks[op.sub_block].ops:
            names |= _writes(program, inner)
    return names


class _Deferred:
    """Ops that read a gradient before its bucket is issued must read the averaged gradient, as without fusion.

    They move down, with every op that depends on them, to just before the first later op that conflicts with
    them once their buckets are issued (or to the end of the block), so the waits still move no earlier than
    needed (overlap).
    """

    def __init__(self, program: Program):
        self.program = program
        self.ops: list[Op] = []
        self.defined: set[str] = set()  # what deferred ops define: later readers and writers conflict
        self.read: set[str] = set()  # what deferred ops read: later writers (of persistables) conflict

    def place(self, op: Op, waiting: set[str]) -> list[Op]:
        """The ops to append now for `op`: none while it has to wait, else any deferred ops it needs, then itself."""
        reads, writes = set(block_reads(self.program, op)), _writes(self.program, op)
        conflicts = self.defined & (reads | writes) or self.read & writes
        if reads & waiting or (conflicts and not self.ready(waiting)):
            self.ops.append(op)
            self.defined |= writes
            self.read |= reads
            return []
        return [*self.flush(), op] if conflicts else [op]

    def ready(self, waiting: set[str]) -> bool:
        return not any(waiting.intersection(block_reads(self.program, op)) for op in self.ops)

    def flush(self) -> list[Op]:
        ops, self.ops = self.ops, []
        self.defined.clear()
        self.read.clear()
        return ops


class FuseAllreduce:
    name = "fuse_all_reduce_ops"
    enabled_by = None  # always in the order: it decides for itself whether there is work
    summary = "bucket gradient allreduces: one flat buffer and one collective per bucket"
    reads = ("fuse_all_reduce_ops", "fuse_grad_size_in_MB", "fuse_grad_size_in_TFLOPS", "last_comm_group_size_MB",
             "nccl_comm_num")

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        if data_parallel_world(program) == 1:
            report.skipped_reason = SINGLE_PROCESS
            return program, report
        if not config.fuse_all_reduce_ops:
            report.skipped_reason = "fuse_all_reduce_ops is off: one allreduce per gradient"
            return program, report
        self._fuse_update_block(program, config, report)
        block = program.global_block
        starts = [op for op in block.ops if op.type == START]
        waits = {op.args[1].name: op for op in block.ops if op.type == WAIT}
        allocs = {op.outputs[0]: op for op in block.ops if op.type == ALLOC}
        if len(starts) < 2:
            if not report.changed:
                report.skipped_reason = "fewer than two gradient allreduces: nothing to fuse"
            return program, report
        grad_of_start = {s.name: waits[s.outputs[0]].outputs[0] for s in starts}
        order = [(grad_of_start[s.name], block.vars[grad_of_start[s.name]].dtype,
                  block.vars[grad_of_start[s.name]].nbytes()) for s in starts]
        buckets = plan_buckets(order, config.fuse_grad_size_in_MB * MB, config.last_comm_group_size_MB * MB,
                               config.fuse_grad_size_in_TFLOPS)
        algorithm = starts[0].args[4]
        start_of_grad = {grad_of_start[s.name]: s for s in starts}
        removed = {op.name for s in starts for op in (allocs[s.args[0].name], s, waits[s.outputs[0]])}
        for s in starts:
            del block.vars[s.args[0].name], block.vars[s.outputs[0]]
        issue_after: dict[str, list[Op]] = {}
        for index, bucket in enumerate(buckets):
            bucket_ops = allreduce_ops(program, bucket.grads, index % config.nccl_comm_num, algorithm, f"bucket{index}",
                                  self.name)
            issue_after.setdefault(start_of_grad[bucket.grads[-1]].name, []).extend(bucket_ops)
            report.count("buckets")
            report.count("gradients", len(bucket.grads))
        ops: list[Op] = []
        waiting: set[str] = set()  # gradients produced whose bucket is not issued yet
        deferred = _Deferred(program)
        for op in block.ops:
            if op.name in removed:
                if op.type == START:
                    waiting.add(grad_of_start[op.name])
            else:
                placed = deferred.place(op, waiting)
                if not placed:
                    report.count("ops_deferred")
                ops.extend(placed)
            for new_op in issue_after.get(op.name, ()):
                ops.append(new_op)
                if new_op.type == WAIT:
                    waiting.difference_update(new_op.outputs)
        ops.extend(deferred.flush())
        block.ops = ops
        report.stats["allreduces_before"] = report.stats.get("allreduces_before", 0) + len(starts)
        report.changed = True
        _note_limits(report, config)
        return program, report

    def _fuse_update_block(self, program: Program, config: Any, report: PassReport) -> None:
        """Bucket gradient merge's allreduces of its accumulators in the update block, in gradient production order."""
        starts = update_block_allreduces(program)
        if len(starts) < 2:
            return
        merged = merged_values(program)
        order = [(value, program.var(value).dtype, program.var(value).nbytes()) for value in merged]
        buckets = plan_buckets(order, config.fuse_grad_size_in_MB * MB, config.last_comm_group_size_MB * MB,
                               config.fuse_grad_size_in_TFLOPS)
        insert_update_block_allreduces(program, [b.grads for b in buckets], config.nccl_comm_num, starts[0].args[4],
                                       self.name)
        report.count("buckets", len(buckets))
        report.count("gradients", len(merged))
        report.stats["allreduces_before"] = len(starts)
        note_moved(program, report, len(buckets))
        report.changed = True
        _note_limits(report, config)


def _note_limits(report: PassReport, config: Any) -> None:
    """The bucket limits in force, so a changed limit shows in the report even when the buckets come out the same."""
    note = (f"a bucket closes at fuse_grad_size_in_MB={config.fuse_grad_size_in_MB} MB or "
            f"fuse_grad_size_in_TFLOPS={config.fuse_grad_size_in_TFLOPS} gradients; the first of each dtype at "
            f"last_comm_group_size_MB={config.last_comm_group_size_MB} MB")
    if note not in report.notes:
        report.notes.append(note)

