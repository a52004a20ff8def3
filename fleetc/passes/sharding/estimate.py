"""Every rank's sharding plan and memory, computed from one data-parallel Program without any process.

Ownership depends only on sizes, names and the gradient buckets (plan.py), which are the same on every rank,
so the plan of a world size this machine cannot run (64 ranks, say) is computed here, before anything is
launched: which parameters each rank owns, and its parameter, gradient and optimizer-state bytes (stage 3:
only its own parameters, or its flat pieces of them; what it gathers in flight comes on top).
"""
from __future__ import annotations

from dataclasses import dataclass

from fleetc.ir.program import Program, Var, VarKind
from fleetc.passes.data_parallel.common import var_numel
from fleetc.passes.data_parallel.merged import merged_values
from fleetc.passes.sharding.flat_params import flat_params_refusal, parameter_buckets
from fleetc.passes.sharding.flat_sharding import (
    flat_refusal,
    gradient_buckets,
    rank_pieces,
)
from fleetc.passes.sharding.optimizer_sharding import update_ops
from fleetc.passes.sharding.param_sharding import parameter_owners
from fleetc.passes.sharding.plan import FlatBucket, ShardedBucket, assign_owners


@dataclass(frozen=True)
class RankPlan:
    rank: int
    owned_params: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    gathered_in_flight_bytes: int = 0  # stage 3: parameters gathered at most at once, on top of total_bytes

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes


def rank_plans(program: Program, degree: int, stage: int, segment_mb: float = 32.0) -> list[RankPlan]:
    """The plan of each rank of a sharding group of `degree`, from a data-parallel Program not yet sharded
    (`segment_mb`: `sharding_configs.segment_broadcast_MB`, stage 3's parameter buckets)."""
    params = list(dict.fromkeys(op.attrs["param"] for ops in update_ops(program).values() for op in ops))
    sizes = {p: var_numel(program.var(p)) for p in params}
    # stage 3 owning whole parameters under gradient merge keeps whole gradients (its accumulators are allreduced)
    buckets = [] if stage < 2 or (stage == 3 and merged_values(program)) else gradient_buckets(program)
    flat = [FlatBucket.of(b, sizes, degree) for b in buckets] \
        if stage == 2 and flat_refusal(program, update_ops(program), buckets, params) is None else None
    owners = parameter_owners(program, degree) if stage == 3 else assign_owners(sizes, degree, buckets or None)
    state: dict[str, int] = {}  # per element of the parameter, summed over its state: (whole-shaped, fixed) bytes
    fixed: dict[str, int] = {}
    for name, (param, _) in program.metadata.get("state_bindings", {}).items():
        var = program.find_var(name)
        if var is not None and var.kind is VarKind.OPTIMIZER_STATE:
            if var.shape and tuple(var.shape) == tuple(program.var(param).shape):
                state[param] = state.get(param, 0) + var.nbytes()
            else:
                fixed[param] = fixed.get(param, 0) + var.nbytes()
    param_vars = [v for v in program.persistables() if v.kind is VarKind.PARAM]
    grad_vars = {p: program.find_var(f"{p}@GRAD") or program.var(p) for p in params}  # AMP: maybe low precision
    grad_bytes = sum(v.nbytes() for v in grad_vars.values())
    plans = []
    if stage == 3 and flat_params_refusal(program, update_ops(program)) is None:
        return _flat_params_plans(program, degree, segment_mb, sizes, state, fixed, grad_vars)
    for rank in range(degree):
        if flat is not None:  # stage 2 on flat buckets: the state of this rank's pieces
            pieces = rank_pieces(flat, rank)
            grads = sum(b.segment * grad_vars[b.names[0]].nbytes() // sizes[b.names[0]] for b in flat)
            held = sum(v.nbytes() for v in param_vars)
            kept = sum(state.get(p, 0) * (hi - lo) // sizes[p] + fixed.get(p, 0) for p, (lo, hi) in pieces.items())
            plans.append(RankPlan(rank, len(pieces), held, grads, kept))
            continue
        mine = [p for p in params if owners[p] == rank]
        if buckets:
            grads = sum(ShardedBucket.of(b, owners, sizes, degree).segment * grad_vars[b[0]].nbytes() // sizes[b[0]]
                        for b in buckets)
        else:
            grads = grad_bytes
        held = sum(v.nbytes() for v in param_vars if stage < 3 or owners[v.name] == rank)  # stage 3: its own only
        plans.append(RankPlan(rank, len(mine), held, grads, sum(state.get(p, 0) + fixed.get(p, 0) for p in mine)))
    return plans


def _flat_params_plans(program: Program, degree: int, segment_mb: float, sizes: dict[str, int],
                       state: dict[str, int], fixed: dict[str, int], grad_vars: dict[str, Var]) -> list[RankPlan]:
    """Stage 3 on flat parameter buckets (flat_params.py): each rank holds its piece of every bucket, the gradient
    shard of each bucket with updated parameters, and the state of its pieces of them."""
    buckets = parameter_buckets(program, degree, segment_mb, set(sizes))
    element = {v.name: v.nbytes() // max(var_numel(v), 1) for v in program.persistables() if v.kind is VarKind.PARAM}
    # Each bucket is gathered whole (padded) in the forward and again in the backward; at most two gathered buckets
    # are live, the one in use and the one prefetched (the trainer's `gathered_in_flight_bytes`).
    gathered = sorted(b.segment * degree * element[b.names[0]] for b in buckets for _ in ("forward", "backward"))
    in_flight = sum(gathered[-2:])
    plans = []
    for rank in range(degree):
        pieces = rank_pieces(buckets, rank)
        held = sum((hi - lo) * element[p] for p, (lo, hi) in pieces.items())
        grads = sum(b.segment * grad_vars[b.names[0]].nbytes() // sizes[b.names[0]] for b in buckets
                    if b.names[0] in sizes)
        updated = {p: piece for p, piece in pieces.items() if p in sizes}
        kept = sum(state.get(p, 0) * (hi - lo) // sizes[p] + fixed.get(p, 0) for p, (lo, hi) in updated.items())
        plans.append(RankPlan(rank, len(updated), held, grads, kept, in_flight))
    return plans
