"""Recompute policy: per forward op, whether its values may be re-run in backward, and what re-running costs.

Like JAX's checkpoint policies, this is a small object the planner asks, so a user can replace it
(`fleetc.compile(..., recompute_policy=MyPolicy())`) without touching the planner or the rewrite.
"""
from __future__ import annotations

import enum
import math

import torch

from fleetc.ir.liveness import aliased_input
from fleetc.ir.program import Block, Op, Program, VarKind
from fleetc.ir.registry import resolve_callable
from fleetc.ir.symbolic import hints, sym_value

DROPOUT = "aten.native_dropout.default"

# Ops whose re-run costs about as much as the whole rest of the forward pass.
_MATMUL_LIKE = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten.convolution.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default", "aten._scaled_dot_product_flash_attention.default",
})


class Choice(enum.Enum):
    """What the policy allows for an op's results."""

    MUST_SAVE = "must_save"  # re-running would change state or draw new random numbers
    PREFER_SAVE = "prefer_save"  # re-run only where the user asked for it (checkpoints), never in "auto"
    RECOMPUTE = "recompute"  # cheap enough to re-run whenever that saves memory


def _numel(program: Program, name: str) -> int:
    """Elements of a Var; a dynamic Program's symbolic dims count at their traced sizes (the cost model's sizes)."""
    var = program.find_var(name)
    if var is None or var.shape is None:
        return 0
    sizes = hints(program)
    if any(not isinstance(d, int) and any(s.name not in sizes for s in d.free_symbols) for d in var.shape):
        return 0
    return math.prod(sym_value(d, sizes) for d in var.shape)


class RecomputePolicy:
    """The default policy: never re-run RNG or state-writing ops, keep matmuls/convolutions in "auto".

    Dropout (`aten.native_dropout`) is the one RNG op that is replayed: its mask (1 byte per element)
    is saved and the output is recomputed as `x * mask * scale`, so gradients equal those without
    recompute. Override `choose` (and `cost`) to change what is saved.
    """

    def choose(self, program: Program, block: Block, op: Op, written_state: frozenset[str]) -> Choice:
        """`written_state`: persistables some op of the step writes; ops reading them see a different value later."""
        if op.type == DROPOUT:
            return Choice.RECOMPUTE
        if op.sub_block is not None or not op.type.startswith("aten."):
            return Choice.MUST_SAVE
        if any(program.var(n, block.idx).kind is not VarKind.TEMP for n in op.defined):
            return Choice.MUST_SAVE
        if torch.Tag.nondeterministic_seeded in resolve_callable(op.type).tags:
            return Choice.MUST_SAVE
        if any(n in written_state for n in op.inputs):
            return Choice.MUST_SAVE
        if op.type in _MATMUL_LIKE:
            return Choice.PREFER_SAVE
        return Choice.RECOMPUTE

    def cost(self, program: Program, op: Op) -> float:
        """Estimated FLOPs of re-running `op` (views cost nothing; elementwise ops one per output element)."""
        if all(aliased_input(op, j) is not None for j, n in enumerate(op.outputs) if n is not None):
            return 0.0
        outputs = sum(_numel(program, n) for n in op.defined)
        if op.type in _MATMUL_LIKE:
            return 2.0 * outputs * _contracted_size(program, op)
        return float(outputs)


def _contracted_size(program: Program, op: Op) -> int:
    """The reduced dimension of a matmul/convolution (K of M×K @ K×N; C_in·kernel for a convolution)."""
    weight = op.args[1] if op.type == "aten.convolution.default" else op.args[-1]
    var = program.find_var(getattr(weight, "name", ""))
    if var is None or not var.shape:
        return 1
    if op.type == "aten.convolution.default":
        return math.prod(d for d in var.shape[1:] if isinstance(d, int))
    return var.shape[-2] if isinstance(var.shape[-2], int) else 1
