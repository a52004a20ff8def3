"""Any single-step torch.optim optimizer: traced updates match eager, hyperparameters are fed, state is per parameter."""
from __future__ import annotations

import contextlib
import copy
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import run_side_by_side
from helpers.amp import amp_trainer
from helpers.gradient_merge import assert_same_state, compiled, eager_accumulation, merge_strategy, run_merged
from helpers.optimizers import HAND_WRITTEN, TRACED
from torch import nn
from zoo import ZOO

import fleetc
from fleetc.capture.optimizer import traced_updates_only
from fleetc.ir.program import Program, VarKind
from fleetc.ir.serialize import program_from_json, program_to_json

FULL = os.environ.get("FLEETC_FULL") == "1"


def _op_types(trainer) -> set[str]:
    return {op.type for _, op in trainer.program.walk_ops()}


@pytest.mark.parametrize("optimizer_name", sorted(TRACED))
def test_traced_update_matches_eager(optimizer_name):
    run = run_side_by_side("mlp", TRACED[optimizer_name])
    run.assert_same()
    meta = run.trainer.program.metadata["optimizer"]
    assert (meta["traced"], meta["hand_written"]) == (6, 0)
    assert not {"fleetc.sgd", "fleetc.adam"} & _op_types(run.trainer)


# one traced optimizer per zoo model (mlp runs them all above); FLEETC_FULL=1: every model with every optimizer
ZOO_RUNS = ([(z, o) for z in sorted(ZOO) for o in sorted(TRACED)] if FULL else
            [("gpt", "rmsprop"), ("cnn", "adagrad"), ("unused_param", "adamax"), ("loss_dict", "asgd")])


@pytest.mark.slow
@pytest.mark.parametrize("zoo_name, optimizer_name", ZOO_RUNS)
def test_traced_update_matches_eager_on_the_zoo(zoo_name, optimizer_name):
    run_side_by_side(zoo_name, TRACED[optimizer_name]).assert_same()


@pytest.mark.parametrize("optimizer_name", sorted(HAND_WRITTEN))
def test_every_sgd_and_adam_option_matches_eager(optimizer_name):
    run = run_side_by_side("mlp", HAND_WRITTEN[optimizer_name])
    run.assert_same(rtol=0, atol=0)
    assert run.trainer.program.metadata["optimizer"]["hand_written"] == 6


@pytest.mark.parametrize("optimizer_name", ["adam", "adamw"])
def test_adam_and_adamw_traced_match_eager_bit_for_bit(optimizer_name):
    with traced_updates_only():
        run = run_side_by_side("mlp", optimizer_name)
    run.assert_same(rtol=0, atol=0)
    assert run.trainer.program.metadata["optimizer"]["traced"] == 6


def test_traced_ops_update_state_in_place_and_read_fed_hyperparameters():
    run = run_side_by_side("mlp", TRACED["rmsprop"], steps=1)
    program = run.trainer.program
    assert [n for n in program.feeds if "@group" in n] == ["lr@group0", "momentum@group0", "alpha@group0",
                                                          "eps@group0", "weight_decay@group0"]
    square_avg = [op for _, op in program.walk_ops() if op.outputs == ["fc1.weight@square_avg"]]
    assert [op.type for op in square_avg] == ["aten.mul_.Tensor", "aten.addcmul_.default"]
    assert all(op.attrs["param"] == "fc1.weight" for op in square_avg)
    assert "fleetc.scalar_sub" in _op_types(run.trainer)  # 1 - alpha, computed from the fed alpha every step


def _train_with_schedule(make_optimizer, make_scheduler, steps: int):
    """Eager and compiled MLPs under the same scheduler; returns both models and the trainer."""
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    eager = entry.make_model()
    compiled = copy.deepcopy(eager)
    opts = [make_optimizer(m.parameters()) for m in (eager, compiled)]
    schedulers = [make_scheduler(o) for o in opts]
    trainer = fleetc.compile(compiled, optimizer=opts[1], loss_fn=entry.loss_fn, verify=True)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a scheduler's call-order warning fails the test
        for _ in range(steps):
            (x, y), _ = entry.make_batch(g)
            opts[0].zero_grad()
            entry.loss_fn(eager(x), y).backward()
            opts[0].step()
            trainer.step(x, y)
            for scheduler in schedulers:
                scheduler.step()
    return eager, compiled, trainer, opts[1]


