"""Gradient merge: k micro-steps equal one big step, nested conditional block, checkpoint resume, eval calls."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from helpers.gradient_merge import (
    assert_same_state,
    compiled,
    eager_accumulation,
    merge_strategy,
    run_merged,
)
from helpers.ir import op_lines
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ir.verifier import verify
from fleetc.passes.gradient_merge import GradientMerge
from fleetc.strategy import resolve_strategy


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("k_steps", [2, 4])
def test_k_micro_steps_of_batch_b_over_k_equal_one_step_of_batch_b(k_steps, optimizer_name):
    model, trainer = compiled("mlp", optimizer_name, merge_strategy(k_steps))
    eager_model = copy.deepcopy(model)
    eager_opt = OPTIMIZERS[optimizer_name](eager_model.parameters())
    loss_fn = ZOO["mlp"].loss_fn
    g = torch.Generator().manual_seed(1)
    for update in range(2):
        (x, y), _ = ZOO["mlp"].make_batch(g)
        before = copy.deepcopy(model.state_dict())
        micro_losses = []
        for i, (xs, ys) in enumerate(zip(x.chunk(k_steps), y.chunk(k_steps))):
            micro_losses.append(trainer.step(xs, ys))
            if i < k_steps - 1:
                assert_same_state(model.state_dict(), before, rtol=0, atol=0)  # no update mid-accumulation
        eager_opt.zero_grad()
        loss = loss_fn(eager_model(x), y)
        loss.backward()
        eager_opt.step()
        torch.testing.assert_close(torch.stack(micro_losses).mean(), loss.detach(), rtol=1e-5, atol=1e-6)
        assert_same_state(model.state_dict(), eager_model.state_dict())
    if optimizer_name.startswith("adam"):
        assert {float(s["step"]) for s in trainer.optimizer.state.values()} == {2.0}  # updates, not micro-steps
        assert_same_state(trainer.optimizer.state_dict()["state"], eager_opt.state_dict()["state"])


@pytest.mark.parametrize(("avg", "optimizer_name"), [(True, "momentum"), (False, "adam")])
@pytest.mark.parametrize("zoo_name", [pytest.param(name, marks=pytest.mark.slow) if name in ("cnn", "gpt") else name
                                      for name in sorted(ZOO)])
def test_zoo_matches_eager_gradient_accumulation(zoo_name, avg, optimizer_name):
    """BatchNorm statistics, dropout, tied and unused parameters all behave as in eager accumulation."""
    k_steps, micro_steps = 2, 6
    eager_model, eager_losses = eager_accumulation(zoo_name, optimizer_name, k_steps, avg, micro_steps)
    model, trainer = compiled(zoo_name, optimizer_name, merge_strategy(k_steps, avg))
    losses = run_merged(trainer, zoo_name, micro_steps)
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-5, atol=1e-6)
    assert_same_state(model.state_dict(), eager_model.state_dict())
    assert "gradient_merge" in trainer.report().applied


def test_new_style_strategy_and_sum_without_avg():
    strategy = fleetc.Strategy({"gradient_merge": {"enable": True, "k_steps": 2}})
    strategy.gradient_merge.avg = False
    eager_model, _ = eager_accumulation("mlp", "sgd", 2, False, 4)
    model, trainer = compiled("mlp", "sgd", strategy)
    run_merged(trainer, "mlp", 4)
    assert_same_state(model.state_dict(), eager_model.state_dict())
    assert "fleetc.divide" not in str(trainer.program)


def test_program_dump_shows_the_update_nested_in_a_conditional_block():
    _, trainer = compiled("mlp", "sgd", merge_strategy(4))
    run_merged(trainer, "mlp", 1)
    text = str(trainer.program)
    assert "  accumulator fc1.weight@GRAD@MERGE: f32[64,32] cpu" in text
    assert "  counter gradient_merge@step: i64[] cpu" in text
    assert ("  fc1.weight@GRAD@MERGE: f32[64,32] = fleetc.accumulate(fc1.weight@GRAD@MERGE, fc1.weight@GRAD)"
            "  # backward  fc1  provenance=gradient_merge") in text
    assert "  gradient_merge@step: i64[] = fleetc.advance_cycle(gradient_merge@step, 4)" in text
    nested = text[text.index("  () = fleetc.conditional_block(gradient_merge@update)"):].splitlines()
    assert nested[1] == "    block 1 (parent 0) {"
    assert nested[2].startswith("      fc1.weight@GRAD@MERGE: f32[64,32] = fleetc.divide(fc1.weight@GRAD@MERGE, 4.0)")
    assert any(line.startswith("      fc1.weight: f32[64,32] = fleetc.sgd(fc1.weight, fc1.weight@GRAD@MERGE, ")
               for line in nested)
    assert nested[-3].startswith("      out.bias@GRAD@MERGE: f32[10] = fleetc.zero(out.bias@GRAD@MERGE)")
    assert nested[-2:] == ["    }", "}"]
    assert not any(op.type == "fleetc.sgd" for op in trainer.program.global_block.ops)
    assert "    if v_gradient_merge_update:  # gradient_merge.update" in trainer.generated_source()
    assert trainer.report().stats["gradient_merge"] == {"k_steps": 4, "accumulators": 6, "update_ops_moved": 6}


@pytest.mark.parametrize("optimizer_name", ["momentum", "adam"])
def test_resume_mid_accumulation_matches_an_uninterrupted_run(optimizer_name):
    k_steps, micro_steps = 4, 8
    model, trainer = compiled("mlp", optimizer_name, merge_strategy(k_steps))
    run_merged(trainer, "mlp", micro_steps)

    first_model, first = compiled("mlp", optimizer_name, merge_strategy(k_steps))
    g = torch.Generator().manual_seed(1)
    run_merged(first, "mlp", 1, g=g)
    batches_after_one = g.get_state()
    buffer = io.BytesIO()
    torch.save({"model": first_model.state_dict(), "optimizer": first.optimizer.state_dict(),
                "fleetc": first.state_dict()}, buffer)
    assert float(first.state_dict()["fleetc_owned"]["gradient_merge@step"]) == 1

    def resumed(load_fleetc_state: bool) -> torch.nn.Module:
        buffer.seek(0)
        checkpoint = torch.load(buffer, weights_only=True)
        torch.manual_seed(123)  # different initial weights: everything must come from the checkpoint
        fresh = ZOO["mlp"].make_model()
        fresh.load_state_dict(checkpoint["model"])
        optimizer = OPTIMIZERS[optimizer_name](fresh.parameters())
        optimizer.load_state_dict(checkpoint["optimizer"])
        again = fleetc.compile(fresh, merge_strategy(k_steps), optimizer=optimizer, loss_fn=ZOO["mlp"].loss_fn,
                               verify=True)
        if load_fleetc_state:
            again.load_state_dict(checkpoint["fleetc"])
        run_merged(again, "mlp", micro_steps - 1, first=1, g=torch.Generator().set_state(batches_after_one))
        return fresh

    assert_same_state(resumed(True).state_dict(), model.state_dict())
    without = resumed(False).state_dict()
    assert any(not torch.allclose(without[n], v) for n, v in model.state_dict().items()), \
        "the fleetc state must matter: resuming without it should diverge"


@pytest.mark.slow
def test_eval_calls_mid_accumulation_change_nothing():
    k_steps, micro_steps = 4, 8
    plain_model, plain = compiled("cnn", "momentum", merge_strategy(k_steps))
    run_merged(plain, "cnn", micro_steps)
    model, trainer = compiled("cnn", "momentum", merge_strategy(k_steps))
    g = torch.Generator().manual_seed(1)
    probe = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    for i in range(micro_steps):
        run_merged(trainer, "cnn", 1, first=i, g=g)
        out = trainer(probe)
        model.eval()
        with torch.no_grad():
            expected = model(probe)
        model.train()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert_same_state(model.state_dict(), plain_model.state_dict(), rtol=0, atol=0)
    assert_same_state(trainer.state_dict()["fleetc_owned"], plain.state_dict()["fleetc_owned"], rtol=0, atol=0)
    assert len(trainer.eval_program.blocks) == 1 and "@MERGE" not in str(trainer.eval_program)


def test_k_steps_1_is_switched_off_and_reported():
    model, trainer = compiled("mlp", "sgd", merge_strategy(1))
    run_merged(trainer, "mlp", 1)
    report = trainer.report()
    assert ("gradient_merge: switched off (gradient_merge_configs.k_steps is 1, so there is nothing to merge)"
            in report.decisions)
    assert "gradient_merge" in str(report) and "gradient_merge" not in trainer.history.names()
    assert len(trainer.program.blocks) == 1 and trainer.state_dict()["fleetc_owned"] == {}


def test_without_optimizer_the_pass_says_why_it_did_nothing():
    entry = ZOO["mlp"]
    trainer = fleetc.compile(entry.make_model(), merge_strategy(2), loss_fn=entry.loss_fn, verify=True)
    run_merged(trainer, "mlp", 1)
    assert "no optimizer update" in trainer.report().skipped["gradient_merge"]
    assert all(p.grad is not None for p in trainer.model.parameters())


def _collective_fixture() -> Program:
    """w·x with a forward collective (sync-BN-like, stays) and a gradient collective (allreduce-like, moves)."""
    p = Program(metadata={"kind": "train"})
    b = p.global_block
    b.add_var(Var("x", (4,), "float32", kind=VarKind.DATA))
    b.add_var(Var("lr", None, "float64", kind=VarKind.HYPER))
    b.add_var(Var("w", (4,), "float32", kind=VarKind.PARAM))
    for name in ("y", "synced", "loss", "w@GRAD", "reduced"):
        b.add_var(Var(name, () if name == "loss" else (4,), "float32"))
    p.feeds = ["x", "lr"]
    p.fetches = {"loss": "loss"}

    def op(name, op_type, args, out, role):
        return Op(name, op_type, args, outputs=[out], attrs={"op_role": int(role), "module_path": "m"})

    b.ops = [
        op("mul", "aten.mul.Tensor", (Ref("x"), Ref("w")), "y", OpRole.FORWARD),
        op("sync", "aten.mul.Tensor", (Ref("y"), 1.0), "synced", OpRole.FORWARD | OpRole.COLLECTIVE),
        op("sum", "aten.sum.default", (Ref("synced"),), "loss", OpRole.FORWARD | OpRole.LOSS),
        op("grad", "aten.mul.Tensor", (Ref("x"), 1.0), "w@GRAD", OpRole.BACKWARD),
        op("allreduce", "aten.mul.Tensor", (Ref("w@GRAD"), 0.5), "reduced", OpRole.BACKWARD | OpRole.COLLECTIVE),
        Op("w.sgd", "fleetc.sgd", (Ref("w"), Ref("reduced"), None, False, Ref("lr"), 0.0, 0.0, False, 0.0, False),
           outputs=["w"], attrs={"op_role": int(OpRole.OPTIMIZE), "module_path": "m"}),
    ]
    verify(p)
    return p


def test_collectives_feeding_only_the_update_move_into_the_block():
    config = resolve_strategy(merge_strategy(2))
    program, report = GradientMerge().run(_collective_fixture(), config)
    verify(program)
    assert op_lines(program, indent=True) == [
        "  y: f32[4] = aten.mul.Tensor(x, w)",
        "  synced: f32[4] = aten.mul.Tensor(y, 1.0)",
        "  loss: f32[] = aten.sum.default(synced)",
        "  w@GRAD: f32[4] = aten.mul.Tensor(x, 1.0)",
        "  w@GRAD@MERGE: f32[4] = fleetc.accumulate(w@GRAD@MERGE, w@GRAD)",
        "  gradient_merge@step: i64[] = fleetc.advance_cycle(gradient_merge@step, 2)",
        "  gradient_merge@update: b8[] = aten.eq.Scalar(gradient_merge@step, 0)",
        "  () = fleetc.conditional_block(gradient_merge@update)",
        "      w@GRAD@MERGE: f32[4] = fleetc.divide(w@GRAD@MERGE, 2.0)",
        "      reduced: f32[4] = aten.mul.Tensor(w@GRAD@MERGE, 0.5)",
        "      w: f32[4] = fleetc.sgd(w, reduced, None, False, lr, 0.0, 0.0, False, 0.0, False)",
        "      w@GRAD@MERGE: f32[4] = fleetc.zero(w@GRAD@MERGE)",
    ]
    assert "reduced" in program.blocks[1].vars and "reduced" not in program.global_block.vars
    assert program.metadata["gradient_merge"] == {"k_steps": 2, "avg": True, "update_block": 1,
                                                  "step": "gradient_merge@step",
                                                  "accumulators": {"w@GRAD": "w@GRAD@MERGE"}}
    assert report.stats == {"k_steps": 2, "accumulators": 1, "update_ops_moved": 2}


def test_a_value_only_the_update_computes_cannot_be_fetched():
    program = _collective_fixture()
    program.fetches["reduced"] = "reduced"
    with pytest.raises(fleetc.PassError, match="fetch 'reduced' is computed by the optimizer update"):
        GradientMerge().run(program, resolve_strategy(merge_strategy(2)))


def test_bad_checkpoints_are_rejected_with_the_var_named():
    _, trainer = compiled("mlp", "sgd", merge_strategy(2))
    with pytest.raises(fleetc.CheckpointError, match="as returned by CompiledTrainer.state_dict"):
        trainer.load_state_dict({"gradient_merge@step": torch.zeros(())})
    trainer.load_state_dict({"fleetc_owned": {"gradient_merge@step": torch.zeros(3, dtype=torch.int64)}})
    with pytest.raises(fleetc.CheckpointError, match=r"'gradient_merge@step' holds torch.int64\[3\]"):
        run_merged(trainer, "mlp", 1)
    _, bound = compiled("mlp", "sgd", merge_strategy(2))
    run_merged(bound, "mlp", 1)
    with pytest.raises(fleetc.CheckpointError, match="lacks fleetc state"):
        bound.load_state_dict({"fleetc_owned": {}})
