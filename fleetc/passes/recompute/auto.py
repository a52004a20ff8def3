"""Chooses what to save without user checkpoints: a min-cut over the forward graph, and a memory-budget search.

The min-cut follows AOTAutograd's partitioner: every forward value is an edge `v_in → v_out` whose
capacity is the bytes saving it costs; values the policy will not re-run hang off the source,
values read after forward feed the sink. The cheapest cut is the smallest set of saved bytes from
which everything backward needs can be recomputed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import networkx as nx

from fleetc.errors import PassStrategyError
from fleetc.ir.block_copies import reuse_enabled
from fleetc.ir.liveness import aliased_input
from fleetc.ir.symbolic import hints
from fleetc.passes.recompute.checkpoints import checkpoint_plan, module_outputs
from fleetc.passes.recompute.pieces import cut_by_pieces
from fleetc.passes.recompute.plan import ForwardRegion, RecomputePlan, recompute_cost
from fleetc.passes.recompute.policy import Choice, RecomputePolicy

# Saving a view of a temporary keeps its base alive: forbid cutting at the view, so the cut lands on the base.
_UNCUTTABLE = 2 ** 62


def _save_cost(region: ForwardRegion, name: str) -> int:
    """Bytes that saving `name` keeps alive: 0 for views of state or inputs, its own bytes otherwise."""
    op = region.producer[name]
    base = aliased_input(op, op.outputs.index(name))
    if base is None:
        return region.program.var(name).nbytes(hints(region.program))  # a dynamic Program: at its traced sizes
    return _UNCUTTABLE if base in region.producer else 0


def flow_network(region: ForwardRegion) -> nx.DiGraph:
    """The flow network of the forward values (module docstring); edges without capacity are unbounded."""
    graph = nx.DiGraph()
    graph.add_nodes_from(("source", "sink"))
    for name, op in region.producer.items():
        choice = region.choices[op.name]
        if region.must_save(name) or choice is Choice.PREFER_SAVE:
            graph.add_edge("source", f"{name}_in")
        graph.add_edge(f"{name}_in", f"{name}_out", capacity=_save_cost(region, name))
        for source in region.recompute_inputs(op):
            if source != name:
                graph.add_edge(f"{source}_out", f"{name}_in")
        if name in region.read_after:
            graph.add_edge(f"{name}_out", "sink")
    return graph


def min_cut_plan(region: ForwardRegion) -> RecomputePlan:
    """Save the fewest bytes without re-running what the policy marks MUST_SAVE or PREFER_SAVE (matmuls); with
    reuse of repeated blocks, the same cut solved once per distinct piece of the blocks (pieces.py)."""
    graph = flow_network(region)
    reused_blocks: list[str] = []
    if reuse_enabled("recompute"):
        cut, copies = cut_by_pieces(region, graph)
        saved_bytes, reachable = cut.capacity, cut.source_side
        reused_blocks = cut.lines(copies)
    else:
        saved_bytes, (reachable, _) = nx.minimum_cut(graph, "source", "sink")
    saved = frozenset(n for n in region.producer if f"{n}_in" in reachable)
    return RecomputePlan(saved, label="auto", reused_blocks=reused_blocks,
                         notes=[f"auto: the min-cut keeps {saved_bytes} bytes of forward values for backward"])


def repeated_blocks(region: ForwardRegion) -> list[str]:
    """Module paths of the longest run of numbered siblings (`layers.0`, `layers.1`, …), in forward order."""
    outputs = module_outputs(region)
    runs: dict[str, list[str]] = {}
    for module in outputs:
        match = re.fullmatch(r"(.*\.)?(\d+)", module)
        if match:
            runs.setdefault(match.group(1) or "", []).append(module)
    if not runs:
        return []
    longest = max(runs.values(), key=len)
    return sorted(longest, key=lambda m: region.index[region.producer[outputs[m]].name])


def block_checkpoints(region: ForwardRegion) -> list[tuple[str, tuple[str, ...]]]:
    """(label, checkpoints) of the repeated-block plans: after every k-th block (k ≈ √n is the classic sqrt(n)
    plan), and after each of the first m blocks only (the last n − m blocks keep their activations: less re-run
    compute, a higher peak)."""
    blocks = repeated_blocks(region)
    n = len(blocks)
    every = [(f"checkpoints every {k} of {n} blocks", tuple(blocks[k - 1::k])) for k in range(1, n + 1)]
    return every + [(f"checkpoints after each of the first {m} of {n} blocks", tuple(blocks[:m]))
                    for m in range(1, n - 1)]


def _labelled(plan: RecomputePlan, label: str) -> RecomputePlan:
    plan.label = label
    return plan


@dataclass
class Candidate:
    """A plan with its re-run cost (estimated FLOPs) and, once evaluated, its estimated peak bytes; `checkpoints`
    rebuilds a repeated-block plan with its notes once it is chosen (candidates are built without them)."""

    plan: RecomputePlan
    recompute_flops: float
    peak_bytes: int | None = None
    checkpoints: tuple[str, ...] | None = None


def budget_plan(region: ForwardRegion, policy: RecomputePolicy, budget_mb: float,
                estimate_peak: Callable[[RecomputePlan], int]) -> RecomputePlan:
    """The plan re-running the fewest FLOPs whose estimated peak is within `budget_mb` MiB.

    Candidates: no recompute, the min-cut plan, and the repeated-block checkpoint plans (`block_checkpoints`).
    They are tried cheapest first; `estimate_peak` applies one to a copy of the Program and returns its
    estimated peak, so the search stops at the first plan that fits. With n repeated blocks there are about 2n
    candidates, each built, costed and (at worst) tried in time linear in the region: the search is quadratic in
    depth (tests/test_compile_scaling.py bounds it), where planning per distinct block would make it linear.
    """
    no_recompute = RecomputePlan(frozenset(region.producer), label="no recompute")
    candidates = [Candidate(plan, recompute_cost(region, plan, policy)) for plan in (no_recompute,
                                                                                     min_cut_plan(region))]
    for label, checkpoints in block_checkpoints(region):
        plan = _labelled(checkpoint_plan(region, checkpoints, explain=False), label)
        candidates.append(Candidate(plan, recompute_cost(region, plan, policy), checkpoints=checkpoints))
    candidates.sort(key=lambda c: c.recompute_flops)
    for candidate in candidates:
        candidate.peak_bytes = estimate_peak(candidate.plan)
        if candidate.peak_bytes <= budget_mb * 2**20:
            if candidate.checkpoints is not None:
                candidate.plan = _labelled(checkpoint_plan(region, candidate.checkpoints), candidate.plan.label)
            tried = [c for c in candidates if c.peak_bytes is not None]
            candidate.plan.notes.append(
                f"memory budget {budget_mb:g} MiB: chose '{candidate.plan.label}' (estimated peak "
                f"{candidate.peak_bytes / 2**20:.2f} MiB, {candidate.recompute_flops:.3g} FLOPs re-run); tried "
                "cheapest first: " + ", ".join(f"'{c.plan.label}' {c.peak_bytes / 2**20:.2f} MiB" for c in tried))
            return candidate.plan
    best = min(candidates, key=lambda c: c.peak_bytes)
    raise PassStrategyError(
        f"recompute_configs.memory_budget_mb={budget_mb:g}: no recompute plan fits; the smallest "
        f"estimated peak fleetc can reach is {best.peak_bytes / 2**20:.2f} MiB ({best.plan.label})")
