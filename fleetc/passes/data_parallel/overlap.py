"""Overlap gradient allreduces with backward: each wait moves down to just before the first op that reads its result.

With `sync_nccl_allreduce=True` (Paddle's default) every wait stays right after its start, so
the result is ready immediately; with False the collective runs on the communicator's thread
while the rest of backward computes.
"""
from __future__ import annotations

from typing import Any

from fleetc.ir.liveness import block_reads
from fleetc.ir.program import Op, Program
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel.allreduce import (
    SINGLE_PROCESS,
    WAIT,
    data_parallel_world,
)
from fleetc.passes.data_parallel.merged import skip_reason as merged_skip_reason


class OverlapAllreduce:
    name = "overlap_allreduce"
    enabled_by = None  # always in the order: it decides for itself whether there is work
    summary = "wait for each gradient allreduce just before its first consumer, not right after issuing it"
    reads = ("sync_nccl_allreduce",)

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        if data_parallel_world(program) == 1:
            report.skipped_reason = SINGLE_PROCESS
            return program, report
        if config.sync_nccl_allreduce:
            report.skipped_reason = "sync_nccl_allreduce is on: each allreduce is waited on right after it is issued"
            return program, report
        block = program.global_block
        waits = [op for op in block.ops if op.type == WAIT]
        rest = [op for op in block.ops if op.type != WAIT]
        before: dict[int, list[Op]] = {}
        for wait in waits:
            outputs = set(wait.defined)
            first_reader = next((i for i, op in enumerate(rest) if outputs & set(block_reads(program, op))), len(rest))
            before.setdefault(first_reader, []).append(wait)
            report.count("waits_moved")
        block.ops = [op for i in range(len(rest) + 1) for op in (*before.get(i, ()), *rest[i:i + 1])]
        report.changed = bool(waits)
        if not waits:
            report.skipped_reason = merged_skip_reason(program) or "the Program has no gradient allreduces"
        return program, report
