"""AMP: casts by white/black lists over forward and backward, fp32 gradients, Paddle's dynamic loss scaling."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import run_side_by_side
from helpers.amp import amp_strategy, amp_trainer, poisoned
from torch.utils._python_dispatch import TorchDispatchMode
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.ir.program import OpRole, VarKind
from fleetc.ir.serialize import program_from_json, program_to_json
from fleetc.ops.amp import check_finite_and_unscale, update_loss_scaling
from fleetc.passes.precision.amp_lists import DEFAULT_BLACK

MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.convolution.default",
           "aten.convolution_backward.default")


def float_dtypes(program, op) -> set[str]:
    names = [*op.inputs, *op.defined]
    return {v.dtype for v in map(program.var, names) if v.shape is not None and v.dtype.startswith(("float", "bf"))}


def counters(trainer) -> tuple[float, int, int]:
    c = trainer.counters
    return float(c["loss_scaling"]), int(c["num_good_steps"]), int(c["num_bad_steps"])


# ----- the loss-scaling rule ------------------------------------------------------------------
def test_loss_scaling_follows_paddles_rule_step_by_step():
    trainer, entry = amp_trainer(init_loss_scaling=8.0, incr_every_n_steps=2, decr_every_n_nan_or_inf=2,
                                 incr_ratio=2.0, decr_ratio=0.5)
    g = torch.Generator().manual_seed(1)
    # (overflow?, expected (scale, good steps, bad steps) after the step), worked out by hand from the rule
    script = [(False, (8, 1, 0)), (False, (16, 0, 0)), (True, (16, 0, 1)), (False, (16, 1, 0)),
              (True, (16, 0, 1)), (True, (8, 0, 0)), (True, (8, 0, 1)), (True, (4, 0, 0)),
              (False, (4, 1, 0)), (False, (8, 0, 0)), (False, (8, 1, 0))]
    for step, (overflow, expected) in enumerate(script):
        args, _ = entry.make_batch(g)
        trainer.step(*(poisoned(args) if overflow else args))
        assert counters(trainer) == expected, f"after step {step} (overflow={overflow})"


def test_update_rule_floors_at_one_and_keeps_a_finite_scale():
    def run(scale: float, overflow: bool, **kw) -> float:
        state = [torch.tensor(scale), torch.tensor(0, dtype=torch.int32), torch.tensor(0, dtype=torch.int32)]
        update_loss_scaling(torch.tensor([float(overflow)]), *state, **kw)
        return float(state[0])

    rule = dict(incr_every_n_steps=1, decr_every_n_nan_or_inf=1, incr_ratio=2.0, decr_ratio=0.5)
    assert run(1.5, True, **rule) == 1.0  # max(1, 0.75)
    assert run(1.0, True, **rule) == 1.0
    assert run(3e38, False, **rule) == pytest.approx(3e38)  # 6e38 overflows float32: keep the old scale
    assert run(4.0, False, **rule) == 8.0


def test_fused_unscale_divides_each_gradient_once_even_when_they_share_storage():
    packed = torch.full((4,), 8.0)
    *grads, found_inf = check_finite_and_unscale([packed[:2], packed[2:], packed[:2].view(2)], torch.tensor(4.0))
    assert [g.tolist() for g in grads] == [[2.0, 2.0]] * 3 and found_inf.item() == 0
    *_, found_inf = check_finite_and_unscale([torch.ones(2), torch.tensor([1.0, float("nan")])], torch.tensor(4.0))
    assert found_inf.item() == 1


def test_real_fp16_overflow_from_a_huge_scale_halves_it_and_skips_those_updates():
    trainer, entry = amp_trainer(dtype="float16", init_loss_scaling=2.0**24, decr_every_n_nan_or_inf=1,
                                 decr_ratio=0.5)
    g = torch.Generator().manual_seed(1)
    scale, overflows, clean, clean_in_a_row = 2.0**24, 0, 0, 0
    for _ in range(10):
        before = copy.deepcopy(trainer.model.state_dict())
        trainer.step(*entry.make_batch(g)[0])
        new_scale, good, bad = counters(trainer)
        updated = any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
        if new_scale < scale:  # fp16 gradients overflowed at this scale
            assert (new_scale, good, updated) == (scale / 2, 0, False)
            overflows, clean_in_a_row = overflows + 1, 0
        else:
            assert (new_scale, good, updated) == (scale, clean_in_a_row + 1, True)
            clean, clean_in_a_row = clean + 1, clean_in_a_row + 1
        scale = new_scale
    assert overflows >= 3 and clean >= 3, (overflows, clean)


def test_static_loss_scaling_keeps_the_scale_and_still_skips_overflowing_updates():
    trainer, entry = amp_trainer(init_loss_scaling=128.0, use_dynamic_loss_scaling=False)
    g = torch.Generator().manual_seed(1)
    trainer.step(*entry.make_batch(g)[0])
    before = copy.deepcopy(trainer.model.state_dict())
    trainer.step(*poisoned(entry.make_batch(g)[0]))
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert counters(trainer) == (128.0, 0, 0)
    assert not any(op.type == "fleetc.update_loss_scaling" for _, op in trainer.program.walk_ops())
    assert "static" in " ".join(trainer.history["amp"].report.notes)


def test_injected_inf_skips_exactly_that_update():
    """Adam: params and optimizer state are untouched by the poisoned step, and the run continues exactly
    as one that never saw that batch (scaling by a power of two is exact)."""
    entry = ZOO["mlp"]
    g = torch.Generator().manual_seed(1)
    batches = [entry.make_batch(g)[0] for _ in range(4)]
    poisoned_run, _ = amp_trainer(optimizer="adam")
    clean_run, _ = amp_trainer(optimizer="adam")
    for args in batches[:2]:
        poisoned_run.step(*args)
        clean_run.step(*args)
    params = copy.deepcopy(poisoned_run.model.state_dict())
    opt_state = copy.deepcopy(poisoned_run.optimizer.state_dict())
    loss = poisoned_run.step(*poisoned(batches[2]))
    assert not torch.isfinite(loss)
    for name, value in poisoned_run.model.state_dict().items():
        assert torch.equal(value, params[name]), name
    for key, state in poisoned_run.optimizer.state_dict()["state"].items():
        for slot, value in state.items():
            assert torch.equal(value, opt_state["state"][key][slot]), (key, slot)
    assert counters(poisoned_run) == (32768.0, 0, 1)
    for args in batches[3:]:
        poisoned_run.step(*args)
        clean_run.step(*args)
    for name, value in clean_run.model.state_dict().items():
        assert torch.equal(poisoned_run.model.state_dict()[name], value), name


def test_scale_and_counters_are_persistable_counters_that_resume():
    trainer, entry = amp_trainer(init_loss_scaling=8.0, incr_every_n_steps=3)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        trainer.step(*entry.make_batch(g)[0])
    kinds = {v.name: v.kind for v in trainer.program.persistables()}
    assert {kinds[n] for n in ("loss_scaling", "num_good_steps", "num_bad_steps")} == {VarKind.COUNTER}
    checkpoint = trainer.state_dict()
    resumed, _ = amp_trainer(init_loss_scaling=8.0, incr_every_n_steps=3)
    resumed.load_state_dict(checkpoint)
    resumed.step(*entry.make_batch(g)[0])
    assert counters(resumed) == (16.0, 0, 0), "the third clean step in a row grows the resumed scale"


def test_amp_with_gradient_merge_skips_the_merged_update_when_a_micro_step_overflows():
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    model = entry.make_model()
    strategy = amp_strategy(init_loss_scaling=8.0, incr_every_n_steps=2)
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
    trainer = fleetc.compile(model, strategy, optimizer=OPTIMIZERS["adam"](model.parameters()),
                             loss_fn=entry.loss_fn, verify=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        trainer.step(*entry.make_batch(g)[0])
    assert counters(trainer) == (8.0, 1, 0), "the scale rule runs once per merged update"
    after_first_update = copy.deepcopy(model.state_dict())
    trainer.step(*poisoned(entry.make_batch(g)[0]))
    trainer.step(*entry.make_batch(g)[0])
    assert all(torch.equal(after_first_update[k], v) for k, v in model.state_dict().items())
    assert counters(trainer) == (8.0, 0, 1)
    for _ in range(4):
        trainer.step(*entry.make_batch(g)[0])
    assert counters(trainer) == (16.0, 0, 0)


def test_found_inf_check_and_unscale_is_one_fused_op():
    trainer, entry = amp_trainer("mlp", "adamw")
    trainer.step(*entry.make_batch(torch.Generator().manual_seed(1))[0])
    ops = [op for _, op in trainer.program.walk_ops()]
    checks = [op for op in ops if op.type == "fleetc.check_finite_and_unscale"]
    updates = [op for op in ops if op.type == "fleetc.adam"]
    assert len(checks) == 1 and len(checks[0].args[0]) == len(updates) == 6
    assert all(trainer.program.var(g.name).dtype == "float32" for g in checks[0].args[0])
    conditional = next(op for op in ops if op.type == "fleetc.conditional_block")
    assert trainer.program.blocks[conditional.sub_block].ops == updates, "every update sits in the skip block"
    text = str(trainer.program)
    assert "fleetc.conditional_block(grads_finite)" in text and "block 1 (parent 0) {" in text
    assert str(program_from_json(program_to_json(trainer.program))) == text, "casts' dtypes survive JSON"


# ----- casts ----------------------------------------------------------------------------------
class _RecordDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, set]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtypes = {a.dtype for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
                  and a.is_floating_point()}
        self.calls.append((str(func), dtypes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_bf16_program_runs_matmuls_in_bf16_and_statistics_in_fp32(zoo_name):
    trainer, entry = amp_trainer(zoo_name, "adamw")
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(1))
    trainer.step(*args, **kwargs)
    program = trainer.program
    matmuls = [op for _, op in program.walk_ops() if op.type in MATMULS]
    assert matmuls and all(float_dtypes(program, op) == {"bfloat16"} for op in matmuls)
    black = [op for _, op in program.walk_ops()
             if op.type.startswith("aten.") and op.type.split(".")[1] in DEFAULT_BLACK]
    assert black and all("bfloat16" not in {program.var(n).dtype for n in op.defined} for op in black)
    params = [v for v in program.persistables() if v.kind is VarKind.PARAM]
    assert params and all(v.dtype == "float32" for v in params), "master weights stay fp32"
    assert all(float_dtypes(program, op) == {"float32"} for _, op in program.walk_ops() if op.type == "fleetc.adam")
    with _RecordDtypes() as recorded:  # what really runs, not only what the Program declares
        trainer.step(*args, **kwargs)
    ran = [dtypes for name, dtypes in recorded.calls if name in MATMULS]
    assert len(ran) == len(matmuls) and all(d == {torch.bfloat16} for d in ran)
    stats = trainer.report().stats["amp"]  # the cast count per model, in the report
    assert stats["casts"] == stats["casts_to_bfloat16"] + stats["casts_to_float32"] > 0
    assert stats["ops_in_bfloat16"] >= len(matmuls) and "amp: casts=" in str(trainer.report())


def test_each_value_is_cast_once_and_mlp_needs_exactly_twelve_casts():
    trainer, entry = amp_trainer("mlp")
    trainer.step(*entry.make_batch(torch.Generator().manual_seed(1))[0])
    casts = [(op.args[0].name, op.kwargs["dtype"]) for _, op in trainer.program.walk_ops()
             if op.attrs.get("provenance") == "amp" and op.type == "aten._to_copy.default"]
    assert len(casts) == len(set(casts))
    # to bf16: x, 3 weights (shared by forward and backward matmuls), 3 biases, the logits' gradient;
    # to fp32: the logits (for log_softmax) and the 3 weight gradients (bias gradients are fp32 sums).
    assert trainer.report().stats["amp"]["casts"] == len(casts) == 12
    assert {name for name, dtype in casts if dtype is torch.bfloat16} >= {"x", "fc1.weight", "fc2.weight",
                                                                          "out.weight"}


def test_custom_lists_accept_paddle_and_aten_names():
    trainer, entry = amp_trainer("gpt", custom_white_list=["softmax"], custom_black_list=["aten.bmm"])
    trainer.step(*entry.make_batch(torch.Generator().manual_seed(1))[0])
    program = trainer.program
    by_type = lambda t: [op for _, op in program.walk_ops() if op.type == t]  # noqa: E731
    assert all(float_dtypes(program, op) == {"bfloat16"} for op in by_type("aten._softmax.default"))
    assert all(float_dtypes(program, op) == {"float32"} for op in by_type("aten.bmm.default"))
    assert all(float_dtypes(program, op) == {"bfloat16"} for op in by_type("aten.mm.default"))


def test_custom_black_list_matmul_turns_every_matmul_off():
    trainer, entry = amp_trainer("mlp", custom_black_list=["matmul"])
    trainer.step(*entry.make_batch(torch.Generator().manual_seed(1))[0])
    assert all(float_dtypes(trainer.program, op) <= {"float32"} for _, op in trainer.program.walk_ops())
    assert "amp" not in trainer.report().stats or trainer.report().stats["amp"].get("casts", 0) == 0


def test_custom_black_varnames_keep_a_layer_in_fp32_forward_and_backward():
    trainer, entry = amp_trainer("mlp", custom_black_varnames=["fc1.weight", "no_such_var"])
    trainer.step(*entry.make_batch(torch.Generator().manual_seed(1))[0])
    program = trainer.program
    fc1 = [op for _, op in program.walk_ops() if op.type in MATMULS and op.module_path == "fc1"]
    forward = [op for op in fc1 if OpRole.FORWARD in op.role]
    backward = [op for op in fc1 if op.outputs == ["fc1.weight@GRAD"]]  # the weight's gradient
    assert len(forward) == 1 and len(backward) == 1
    assert all(float_dtypes(program, op) == {"float32"} for op in forward + backward)
    fc2 = [op for _, op in program.walk_ops() if op.type in MATMULS and op.module_path == "fc2"]
    assert all(float_dtypes(program, op) == {"bfloat16"} for op in fc2)
    assert any("no_such_var" in note for note in trainer.history["amp"].report.notes)


BATCH_NORMS = ("aten._native_batch_norm_legit_functional.default", "aten.native_batch_norm_backward.default")


def batch_norm_dtypes(program) -> list[tuple[str, list[str], list[str]]]:
    """(op type, activation input dtypes, output dtypes) of every batch norm op, forward and backward."""
    found = []
    for _, op in program.walk_ops():
        if op.type in BATCH_NORMS:
            acts = op.args[:2] if op.type.endswith("backward.default") else op.args[:1]
            found.append((op.type, [program.var(a.name).dtype for a in acts],
                          [program.var(n).dtype for n in op.outputs if n is not None]))
    return found


def test_batch_norm_reads_bf16_activations_and_keeps_fp32_statistics():
    """Mixed rule (Paddle's `_keep_fp32_input`, torch's CPU autocast): batch norm between two bf16 convs runs on
    the bf16 activation with float32 weights, statistics and parameter gradients; no cast around it."""
    trainer, entry = amp_trainer("cnn", "adamw")
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(1))
    trainer.step(*args, **kwargs)
    found = batch_norm_dtypes(trainer.program)
    assert {t for t, _, _ in found} == set(BATCH_NORMS)
    for op_type, acts, outputs in found:
        assert set(acts) == {"bfloat16"} and outputs[0] == "bfloat16", op_type
        assert set(outputs[1:]) == {"float32"}, f"{op_type}: statistics / parameter gradients stay fp32"
    with _RecordDtypes() as recorded:  # aten really runs them so (its CPU kernels take the mixed dtypes)
        trainer.step(*args, **kwargs)
    ran = [dtypes for name, dtypes in recorded.calls if name in BATCH_NORMS]
    assert ran and all(d == {torch.bfloat16, torch.float32} for d in ran)
    black, _ = amp_trainer("cnn", "adamw", custom_black_list=["batch_norm"])  # the float32 batch norm on request
    black.step(*args, **kwargs)
    assert all(set(acts) | set(outputs) == {"float32"} for _, acts, outputs in batch_norm_dtypes(black.program))
    assert black.report().stats["amp"]["casts"] > trainer.report().stats["amp"]["casts"]


@pytest.mark.parametrize("configs, match", [
    ({"custom_white_list": ["not_an_op"]}, "custom_white_list: 'not_an_op'"),
    ({"custom_white_list": ["softmax"], "custom_black_list": ["softmax"]}, "both name"),
])
def test_bad_custom_lists_are_clear_errors(configs, match):
    trainer, entry = amp_trainer(**configs)
    with pytest.raises(fleetc.PassError, match=match):
        trainer.step(*entry.make_batch(torch.Generator().manual_seed(1))[0])


def test_float16_on_request():
    trainer, entry = amp_trainer(dtype="float16")
    trainer.step(*entry.make_batch(torch.Generator().manual_seed(1))[0])
    program = trainer.program
    assert all(float_dtypes(program, op) == {"float16"} for _, op in program.walk_ops() if op.type in MATMULS)


def test_evaluation_under_amp_returns_float32_outputs():
    trainer, entry = amp_trainer("mlp")
    x = entry.make_batch(torch.Generator().manual_seed(1))[0][0]
    out = trainer(x)
    assert out.dtype == torch.float32
    assert any(op.type == "aten.addmm.default" and float_dtypes(trainer.eval_program, op) == {"bfloat16"}
               for _, op in trainer.eval_program.walk_ops())
    torch.testing.assert_close(out, trainer.model(x), rtol=0.05, atol=0.05)


# ----- training quality -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_bf16_training_tracks_fp32_losses_for_50_steps(zoo_name):
    """Tolerance: every step's loss within 5% of eager fp32, the last 10 steps' mean within 2%."""
    run = run_side_by_side(zoo_name, "adam", steps=50, strategy=amp_strategy())
    fp32, amp = torch.stack(run.eager_losses), torch.stack(run.compiled_losses)
    relative = (amp - fp32).abs() / fp32.abs()
    assert relative.max() < 0.05, f"worst step {int(relative.argmax())}: {amp[relative.argmax()]} vs fp32"
    assert abs(amp[-10:].mean() - fp32[-10:].mean()) / fp32[-10:].mean() < 0.02
    assert counters(run.trainer)[1] == 50, "no step overflowed at the default scale"
