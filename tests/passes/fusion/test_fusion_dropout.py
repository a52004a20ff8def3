"""Dropout + add fusion: counts on the zoo GPT, exact against the reference with the same mask, statistics;
the RNG form (stored mask on CPU, Philox on CUDA or when forced), with recompute."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import run_side_by_side
from fusion_helpers import fusion_strategy, op_types, stats
from helpers.ir import op_lines
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.codegen.triton import program_kernels
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ir.verifier import verify
from fleetc.ops.fused_add_act import fused_dropout_add, fused_dropout_add_grad
from fleetc.passes.fusion.dropout import FuseDropoutAdd
from fleetc.passes.fusion.dropout_rng import (
    AlwaysPhilox,
    DropoutRngChoice,
    set_dropout_rng_choice,
)

aten = torch.ops.aten


@pytest.fixture(scope="module")
def gpt_run():
    return run_side_by_side("gpt", "adamw", steps=2, strategy=fusion_strategy("fuse_dropout_add"))


def test_gpt_residual_dropouts_fuse_forward_and_backward(gpt_run):
    gpt_run.assert_same()
    # two residual dropouts per block; the embedding and attention-probability dropouts have no add after them
    assert stats(gpt_run.trainer, "fuse_dropout_add") == {"forward_groups": 4, "backward_groups": 4, "ops_removed": 4,
                                                          "mask_rng_groups": 4}
    types = op_types(gpt_run.trainer.program)
    assert types.count("aten.native_dropout.default") == 3 and types.count("fleetc.fused_dropout_add") == 4
    assert "fleetc.fused_dropout_add_philox" not in types  # CPU: the mask form, which matches eager dropout
    assert any("stored bool mask" in n for n in gpt_run.trainer.report().notes["fuse_dropout_add"])


def test_new_style_fused_passes_dropout_add_and_absent_pattern_reported():
    strategy = fleetc.Strategy({"fused_passes": {"enable": True, "dropout_add": True}})
    run = run_side_by_side("mlp", "sgd", steps=1, strategy=strategy)
    assert "no training-mode dropout followed by a residual add" in run.trainer.report().skipped["fuse_dropout_add"]


def test_fused_dropout_add_equals_the_reference_fed_the_same_mask():
    x, residual = torch.randn(64, 33), torch.randn(64, 33)
    torch.manual_seed(7)
    out, mask = fused_dropout_add(x, residual, 0.25, True)
    torch.manual_seed(7)
    dropped, eager_mask = aten.native_dropout(x, 0.25, True)
    assert torch.equal(mask, eager_mask)  # draws the generator exactly as eager dropout does
    assert torch.equal(out, aten.add(residual, aten.native_dropout_backward(x, mask, 1 / 0.75)))
    assert torch.equal(out, residual + dropped)
    dout = torch.randn(64, 33)
    assert torch.equal(fused_dropout_add_grad(dout, mask, 1 / 0.75), dout * mask * (1 / 0.75))


def test_fused_dropout_keep_rate_and_scaling_over_many_elements():
    n, p = 400_000, 0.3
    torch.manual_seed(0)
    out, mask = fused_dropout_add(torch.ones(n), torch.zeros(n), p, True)
    keep_rate = mask.float().mean().item()
    sigma = ((1 - p) * p / n) ** 0.5
    assert abs(keep_rate - (1 - p)) < 5 * sigma
    assert torch.equal(out[mask], torch.full_like(out[mask], 1 / (1 - p)))  # kept: scaled by 1 / (1 - p)
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    assert abs(out.mean().item() - 1.0) < 5 * sigma / (1 - p)  # unbiased in expectation


def test_eval_mode_dropout_is_the_identity():
    x, residual = torch.randn(10), torch.randn(10)
    out, mask = fused_dropout_add(x, residual, 0.5, False)
    assert torch.equal(out, residual + x) and bool(mask.all())


def test_mask_form_with_recompute_matches_eager_and_fuses_every_backward():
    """Recompute's replays of a dropout (backward-role copies of the forward) are not its gradient: the
    native_dropout_backward still fuses, and the replays keep reading the fused op's mask."""
    strategy = fusion_strategy("fuse_dropout_add")
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ["layers.0", "layers.1"]}
    run = run_side_by_side("gpt", "sgd", steps=2, strategy=strategy)
    run.assert_same()
    assert stats(run.trainer, "fuse_dropout_add") == {"forward_groups": 4, "backward_groups": 4, "ops_removed": 4,
                                                      "mask_rng_groups": 4}
    ops = run.trainer.program.global_block.ops
    assert [op.type for op in ops].count("fleetc.fused_dropout_add_grad") == 4
    fused_masks = {op.outputs[1] for op in ops if op.type == "fleetc.fused_dropout_add"}
    # 5 dropouts sit in the recomputed segments; the 2 fused ones among them replay from the fused op's mask
    replays = [op for op in ops if op.type == "fleetc.dropout_replay"]
    assert len(replays) == 5 and sum(op.args[1].name in fused_masks for op in replays) == 2


