"""Recompute: differential runs on/off/eager, checkpoint validation, auto and budget plans, policy, memory."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import run_side_by_side
from helpers.ir import op_lines
from zoo import MLP

import fleetc
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ir.verifier import verify
from fleetc.passes.recompute import Choice, Recompute, RecomputePolicy
from fleetc.strategy import resolve_conflicts, resolve_strategy


def _strategy(**configs) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = configs
    return strategy


def _config(**configs):
    return resolve_conflicts(resolve_strategy(_strategy(**configs)))[0]




@pytest.fixture(scope="module")
def gpt_off():
    return run_side_by_side("gpt", "sgd", steps=2, measure_memory=True)


@pytest.mark.parametrize("checkpoints", [["layers.0", "layers.1"],
                                         pytest.param(["layers.1.attn"], marks=pytest.mark.slow), "auto"],
                         ids=["every_layer", "sparse", "auto"])
def test_gpt_with_dropout_matches_eager_and_recompute_off(gpt_off, checkpoints):
    run = run_side_by_side("gpt", "sgd", steps=2, strategy=_strategy(checkpoints=checkpoints), measure_memory=True)
    run.assert_same()
    run.assert_compiled_identical(gpt_off)
    stats = run.trainer.history["recompute"].report.stats
    assert stats["ops_recomputed"] > 0 and stats["dropouts_replayed"] > 0
    assert stats["peak_bytes_after"] < stats["peak_bytes_before"]
    memory = run.trainer.memory_stats()
    estimated, measured = memory["estimated_peak_bytes"], memory["measured_peak_bytes"]
    # bench/README.md: within 0.2% on the 12-layer GPT; on this tiny one a few KiB of small values weigh ~0.8%
    assert abs(estimated - measured) <= 0.01 * measured, (estimated, measured)
    assert measured < gpt_off.trainer.memory_stats()["measured_peak_bytes"]
    ops = run.trainer.program.global_block.ops
    recomputed = [op for op in ops if op.attrs.get("provenance") == "recompute"]
    assert all(op.role == OpRole.BACKWARD and "@RECOMPUTE" in op.defined[0] for op in recomputed)
    assert {op.type for op in recomputed} >= {"fleetc.dropout_replay"}
    assert "aten.native_dropout.default" not in {op.type for op in recomputed}


@pytest.mark.slow
@pytest.mark.parametrize("zoo_name,checkpoints", [("cnn", ["blocks.0", "blocks.1"]), ("cnn", "auto"),
                                                  ("mlp", ["fc1", "fc2"]), ("loss_dict", "auto")])
def test_other_zoo_models_match_eager(zoo_name, checkpoints):
    run = run_side_by_side(zoo_name, "adam", steps=3, strategy=_strategy(checkpoints=checkpoints), measure_memory=True)
    run.assert_same()
    assert run.trainer.history["recompute"].report.changed
    memory = run.trainer.memory_stats()
    assert abs(memory["estimated_peak_bytes"] - memory["measured_peak_bytes"]) <= 0.10 * memory["measured_peak_bytes"]


@pytest.fixture(scope="module")
def gpt_program(gpt_off) -> Program:
    """The zoo GPT's training Program as the recompute pass receives it (after view cleanup)."""
    return gpt_off.trainer.history["remove_noop_views"].program


def _run(program: Program, policy: RecomputePolicy | None = None, **configs):
    result, report = Recompute(policy).run(program.clone(), _config(**configs))
    verify(result)
    return result, report


def test_out_of_order_checkpoints_are_sorted_and_noted(gpt_program):
    _, in_order = _run(gpt_program, checkpoints=["layers.0", "layers.1"])
    result, report = _run(gpt_program, checkpoints=["layers.1", "layers.0"])
    assert any("out of order" in note and "['layers.0', 'layers.1']" in note for note in report.notes)
    assert report.stats == in_order.stats


def test_unknown_checkpoint_lists_the_closest_candidates(gpt_program):
    with pytest.raises(fleetc.StrategyError, match=r"recompute_configs.checkpoints: 'layer.1.attn'.*'layers.1.attn'"):
        _run(gpt_program, checkpoints=["layer.1.attn"])
    with pytest.raises(fleetc.StrategyError, match="names a parameter"):
        _run(gpt_program, checkpoints=["layers.0.fc.weight"])


def test_unknown_checkpoint_fails_compilation_as_a_strategy_error():
    model = MLP()
    trainer = fleetc.compile(model, _strategy(checkpoints=["fc3"]), loss_fn=F.cross_entropy)
    message = r"'fc3' matches no module path.*closest valid checkpoints: \[('fc2', 'fc1'|'fc1', 'fc2')"
    with pytest.raises(fleetc.StrategyError, match=message):
        trainer.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))


