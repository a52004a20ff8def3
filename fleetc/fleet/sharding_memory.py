"""Per-rank memory under sharding: what a rank holds, measured, beside the ZeRO formula for the same setting.

Ψ parameters, N ranks in the sharding group. Bytes per parameter element, (parameter, gradient, optimizer
state): fp32 Adam/AdamW (4, 4, 8), `use_pure_fp16` Adam/AdamW (2, 2, 12: fp32 master + two moments), fp32 SGD
with momentum (4, 4, 4), plain SGD (4, 4, 0). Stage 1 divides the optimizer state by N, stage 2 the gradients
too, stage 3 the parameters too (so fp32 Adam: 16Ψ → 8Ψ + 8Ψ/N → 4Ψ + 12Ψ/N → 16Ψ/N). Gradient-merge
accumulators come on top and are reported apart, and so are stage 3's parameters gathered in flight (the
two largest gathered buckets: the one in use and the one prefetched). Under a pipeline every figure is this rank's
pipeline stages' (Ψ: their parameters), as each stage is sharded over its own group. Measured: parameters and
optimizer state from the live tensors; gradients from the compiled Program (what the rank keeps for its update:
every gradient, or under stage 2 its shards).

Under use_pure_fp16 gradients are averaged and kept in the parameters' low precision, as Paddle and torch DDP
communicate them (passes/data_parallel/low_precision.py), so the row's 2 bytes per gradient element hold; the float32
cast the master update reads is taken per parameter in the update section, after the average (not kept).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fleetc.ir.program import Program, Var, VarKind
from fleetc.passes.pipeline_parallel.partition import PipelinePlan
from fleetc.passes.pipeline_parallel.stage3 import GATHER_PHASE, gathered_bytes
from fleetc.passes.sharding.param_sharding import gathered_buffer_bytes

_STATE_BYTES = {"Adam": 8, "AdamW": 8, "SGD": 4}  # per element, fp32 moments / momentum buffer
MASTER_BYTES = 4


def formula_bytes(optimizer: torch.optim.Optimizer, numel: int, degree: int, stage: int, low_precision: bool) -> int:
    """The ZeRO formula's per-rank bytes of parameters + gradients + optimizer state (SGD without momentum keeps
    none; an optimizer outside the table counts as stateless)."""
    kind = type(optimizer).__name__
    state = _STATE_BYTES.get(kind, 0)
    if kind == "SGD" and not any(group.get("momentum") for group in optimizer.param_groups):
        state = 0
    weight = 2 if low_precision else 4
    state += MASTER_BYTES if low_precision else 0
    grads = weight * numel / (degree if stage >= 2 else 1)
    params = weight * numel / (degree if stage >= 3 else 1)
    return round(params + grads + state * numel / degree)


def kept_gradients(program: Program, reduce_scatter_wait: str, grads: dict[str, str] | None = None) -> list[Var]:
    """The gradients the rank keeps for its update: its reduce-scattered shards, else every gradient (`grads`:
    parameter → gradient name, where the Program's metadata does not say, as in a pipeline stage's Program)."""
    shards = [program.var(op.outputs[0]) for _, op in program.walk_ops() if op.type == reduce_scatter_wait]
    if shards:
        return shards
    grads = grads or program.metadata.get("optimizer", {}).get("grads", {})
    return [v for name in grads.values() if (v := program.find_var(name)) is not None]


def gather_buffer_bytes(program: Program) -> int:
    """Stage 3's parameters in flight: the two largest gathered buckets (the one in use and the one prefetched)."""
    return sum(sorted(gathered_buffer_bytes(program))[-2:])


def per_rank_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, programs: list[Program], degree: int,
                   stage: int, reduce_scatter_wait: str, whole_numel: int | None = None,
                   held: set[str] | None = None, in_flight: int | None = None,
                   grads: dict[str, str] | None = None) -> dict[str, Any]:
    """This rank's parameter, gradient and optimizer-state bytes, and the formula's total for comparison.
    `programs`: those whose kept gradients and accumulators count (the training Program; under a pipeline this
    rank's stages' optimizer Programs). `held`: the parameters that make Ψ (None: every one; under a pipeline this
    rank's stages'). `whole_numel`: Ψ under stage 3, where the module holds only this rank's pieces. `in_flight`:
    the stage-3 bytes gathered in flight, when not the training Program's two largest gathered buckets. `grads`:
    parameter → gradient name, for Programs whose metadata does not say (`kept_gradients`)."""
    params = [p for name, p in model.named_parameters() if held is None or name in held]
    numel = sum(p.numel() for p in params) if whole_numel is None else whole_numel
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    ids = {id(p) for p in params}
    state_bytes = sum(t.numel() * t.element_size() for p, slot in optimizer.state.items() if id(p) in ids
                      for t in slot.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    kept = [v for program in programs for v in kept_gradients(program, reduce_scatter_wait, grads)]
    grads = sum(v.nbytes() for v in kept)
    low = any(p.dtype in (torch.float16, torch.bfloat16) for p in params)
    accumulators = sum(v.nbytes() for program in programs for v in program.persistables()
                       if v.kind is VarKind.ACCUMULATOR)
    if in_flight is None:
        in_flight = sum(gather_buffer_bytes(program) for program in programs)
    return {"stage": stage, "degree": degree, "parameters": numel, "parameter_bytes": param_bytes,
            "gradient_bytes": grads, "optimizer_state_bytes": state_bytes,
            "total_bytes": param_bytes + grads + state_bytes,
            "formula_bytes": formula_bytes(optimizer, numel, degree, stage, low),
            "merge_accumulator_bytes": accumulators, "gathered_in_flight_bytes": in_flight}


def stage_share(program: Program, plan: PipelinePlan, chunks: list[int],
                shapes: dict[str, torch.Size]) -> dict[str, Any]:
    """Under a pipeline, `per_rank_bytes`'s view of this rank's stages `chunks` of the training `program`: Ψ is their
    parameters (`shapes`: every parameter's whole shape), their optimizer Programs keep the averaged gradients (or
    shards of them), and under stage 3 their gather Programs' buffers are in flight (each stage's whole parameters,
    from its first forward to its last backward)."""
    stages = [plan.stages[s] for s in chunks]
    held = {name for stage in stages for name in stage.params if name in shapes}
    grads = program.metadata.get("optimizer", {}).get("grads", {})
    return {"programs": [stage.phases["optimizer"] for stage in stages], "held": held,
            "grads": {param: grad for param, grad in grads.items() if param in held},
            "whole_numel": sum(shapes[name].numel() for name in held),
            "in_flight": sum(gathered_bytes(stage.phases[GATHER_PHASE]) for stage in stages
                             if GATHER_PHASE in stage.phases)}