def test_the_rng_choice_follows_the_dropped_values_device():
    choice, program = DropoutRngChoice(), Program()
    assert choice.use_philox(program, Var("x", (4,), "float32", "cuda:0"))
    assert choice.use_philox(program, Var("x", (4,), "float32", "cuda"))
    assert not choice.use_philox(program, Var("x", (4,), "float32", "cpu"))
    assert AlwaysPhilox().use_philox(program, Var("x", (4,), "float32", "cpu"))


def test_cuda_program_gets_the_philox_form_and_keeps_no_mask(gpt_run):
    """The GPT Program as fuse_dropout_add received it, with every value placed on cuda:0."""
    before = gpt_run.trainer.history["fuse_dropout_add"].previous.program
    on_cuda = before.clone()
    for block in on_cuda.blocks:
        for var in block.vars.values():
            var.device = "cuda:0"
    program, report = FuseDropoutAdd().run(on_cuda, None)
    verify(program, check_shapes=False)
    assert report.stats == {"forward_groups": 4, "backward_groups": 4, "ops_removed": 4, "philox_rng_groups": 4}
    assert any(n.startswith("dropout RNG: Philox") for n in report.notes)
    ops = program.global_block.ops
    forward = [op for op in ops if op.type == "fleetc.fused_dropout_add_philox"]
    grads = [op for op in ops if op.type == "fleetc.philox_dropout_mul"]
    assert len(forward) == len(grads) == 4 and "fleetc.fused_dropout_add" not in op_types(program)
    for fwd in forward:
        state = program.var(fwd.outputs[1])
        assert (state.shape, state.dtype, state.device) == ((2,), "int64", "cuda:0")
        grad = next(op for op in grads if op.attrs["forward_op"] == fwd.name)
        assert grad.role == OpRole.BACKWARD and grad.args[1:4] == (Ref(state.name), fwd.args[2], fwd.args[3])
    kernels = [k.name for k in program_kernels(program)]  # what `dump-ir --kernels` prints
    assert kernels.count("fused_dropout_add_philox") == 4 and kernels.count("philox_dropout_mul") == 4
    # the four saved bool masks (1 byte per element) became 16-byte rng states
    mask_form, _ = FuseDropoutAdd(DropoutRngChoice()).run(before.clone(), None)
    masks = [mask_form.var(op.outputs[1]) for op in mask_form.global_block.ops if op.type == "fleetc.fused_dropout_add"]
    reduced = estimate_memory(mask_form).peak_bytes - estimate_memory(program).peak_bytes
    assert 0 < reduced <= sum(v.nbytes() - 16 for v in masks)  # the masks live at the peak