@pytest.mark.parametrize("traced", [False, True])
def test_one_cycle_changes_betas_without_recompiling(traced):
    def one_cycle(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8, cycle_momentum=True)

    make = (lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True)) if traced else (lambda p: torch.optim.Adam(p))
    eager, compiled, trainer, opt = _train_with_schedule(make, one_cycle, steps=6)
    assert opt.param_groups[0]["betas"][0] != 0.95  # OneCycleLR moved beta1 every step
    assert len(trainer._cache) == 1
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_schedulers_do_not_warn_about_call_order():
    _train_with_schedule(lambda p: torch.optim.SGD(p, lr=0.1),
                         lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5), steps=3)


def test_param_groups_with_different_hyperparameters():
    def grouped(params):
        params = list(params)
        return torch.optim.RMSprop([{"params": params[:2], "lr": 0.02, "alpha": 0.9, "weight_decay": 0.1},
                                    {"params": params[2:], "momentum": 0.5}], lr=1e-2)

    run = run_side_by_side("mlp", grouped)
    run.assert_same()
    feeds = run.trainer.program.feeds
    assert "weight_decay@group0" in feeds and "weight_decay@group1" not in feeds  # zero decay takes no branch
    assert "momentum@group1" in feeds and "momentum@group0" not in feeds