def test_unused_and_duplicate_checkpoints_are_reported_not_fatal(gpt_program):
    _, report = _run(gpt_program, checkpoints=["layers.0", "add_2", "layers.0.drop", "layers.1"])
    notes = "\n".join(report.notes)
    assert "unused checkpoint 'add_2': the same value (add_2) as an earlier checkpoint" in notes
    assert "unused checkpoint 'layers.0.drop': leaving it out gives the same rewrite" in notes
    assert "unused checkpoint 'layers.0'" not in notes and "unused checkpoint 'layers.1'" not in notes
    assert report.changed and report.stats["checkpoints"] == 2


def test_values_kept_across_a_boundary_are_named_with_a_better_checkpoint(gpt_program):
    _, report = _run(gpt_program, checkpoints=["layers.0.attn", "layers.1"])
    assert report.stats["kept_across_boundaries"] >= 1
    assert any("kept alive across segment boundaries" in n and "make it a checkpoint ('drop')" in n
               for n in report.notes)


def test_segments_are_re_emitted_just_before_the_first_backward_reader(gpt_program):
    result, _ = _run(gpt_program, checkpoints=["layers.0", "layers.1"])
    ops = result.global_block.ops
    first = next(i for i, op in enumerate(ops) if op.attrs.get("provenance") == "recompute")
    assert OpRole.BACKWARD in ops[first - 1].role  # after backward started, not at the end of forward
    layer1 = [op for op in ops if op.attrs.get("provenance") == "recompute" and op.module_path.startswith("layers.1")]
    positions = [ops.index(op) for op in layer1]
    assert positions == list(range(positions[0], positions[0] + len(positions)))  # one contiguous segment
    reader = ops[positions[-1] + 1]
    assert OpRole.BACKWARD in reader.role and any(n.endswith("@RECOMPUTE") for n in reader.inputs)
    forward_values = {n for op in ops if OpRole.FORWARD in op.role for n in op.defined}
    layer1_backward = [op for op in ops if op.role == OpRole.BACKWARD and op.module_path.startswith("layers.1")
                       and op.attrs.get("provenance") != "recompute"]
    stale = {n for op in layer1_backward for n in op.inputs
             if n in forward_values and result.var(n).kind is VarKind.TEMP}
    masks = {n for n in stale if result.var(n).dtype == "bool"}
    assert masks and stale - masks == {"add_2"}, stale  # only the checkpoint (layer 0's output) and dropout masks


def test_auto_never_recomputes_matmuls_unless_the_policy_allows_it(gpt_program):
    result, report = _run(gpt_program, checkpoints="auto")
    recomputed = {op.type for op in result.global_block.ops if op.attrs.get("provenance") == "recompute"}
    assert report.changed and not recomputed & {"aten.addmm.default", "aten.mm.default", "aten.bmm.default"}

    class RecomputeMatmuls(RecomputePolicy):
        def choose(self, program, block, op, written_state):
            choice = super().choose(program, block, op, written_state)
            return Choice.RECOMPUTE if choice is Choice.PREFER_SAVE else choice

    result, _ = _run(gpt_program, RecomputeMatmuls(), checkpoints="auto")
    recomputed = {op.type for op in result.global_block.ops if op.attrs.get("provenance") == "recompute"}
    assert recomputed & {"aten.addmm.default", "aten.bmm.default"}


def test_policy_passed_to_compile_replaces_the_default():
    class SaveEverything(RecomputePolicy):
        def choose(self, program, block, op, written_state):
            return Choice.MUST_SAVE

    model = MLP()
    trainer = fleetc.compile(model, _strategy(checkpoints="auto"), loss_fn=F.cross_entropy,
                             recompute_policy=SaveEverything())
    trainer.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    report = trainer.report()
    assert "recompute" not in report.applied and "leaves nothing to recompute" in report.skipped["recompute"]


def test_memory_budget_picks_the_cheapest_plan_that_fits(gpt_program):
    peak_off = estimate_memory(gpt_program).peak_bytes
    _, loose = _run(gpt_program, memory_budget_mb=peak_off / 2**20)
    assert not loose.changed and "no recompute" in loose.skipped_reason
    _, every = _run(gpt_program, checkpoints=["layers.0", "layers.1"])
    _, auto = _run(gpt_program, checkpoints="auto")
    budget = (every.stats["peak_bytes_after"] + 1) / 2**20
    result, tight = _run(gpt_program, memory_budget_mb=budget)
    assert tight.stats["peak_bytes_after"] <= budget * 2**20 < peak_off
    assert estimate_memory(result).peak_bytes == tight.stats["peak_bytes_after"]
    assert any("memory budget" in n and "chose" in n for n in tight.notes)
    with pytest.raises(fleetc.StrategyError, match=r"memory_budget_mb=0.1: .*smallest estimated peak .* MiB"):
        _run(gpt_program, memory_budget_mb=0.1)


def test_memory_budget_alone_keeps_recompute_on_and_the_report_shows_notes():
    cfg, decisions = resolve_conflicts(resolve_strategy(_strategy(memory_budget_mb=1024)))
    assert cfg.recompute and decisions == ()
    model = MLP()
    trainer = fleetc.compile(model, _strategy(checkpoints=["fc2", "fc1"]), loss_fn=F.cross_entropy)
    x = torch.randn(4, 32)
    trainer.step(x, torch.randint(0, 10, (4,)))
    assert "note: checkpoints given out of order" in str(trainer.report())
    torch.testing.assert_close(trainer(x), model(x))  # the evaluation Program has no backward: left alone
    assert not any(op.attrs.get("provenance") == "recompute" for _, op in trainer.eval_program.walk_ops())


