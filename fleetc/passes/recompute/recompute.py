"""Recompute (activation checkpointing): drop forward values after forward and re-run their ops inside backward.

Which values are saved comes from a plan: user checkpoints (`recompute_configs.checkpoints`, module
paths or Var names), a min-cut (`"auto"`), or the cheapest plan within `memory_budget_mb`. The
decisions per op come from a replaceable `RecomputePolicy` (`fleetc.compile(..., recompute_policy=...)`).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Program
from fleetc.passes.base import PassReport
from fleetc.passes.recompute.auto import budget_plan, min_cut_plan
from fleetc.passes.recompute.checkpoints import checkpoint_plan
from fleetc.passes.recompute.plan import ForwardRegion, RecomputePlan, forward_region
from fleetc.passes.recompute.policy import Choice, RecomputePolicy
from fleetc.passes.recompute.rewrite import apply_plan

__all__ = ["Choice", "Recompute", "RecomputePolicy"]

_DROPOUT_NOTE = ("dropout in recomputed segments is replayed from its saved mask (1 byte per element), "
                 "as x * mask * scale, so no new random numbers are drawn and gradients match (fuse_dropout_add's "
                 "Philox form, when chosen, replays a fused dropout from its 16-byte rng state instead)")


def _trial_copy(program: Program) -> Program:
    """A copy `apply_plan` may rewrite, much cheaper than `clone()`: it replaces op lists, Vars and op
    arguments but never mutates an existing Var, argument or attribute, so those are shared."""
    trial = copy.copy(program)
    trial.blocks = [dataclasses.replace(b, ops=[copy.copy(op) for op in b.ops], vars=dict(b.vars))
                    for b in program.blocks]
    return trial


class Recompute:
    name = "recompute"
    enabled_by = 'recompute'
    summary = "free forward values after forward and re-run the forward ops that made them inside backward"
    reads = ("recompute", "recompute_configs.checkpoints", "recompute_configs.memory_budget_mb")

    def __init__(self, policy: RecomputePolicy | None = None):
        self.policy = policy if policy is not None else RecomputePolicy()

    def _estimate_peak(self, program: Program, plan: RecomputePlan) -> int:
        """Estimated peak bytes of `plan` applied to a trial copy of `program`."""
        trial = _trial_copy(program)
        apply_plan(forward_region(trial, self.policy), plan, self.policy)
        return estimate_memory(trial).peak_bytes

    def _plan(self, program: Program, region: ForwardRegion, config: Any) -> RecomputePlan:
        checkpoints = config.recompute_configs.checkpoints
        budget_mb = config.recompute_configs.memory_budget_mb
        if checkpoints not in ((), "auto"):
            return checkpoint_plan(region, checkpoints)
        if budget_mb is not None:
            return budget_plan(region, self.policy, budget_mb, lambda p: self._estimate_peak(program, p))
        return min_cut_plan(region)

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        region = forward_region(program, self.policy)
        if region.end == len(region.block.ops):
            report.skipped_reason = "the Program has no backward ops (an evaluation step), so nothing to recompute"
            return program, report
        peak_before = estimate_memory(program).peak_bytes
        plan = self._plan(program, region, config)
        stats = apply_plan(region, plan, self.policy)
        peak_after = estimate_memory(program).peak_bytes
        report.stats.update(peak_bytes_before=peak_before, peak_bytes_after=peak_after,
                            ops_recomputed=stats.ops_recomputed, dropouts_replayed=stats.dropouts_replayed,
                            recompute_mflops=round(stats.recompute_flops / 1e6), checkpoints=len(plan.checkpoints),
                            kept_across_boundaries=len(plan.kept_across))
        report.notes += plan.notes
        report.reused_blocks += plan.reused_blocks
        if stats.dropouts_replayed:
            report.notes.append(_DROPOUT_NOTE)
        budget_mb = config.recompute_configs.memory_budget_mb
        if budget_mb is not None and peak_after > budget_mb * 2**20:
            report.notes.append(f"estimated peak {peak_after / 2**20:.2f} MiB exceeds memory_budget_mb={budget_mb:g} "
                                "with the given checkpoints")
        report.changed = stats.ops_recomputed > 0
        if not report.changed:
            report.skipped_reason = (f"plan '{plan.label}' leaves nothing to recompute: "
                                     "every value backward reads is saved")
        return program, report
