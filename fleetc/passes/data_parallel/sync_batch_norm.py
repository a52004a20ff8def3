"""`sync_batch_norm`: training-mode batch norms use statistics over every data-parallel rank's samples.

Each captured `_native_batch_norm_legit_functional` (training) and its `native_batch_norm_backward`
become `fleetc.sync_batch_norm` / `fleetc.sync_batch_norm_backward` (role collective as well), with
the same arguments and outputs, so the rest of the Program is untouched.
"""
from __future__ import annotations

from typing import Any

from fleetc.comm import sync_batch_norm_ops  # noqa: F401  (registers the op types)
from fleetc.ir.program import OpRole, Program
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel.allreduce import SINGLE_PROCESS, data_parallel_world

FORWARD = "aten._native_batch_norm_legit_functional.default"
BACKWARD = "aten.native_batch_norm_backward.default"


class SyncBatchNorm:
    name = "sync_batch_norm"
    enabled_by = None  # always in the order: it decides for itself whether there is work
    summary = "batch-norm statistics and their gradients reduced across data-parallel ranks"
    reads = ("sync_batch_norm",)

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        if not config.sync_batch_norm:
            return program, report
        if data_parallel_world(program) == 1:
            report.skipped_reason = SINGLE_PROCESS
            return program, report
        for _, op in program.walk_ops():
            if op.type == FORWARD and op.args[5]:
                x, weight, bias, running_mean, running_var, _, momentum, eps = op.args
                op.type = "fleetc.sync_batch_norm"
                op.args = (x, weight, bias, running_mean, running_var, momentum, eps, op.module_path or op.name)
            elif op.type == BACKWARD and op.args[7]:
                grad_out, x, weight, _, _, save_mean, save_invstd, _, _, mask = op.args
                op.type = "fleetc.sync_batch_norm_backward"
                op.args = (grad_out, x, weight, save_mean, save_invstd, mask, op.module_path or op.name)
            else:
                continue
            op.attrs["op_role"] = int(op.role | OpRole.COLLECTIVE)
            op.attrs["provenance"] = self.name
            report.count("batch_norms_synced" if op.type == "fleetc.sync_batch_norm" else "backwards_synced")
        report.changed = bool(report.stats)
        if not report.changed:
            report.skipped_reason = "the Program has no training-mode batch norm"
        return program, report