def _fixture() -> Program:
    """x → relu → dropout → exp; backward reads exp's result, the dropout output and mask, and relu's result."""
    p = Program()
    b = p.global_block
    b.add_var(Var("x", (4,), "float32", kind=VarKind.DATA))
    p.feeds.append("x")
    for name in ("a", "d", "c", "g", "ga", "gx"):
        b.add_var(Var(name, (4,), "float32"))
    b.add_var(Var("m", (4,), "bool"))
    fwd, bwd = {"op_role": int(OpRole.FORWARD)}, {"op_role": int(OpRole.BACKWARD)}
    b.ops = [
        Op("relu", "aten.relu.default", (Ref("x"),), outputs=["a"], attrs=dict(fwd, module_path="body")),
        Op("drop", "aten.native_dropout.default", (Ref("a"), 0.5, True), outputs=["d", "m"],
           attrs=dict(fwd, module_path="body.drop")),
        Op("exp", "aten.exp.default", (Ref("d"),), outputs=["c"], attrs=dict(fwd, module_path="head")),
        Op("exp_bw", "aten.mul.Tensor", (Ref("c"), Ref("d")), outputs=["g"], attrs=dict(bwd, forward_op="exp")),
        Op("drop_bw", "aten.native_dropout_backward.default", (Ref("g"), Ref("m"), 2.0), outputs=["ga"],
           attrs=dict(bwd, forward_op="drop")),
        Op("relu_bw", "aten.threshold_backward.default", (Ref("ga"), Ref("a"), 0), outputs=["gx"],
           attrs=dict(bwd, forward_op="relu")),
    ]
    p.fetches["grad"] = "gx"
    verify(p)
    return p


def test_fixture_segment_is_replayed_before_its_first_reader_with_the_saved_mask():
    program, report = Recompute().run(_fixture(), _config(checkpoints=["head"]))
    verify(program)
    lines = op_lines(program)
    assert lines[3:] == [
        "a@RECOMPUTE: f32[4] = aten.relu.default(x)",
        "d@RECOMPUTE: f32[4] = fleetc.dropout_replay(a@RECOMPUTE, m, 0.5, True)",
        "g: f32[4] = aten.mul.Tensor(c, d@RECOMPUTE)",
        "ga: f32[4] = aten.native_dropout_backward.default(g, m, 2.0)",
        "gx: f32[4] = aten.threshold_backward.default(ga, a@RECOMPUTE, 0)",
    ]
    assert report.stats["ops_recomputed"] == 2 and report.stats["dropouts_replayed"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.3, 0.7, 1.0])
def test_dropout_replay_is_bit_identical_to_the_recorded_dropout(p, dtype):
    torch.manual_seed(3)
    x = torch.randn(4000, dtype=dtype)
    out, mask = torch.ops.aten.native_dropout.default(x, p, True)
    assert torch.equal(fleetc.ops.resolve_callable("fleetc.dropout_replay")(x, mask, p, True), out)


def test_gpt_under_amp_with_recompute_equals_amp_without_it():
    """The replayed dropout is exact in bf16 too, so recompute changes nothing but memory under AMP."""
    def amp(**recompute_configs):
        strategy = _strategy(**recompute_configs) if recompute_configs else fleetc.DistributedStrategy()
        strategy.amp = True
        strategy.amp_configs = {"dtype": "bfloat16"}
        return strategy

    with_recompute = run_side_by_side("gpt", "sgd", steps=3, strategy=amp(checkpoints=["layers.0", "layers.1"]))
    without = run_side_by_side("gpt", "sgd", steps=3, strategy=amp())
    assert with_recompute.trainer.history["recompute"].report.stats["dropouts_replayed"] > 0
    with_recompute.assert_compiled_identical(without)


def test_composes_with_gradient_merge():
    """Recompute runs before gradient merge; the merged update sees exactly the gradients it saw without it."""
    def train(strategy):
        torch.manual_seed(0)
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        trainer = fleetc.compile(model, strategy, optimizer=optimizer, loss_fn=F.cross_entropy, verify=True)
        g = torch.Generator().manual_seed(1)
        losses = [trainer.step(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
                  for _ in range(4)]
        return trainer, losses, model.state_dict()

    both = _strategy(checkpoints=["fc1", "fc2"])
    merge_only = fleetc.DistributedStrategy()
    for strategy in (both, merge_only):
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": 2}
    trainer, losses, state = train(both)
    _, expected_losses, expected_state = train(merge_only)
    assert trainer.report().applied[:3] == ["remove_noop_views", "recompute", "gradient_merge"]
    assert all(torch.equal(a, b) for a, b in zip(losses, expected_losses))
    assert all(torch.equal(state[k], expected_state[k]) for k in state)
