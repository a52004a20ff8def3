"""Which random-number form a fused dropout takes, and the rewrite of a fused group into the Philox form.

Two forms of `dropout(x) + residual`:
- mask: `fleetc.fused_dropout_add` draws aten native_dropout's bool mask (1 byte per element) and keeps
  it for the backward. On CPU it draws the generator exactly as eager dropout does, so compiled
  training matches eager under the same seed.
- philox: `fleetc.fused_dropout_add_philox` records `rng_state = [seed, offset]` (16 bytes); the
  gradient and recompute's replay regenerate the same keep mask from it (`fleetc.philox_dropout_mul`),
  in registers inside a Triton kernel on CUDA.

The decision lives in one overridable object, `DropoutRngChoice`: pass an instance to
`FuseDropoutAdd(rng_choice)` or install one for every compile with `set_dropout_rng_choice`.
"""
from __future__ import annotations

import torch

from fleetc.ir.liveness import block_reads
from fleetc.ir.program import Op, Program, Ref, Var, VarKind
from fleetc.ops.dropout_philox import dropout_scale, is_training

MASK_FORM = "fleetc.fused_dropout_add"
PHILOX_FORM = "fleetc.fused_dropout_add_philox"
PHILOX_MUL = "fleetc.philox_dropout_mul"
# Readers of a dropout mask that the Philox form can serve: `t * mask * scale` ops, by where `scale` comes from.
_MASK_BACKWARDS = ("fleetc.fused_dropout_add_grad", "aten.native_dropout_backward.default")  # (dout, mask, scale)
_MASK_REPLAY = "fleetc.dropout_replay"  # recompute: (x, mask, p, train), scale 1 / (1 - p)


class DropoutRngChoice:
    """The default: the Philox form where the dropped tensor lives on CUDA (its Triton kernel regenerates
    the mask), the mask form elsewhere (CPU runs then match eager dropout). Override `use_philox`."""

    def use_philox(self, program: Program, dropped: Var) -> bool:
        return torch.device(dropped.device).type == "cuda"


class AlwaysPhilox(DropoutRngChoice):
    """The Philox form on every device (e.g. to exercise it on CPU, where its reference runs)."""

    def use_philox(self, program: Program, dropped: Var) -> bool:
        return True


_current_choice = DropoutRngChoice()


def current_rng_choice() -> DropoutRngChoice:
    return _current_choice


def set_dropout_rng_choice(choice: DropoutRngChoice) -> DropoutRngChoice:
    """Install the choice that FuseDropoutAdd uses by default; returns the previous one (to restore it)."""
    global _current_choice
    previous, _current_choice = _current_choice, choice
    return previous


def to_philox(program: Program, fused: Op) -> str | None:
    """Rewrite one `fleetc.fused_dropout_add` and every reader of its mask into the Philox form, in place;
    or say why not (Program untouched)."""
    x, _, p, train = fused.args
    mask = fused.outputs[1]
    rng_state = program.unique_name(f"{mask or fused.name}@RNG_STATE")
    if mask in program.fetches.values():
        return "its mask is fetched"
    rewrites: list[tuple[Op, tuple]] = []
    for block in program.blocks:
        for op in block.ops:
            if mask is None or mask not in block_reads(program, op):
                continue
            args = _philox_args(op, mask, Ref(rng_state), p, train)
            if args is None:
                return f"its mask is also read by {op.name} ({op.type}), which has no Philox form"
            rewrites.append((op, args))
    if mask is not None:
        program.global_block.add_var(Var(rng_state, (2,), "int64", program.var(x.name).device, VarKind.TEMP))
        del program.global_block.vars[mask]
    fused.type, fused.outputs = PHILOX_FORM, [fused.outputs[0], rng_state if mask is not None else None]
    for op, args in rewrites:
        op.type, op.args = PHILOX_MUL, args
    return None


def _philox_args(op: Op, mask: str, rng_state: Ref, p: float, train: bool | None) -> tuple | None:
    """`philox_dropout_mul` arguments serving `op`, or None when `op` reads the mask in a way the Philox form
    cannot serve."""
    if op.kwargs or len(op.args) < 2 or op.args[1] != Ref(mask) or Ref(mask) in op.args[2:]:
        return None
    if op.type in _MASK_BACKWARDS and len(op.args) == 3:
        dout, _, scale = op.args
        return dout, rng_state, p, train, scale
    if op.type == _MASK_REPLAY and len(op.args) == 4:
        replayed, _, replay_p, replay_train = op.args
        scale = dropout_scale(replay_p) if is_training(replay_train) else 1.0
        return replayed, rng_state, replay_p, replay_train, scale
    return None
