"""Auto fusion: op counts on the zoo, training matches eager, the heuristic object decides, the IR round-trips."""
from __future__ import annotations

import functools

import pytest
import torch
from conftest import run_side_by_side
from torch import nn

import fleetc
from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ir.serialize import program_from_json, program_to_json
from fleetc.ir.verifier import verify
from fleetc.ops.fused_elementwise import reference
from fleetc.passes.cleanup.dce import DeadCodeElimination
from fleetc.passes.fusion.auto import AutoFusion, FusionChoices, set_fusion_choices
from fleetc.runtime.pycodegen import generate_step

FUSED = "fleetc.fused_elementwise"

# zoo model → (ops without auto fusion, ops with it, groups, ops fused, groups ending in a reduction)
EXPECTED = {
    "mlp": (37, 35, 2, 4, 2),           # threshold_backward + bias-grad sum, twice
    "cnn": (89, 83, 5, 11, 1),          # add+relu (residual), add+relu+mean (pooling), grad adds + relu grads
    "gpt": (304, 297, 6, 13, 1),        # residual-grad add + dropout grad, masked_fill grad + scale
    "unused_param": (13, 12, 1, 2, 1),  # tanh_backward + bias-grad sum
    "loss_dict": (37, 35, 2, 4, 2),
}


def auto_fusion(on: bool = True) -> fleetc.DistributedStrategy:
    """Auto fusion alone: the named bn+add+act fusion (on by default, as in Paddle) would take the cnn's chains."""
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.enable_auto_fusion = on
    strategy.build_strategy.fuse_bn_add_act_ops = False
    return strategy


@functools.lru_cache(maxsize=None)
def _fused_run(zoo_name: str):
    """Three SGD steps with auto fusion, shared by the differential test and the tests inspecting its Programs."""
    return run_side_by_side(zoo_name, "sgd", strategy=auto_fusion())


@pytest.mark.parametrize("optimizer_name", ["sgd", pytest.param("adamw", marks=pytest.mark.slow)])
@pytest.mark.parametrize("zoo_name", sorted(EXPECTED))
def test_auto_fusion_matches_eager_and_fuses_the_expected_groups(zoo_name, optimizer_name):
    if optimizer_name == "sgd":
        run = _fused_run(zoo_name)
    else:
        run = run_side_by_side(zoo_name, optimizer_name, strategy=auto_fusion())
    run.assert_same()
    ops_before, ops_after, groups, ops_fused, reductions = EXPECTED[zoo_name]
    report = run.trainer.report()
    assert report.stats["auto_fusion"] == {"groups": groups, "ops_fused": ops_fused, "reductions_fused": reductions}
    fused = [op for op in run.trainer.program.global_block.ops if op.type == FUSED]
    assert len(fused) == groups
    if optimizer_name == "sgd":  # the tinygrad-style count: this model now runs in N ops (N0 without fusion)
        assert run.trainer.program.num_ops() == ops_after
        unfused = run.trainer.history[run.trainer.history.index_of("auto_fusion") - 1].program.clone()
        DeadCodeElimination().run(unfused, None)
        assert unfused.num_ops() == ops_before


def test_pass_order_has_no_auto_fusion_when_the_flag_is_off():
    run = run_side_by_side("mlp", "sgd", steps=1, strategy=auto_fusion(False))
    assert run.trainer.program.num_ops() == EXPECTED["mlp"][0]
    assert "auto_fusion" not in run.trainer.history.names()


def _fused_program(zoo_name: str):
    return _fused_run(zoo_name).trainer


def test_groups_stay_within_one_role_and_never_take_rng_ops():
    trainer = _fused_program("gpt")
    before = {op.name: op for _, op in trainer.history["auto_fusion"].program.walk_ops()} | {
        op.name: op for _, op in trainer.history[trainer.history.index_of("auto_fusion") - 1].program.walk_ops()}
    fused = [op for _, op in trainer.program.walk_ops() if op.type == FUSED]
    roles = set()
    for op in fused:
        members = [before[name] for name in op.attrs["fused_ops"]]
        assert {m.role for m in members} == {op.role}
        assert all(m.type != "aten.native_dropout.default" for m in members)
        assert op.attrs["provenance"] == "auto_fusion"
        roles.add(op.role)
    assert roles == {OpRole.BACKWARD}  # gpt's forward chains are cut by views, dropout and matmuls
    assert sum(op.type == "aten.native_dropout.default" for _, op in trainer.program.walk_ops()) == 7


def test_fused_op_reference_equals_the_unfused_ops_bit_for_bit():
    trainer = _fused_program("cnn")
    op = next(op for _, op in trainer.program.walk_ops() if op.kwargs.get("name") == "fused_add_relu_mean_1")
    a, b = torch.randn(4, 8, 8, 8), torch.randn(4, 8, 8, 8)
    relu, mean = reference(a, b, steps=op.kwargs["steps"], results=op.kwargs["results"])
    assert torch.equal(relu, torch.relu(a + b)) and torch.equal(mean, torch.relu(a + b).mean(dim=(2, 3)))


def test_fused_program_round_trips_through_json_and_still_runs():
    trainer = _fused_program("mlp")
    program = trainer.program
    again = program_from_json(program_to_json(program))
    assert str(again) == str(program)
    fused = [op for _, op in again.walk_ops() if op.type == FUSED]
    assert fused and all(isinstance(op.kwargs["steps"], tuple) for op in fused)
    generate_step(again)  # the reloaded Program compiles into a runnable step


class _LinearOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.fc(x)