def _dropout_add_program(mask_reader: str | None) -> Program:
    """o = native_dropout(x) + r, its backward, and optionally another op reading the mask."""
    p = Program()
    b = p.global_block
    for name in ("x", "r", "g"):
        b.add_var(Var(name, (4, 3), "float32", kind=VarKind.DATA))
        p.feeds.append(name)
    for name in ("d", "o", "gx"):
        b.add_var(Var(name, (4, 3), "float32"))
    b.add_var(Var("m", (4, 3), "bool"))
    fwd, bwd = {"op_role": int(OpRole.FORWARD), "module_path": "drop"}, {"op_role": int(OpRole.BACKWARD)}
    b.ops = [Op("drop", "aten.native_dropout.default", (Ref("x"), 0.25, True), outputs=["d", "m"], attrs=dict(fwd)),
             Op("add", "aten.add.Tensor", (Ref("d"), Ref("r")), outputs=["o"], attrs=dict(fwd)),
             Op("drop_bw", "aten.native_dropout_backward.default", (Ref("g"), Ref("m"), 4 / 3), outputs=["gx"],
                attrs=dict(bwd, forward_op="drop"))]
    p.fetches.update(out="o", grad="gx")
    if mask_reader:
        b.add_var(Var("kept", (), "int64"))
        b.ops.append(Op("kept", mask_reader, (Ref("m"),), outputs=["kept"], attrs=dict(fwd)))
        p.fetches["kept"] = "kept"
    verify(p)
    return p


def test_philox_form_records_the_rng_state_and_the_gradient_regenerates_from_it():
    program, report = FuseDropoutAdd(AlwaysPhilox()).run(_dropout_add_program(None), None)
    verify(program)
    lines = op_lines(program, attrs=False)
    assert lines == ["o: f32[4,3], m@RNG_STATE: i64[2] = fleetc.fused_dropout_add_philox(x, r, 0.25, True)",
                     "gx: f32[4,3] = fleetc.philox_dropout_mul(g, m@RNG_STATE, 0.25, True, 1.3333333333333333)"]
    assert "m" not in program.global_block.vars  # no mask is kept
    assert report.stats["philox_rng_groups"] == 1


def test_a_mask_reader_without_philox_form_keeps_the_mask_form_and_says_so():
    program, report = FuseDropoutAdd(AlwaysPhilox()).run(_dropout_add_program("aten.sum.default"), None)
    verify(program)
    assert "fleetc.fused_dropout_add" in op_types(program) and report.stats["mask_rng_groups"] == 1
    assert any("kept the mask form: its mask is also read by kept (aten.sum.default)" in n for n in report.notes)


@pytest.fixture
def philox_everywhere():
    previous = set_dropout_rng_choice(AlwaysPhilox())
    yield
    set_dropout_rng_choice(previous)


def _train_gpt_on_one_batch(strategy, steps: int) -> tuple[list[float], dict, fleetc.CompiledTrainer]:
    entry = ZOO["gpt"]
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, strategy, optimizer=OPTIMIZERS["adamw"](model.parameters()), loss_fn=entry.loss_fn,
                             verify=True)
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(1))
    torch.manual_seed(100)
    losses = [trainer.step(*args, **kwargs).item() for _ in range(steps)]
    return losses, model.state_dict(), trainer


def test_forced_philox_gpt_trains_and_recompute_replays_the_same_masks(philox_everywhere):
    """On CPU the Philox form runs its reference: training works (finite, decreasing loss on one batch), and
    recompute, which re-derives the dropped values from the rng states, changes no bit of the result."""
    plain = fusion_strategy("fuse_dropout_add")
    with_recompute = fusion_strategy("fuse_dropout_add")
    with_recompute.recompute = True
    with_recompute.recompute_configs = {"checkpoints": ["layers.0", "layers.1"]}
    losses, params, trainer = _train_gpt_on_one_batch(plain, steps=3)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    assert stats(trainer, "fuse_dropout_add")["philox_rng_groups"] == 4
    recomputed_losses, recomputed_params, recomputed = _train_gpt_on_one_batch(with_recompute, steps=3)
    assert recomputed_losses == losses
    assert all(torch.equal(params[k], recomputed_params[k]) for k in params)
    replays = [op for op in recomputed.program.global_block.ops
               if op.type == "fleetc.philox_dropout_mul" and op.attrs.get("provenance") == "recompute"]
    assert len(replays) == 2  # the fused dropouts inside the recomputed segments replay from their rng states
    assert stats(recomputed, "fuse_dropout_add")["recompute_replays_from_rng_state"] == 2
    assert stats(recomputed, "fuse_dropout_add")["backward_groups"] == 4  # recompute's replays are not gradients