def test_hyperparameter_edits_take_effect_and_a_sign_change_recompiles():
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    eager = entry.make_model()
    compiled = copy.deepcopy(eager)
    opts = [torch.optim.NAdam(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    trainer = fleetc.compile(compiled, optimizer=opts[1], loss_fn=entry.loss_fn, verify=True)
    g = torch.Generator().manual_seed(1)
    edits = [{}, {"lr": 3e-3, "betas": (0.8, 0.99)}, {"eps": 1e-3}, {"weight_decay": 0.1}, {"weight_decay": 0.2}]
    programs = []
    for edit in edits:
        for opt in opts:
            opt.param_groups[0].update(edit)
        (x, y), _ = entry.make_batch(g)
        opts[0].zero_grad()
        entry.loss_fn(eager(x), y).backward()
        opts[0].step()
        trainer.step(x, y)
        programs.append(trainer.program)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # fed values change nothing; weight decay switching on is a branch in torch's update: one new Program
    assert [p is programs[0] for p in programs] == [True, True, True, False, False]
    assert programs[3] is programs[4] and len(trainer._cache) == 2


class _OptionalBranch(nn.Module):
    """`extra` gets gradients only when the optional input is given (a second input signature)."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(8, 8)
        self.body = nn.Linear(8, 8)

    def forward(self, x, extra=None):
        h = self.body(x)
        return h if extra is None else h + self.extra(extra)


def test_momentum_buffer_freshness_is_per_parameter():
    """A parameter that first gets a gradient later starts its momentum at its gradient (torch: no buffer yet),
    while the others keep theirs. `extra` comes first in the group, so it would be a per-group probe."""
    torch.manual_seed(0)
    eager = _OptionalBranch()
    compiled = copy.deepcopy(eager)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.5) for m in (eager, compiled)]
    trainer = fleetc.compile(compiled, optimizer=opts[1], loss_fn=F.mse_loss, verify=True)
    g = torch.Generator().manual_seed(1)
    for use_extra in (False, False, True, True):
        x, target = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        kwargs = {"extra": torch.randn(4, 8, generator=g)} if use_extra else {}
        opts[0].zero_grad()
        F.mse_loss(eager(x, **kwargs), target).backward()
        opts[0].step()
        trainer.step(x, target, **kwargs)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    flags = [f["var"] for f in trainer.program.metadata["optimizer"]["feeds"] if "absent" in f]
    assert flags == [f"{p}@momentum_fresh" for p in ("extra.weight", "extra.bias", "body.weight", "body.bias")]


def test_update_that_branches_on_the_step_count_is_refused_with_the_reason():
    model = ZOO["mlp"].make_model()
    trainer = fleetc.compile(model, optimizer=torch.optim.Adafactor(model.parameters()), loss_fn=F.cross_entropy)
    with pytest.raises(fleetc.UnsupportedOptimizerError, match="cannot trace Adafactor's update.*step count"):
        trainer.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))


def _amp_runs(pure: bool) -> tuple:
    """Adam under AMP (bf16), captured by hand and by tracing: the same arithmetic, so the same numbers."""
    runs = []
    for traced in (False, True):
        with traced_updates_only() if traced else contextlib.nullcontext():
            trainer, entry = amp_trainer("mlp", "adam", use_pure_fp16=pure, use_fp16_guard=False)
            g = torch.Generator().manual_seed(1)
            losses = [trainer.step(*entry.make_batch(g)[0]) for _ in range(3)]
        runs.append((trainer, losses))
    return runs


@pytest.mark.parametrize("pure", [False, True])
def test_traced_update_under_amp_equals_the_hand_written_one(pure):
    (hand, hand_losses), (traced, traced_losses) = _amp_runs(pure)
    assert traced.program.metadata["optimizer"]["traced"] == 6
    assert torch.equal(torch.stack(hand_losses), torch.stack(traced_losses))
    for (name, a), b in zip(hand.model.named_parameters(), traced.model.parameters()):
        assert torch.equal(a, b), name
    updates = [op for _, op in traced.program.walk_ops() if op.attrs.get("param") == "fc1.weight"]
    written = {name for op in updates for name in op.defined if traced.program.var(name).kind is not VarKind.TEMP}
    if pure:  # the update writes the fp32 master and state; one assign rounds the master into the bf16 parameter
        assert written == {"fc1.weight@master_weight", "fc1.weight@exp_avg", "fc1.weight@exp_avg_sq",
                           "fc1.weight@step"}
        assert traced.program.var("fc1.weight").dtype == "bfloat16"
    assert all(traced.program.var(name).dtype == "float32" for name in written if name != "fc1.weight@step")


def test_traced_update_under_gradient_merge_matches_eager_accumulation():
    make = TRACED["rmsprop"]
    model, trainer = compiled("mlp", make, merge_strategy(2))
    losses = run_merged(trainer, "mlp", 4)
    eager_model, eager_losses = eager_accumulation("mlp", make, 2, True, 4)
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses))
    assert_same_state(model.state_dict(), eager_model.state_dict())


@pytest.mark.parametrize("optimizer_name", ["rprop", "adagrad"])  # a scalar constant made by an op; fleetc.item
def test_traced_program_round_trips_through_text_and_json(optimizer_name):
    run = run_side_by_side("mlp", TRACED[optimizer_name], steps=1)
    program = run.trainer.program
    assert str(Program.parse(str(program))) == str(program)
    assert str(program_from_json(program_to_json(program))) == str(program)


class _SignSGD(torch.optim.Optimizer):
    """A user's own torch.optim optimizer: `p -= lr * sign(g)`, written through a view when `through_view`."""

    def __init__(self, params, lr: float = 1e-2, through_view: bool = False):
        super().__init__(params, {"lr": lr, "through_view": through_view})

    def _init_group(self, group, params):  # no state
        pass

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    target = p.view(-1) if group["through_view"] else p
                    target.add_(p.grad.sign().view_as(target), alpha=-group["lr"])


def test_a_users_own_optimizer_is_traced_and_a_write_through_a_view_refused():
    run_side_by_side("mlp", _SignSGD).assert_same(rtol=0, atol=0)
    model = ZOO["mlp"].make_model()
    trainer = fleetc.compile(model, optimizer=_SignSGD(model.parameters(), through_view=True), loss_fn=F.cross_entropy)
    with pytest.raises(fleetc.UnsupportedOptimizerError, match="writes 'fc1.weight' through a view"):
        trainer.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