def test_flag_on_without_a_chain_says_why():
    model = _LinearOnly()
    trainer = fleetc.compile(model, auto_fusion(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=nn.functional.mse_loss, verify=True)
    trainer.step(torch.randn(3, 4), torch.randn(3, 4))
    report = trainer.report()
    assert "auto_fusion" not in report.applied
    assert "no chain of pointwise ops" in report.skipped["auto_fusion"]


class _LongChains(FusionChoices):
    min_group_ops = 3


class _NothingFuses(FusionChoices):
    def is_pointwise(self, program, block, op):
        return False


def test_the_heuristic_object_decides_what_fuses():
    program = _fused_program("cnn").history["remove_noop_views"].program
    previous = set_fusion_choices(_LongChains())
    try:
        _, report = AutoFusion().run(program.clone(), None)  # the default pass uses the installed choices
    finally:
        set_fusion_choices(previous)
    assert report.stats == {"groups": 1, "ops_fused": 3, "reductions_fused": 1}
    fused, report = AutoFusion(_NothingFuses()).run(program.clone(), None)
    assert not report.changed and report.skipped_reason
    assert fused.num_ops() == program.num_ops()


def test_max_group_size_caps_groups():
    class _Pairs(FusionChoices):
        max_group_ops = 2

    program = _fused_program("cnn").history["remove_noop_views"].program
    _, report = AutoFusion(_Pairs()).run(program.clone(), None)
    assert report.stats == {"groups": 5, "ops_fused": 10, "reductions_fused": 0}  # add+relu+mean loses its mean


def test_evaluation_program_is_fused_too():
    run = _fused_run("cnn")
    x = torch.randn(2, 3, 8, 8)
    run.eager_model.eval()
    torch.testing.assert_close(run.trainer(x), run.eager_model(x), rtol=0, atol=0)  # bit-identical on CPU
    assert any(op.type == FUSED for _, op in run.trainer.eval_program.walk_ops())


@pytest.mark.parametrize("zoo_name", ["cnn", "gpt"])
def test_fused_ops_declare_the_shapes_and_dtypes_their_reference_computes(zoo_name):
    program = _fused_program(zoo_name).program
    for _, op in program.walk_ops():
        if op.type != FUSED:
            continue
        metas = [torch.empty(program.var(r.name).shape, dtype=program.var(r.name).torch_dtype, device="meta")
                 for r in op.args]
        produced = reference(*metas, steps=op.kwargs["steps"], results=op.kwargs["results"])
        produced = produced if isinstance(produced, tuple) else (produced,)
        declared = [(tuple(program.var(n).shape), program.var(n).torch_dtype) for n in op.outputs]
        assert [(tuple(p.shape), p.dtype) for p in produced] == declared, op.name


def _chain_program(late_input_first: bool) -> Program:
    """x, y → a = x + y; c = cumsum(x) (not pointwise); d = a * c; fetch d. `late_input_first` puts c before a."""
    program = Program()
    block = program.global_block
    for name in ("x", "y"):
        block.add_var(Var(name, (4,), "float32", kind=VarKind.DATA))
    for name in ("a", "c", "d"):
        block.add_var(Var(name, (4,), "float32"))
    forward = {"op_role": int(OpRole.FORWARD)}
    add = Op("add", "aten.add.Tensor", (Ref("x"), Ref("y")), outputs=["a"], attrs=dict(forward))
    cumsum = Op("cumsum", "aten.cumsum.default", (Ref("x"), 0), outputs=["c"], attrs=dict(forward))
    mul = Op("mul", "aten.mul.Tensor", (Ref("a"), Ref("c")), outputs=["d"], attrs=dict(forward))
    block.ops = [cumsum, add, mul] if late_input_first else [add, cumsum, mul]
    program.feeds, program.fetches = ["x", "y"], {"output.0": "d"}
    return program


def test_an_op_joins_only_where_its_outside_inputs_already_exist():
    fused, report = AutoFusion().run(_chain_program(late_input_first=True), None)
    verify(fused)
    assert report.stats == {"groups": 1, "ops_fused": 2, "reductions_fused": 0}
    assert [op.type for op in fused.global_block.ops] == ["aten.cumsum.default", FUSED]
    assert "a" not in fused.global_block.vars  # the intermediate is internal now

    unchanged, report = AutoFusion().run(_chain_program(late_input_first=False), None)
    assert not report.changed and report.skipped_reason  # mul would have to move above cumsum
    assert [op.name for op in unchanged.global_block.ops] == ["add", "cumsum", "mul"]


def test_a_chain_nobody_reads_is_left_for_dead_code_elimination():
    program = _chain_program(late_input_first=True)
    program.fetches = {"output.0": "c"}  # a and d are dead
    fused, report = AutoFusion().run(program, None)
    assert not report.changed
    assert [op.name for op in fused.global_block.ops] == ["cumsum", "add", "mul"]


def test_auto_fusion_composes_with_gradient_merge():
    strategy = auto_fusion()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
    run = run_side_by_side("mlp", "adamw", steps=4, strategy=strategy)
    merged = run_side_by_side("mlp", "adamw", steps=4, strategy=_merge_only(strategy))
    for fused_loss, merged_loss in zip(run.compiled_losses, merged.compiled_losses):
        torch.testing.assert_close(fused_loss, merged_loss, rtol=0, atol=0)  # the CPU path is bit-identical
    torch.testing.assert_close(run.compiled_model.state_dict(), merged.compiled_model.state_dict(), rtol=0, atol=0)
    assert run.trainer.report().stats["auto_fusion"]["groups"] == EXPECTED["mlp"][2]
    assert "gradient_merge" in run.trainer.report().applied


def _merge_only(strategy: fleetc.DistributedStrategy) -> fleetc.DistributedStrategy:
    merge_only = auto_fusion(False)
    merge_only.gradient_merge = True
    merge_only.gradient_merge_configs = dict(strategy.gradient_merge_configs)
    return merge_only
