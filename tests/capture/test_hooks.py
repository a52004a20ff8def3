"""Hooks are honoured where their meaning can be traced, refused at compile time where it cannot: never dropped."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.gradient_merge import merge_strategy
from helpers.side_by_side import Block, batches, train_pair
from torch import nn

import fleetc


def _clip_gradients(model: nn.Module, _=None) -> None:
    """The hooks people clip and scale gradients with: a gradient hook and post-accumulate-grad hooks."""
    model.fc.weight.register_hook(lambda grad: grad.clamp(-0.01, 0.01))
    model.fc.bias.register_hook(lambda grad: grad.mul_(2))  # in place, returns None

    def halve(param: torch.Tensor) -> None:
        param.grad.mul_(0.5)

    def norm_clip(param: torch.Tensor) -> None:
        torch.nn.utils.clip_grad_norm_([param], 0.1)
    model.head.weight.register_post_accumulate_grad_hook(halve)
    model.head.bias.register_post_accumulate_grad_hook(norm_clip)


def test_gradient_hooks_registered_before_compile_run_in_the_backward():
    pair = train_pair(Block, 3, {0: _clip_gradients})  # before the first step, which compiles
    pair.assert_same()
    assert pair.trainer.report().recompiles == []
    ops = pair.trainer.program.global_block.ops
    assert any(op.attrs.get("provenance") == "hooks" and op.type == "aten.clamp.default" for op in ops)


def test_gradient_hooks_added_after_compile_recompile():
    pair = train_pair(Block, 3, {1: _clip_gradients})
    pair.assert_same()
    assert "gradient hooks" in pair.trainer.report().recompiles[0]


def test_without_an_optimizer_hooked_gradients_land_in_grad():
    torch.manual_seed(0)
    eager, compiled = Block(), Block()
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        model.drop.p = 0.0
        _clip_gradients(model)
    trainer = fleetc.compile(compiled, loss_fn=F.cross_entropy)
    for x, y in batches(2):
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
        F.cross_entropy(eager(x), y).backward()
        trainer.step(x, y)
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    # Eager applies post-accumulate-grad hooks to the accumulated sum; fleetc to each step's gradient: say so.
    with pytest.raises(fleetc.CaptureError, match="post-accumulate-grad hooks.*zero_grad"):
        trainer.step(x, y)


def _count_step_hooks(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    calls = {"pre": 0, "post": 0}

    def pre(opt, args, kwargs):
        assert opt is optimizer and calls["pre"] == calls["post"]
        calls["pre"] += 1

    def post(opt, args, kwargs):
        calls["post"] += 1
    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)
    return calls


def test_optimizer_step_hooks_run_around_every_update():
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = _count_step_hooks(optimizer)
    trainer = fleetc.compile(model, optimizer=optimizer, loss_fn=F.cross_entropy)
    for x, y in batches(3):
        trainer.step(x, y)
    assert calls == {"pre": 3, "post": 3}


def test_under_gradient_merge_step_hooks_run_when_the_update_does():
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = _count_step_hooks(optimizer)
    trainer = fleetc.compile(model, merge_strategy(2), optimizer=optimizer, loss_fn=F.cross_entropy)
    for x, y in batches(5):
        trainer.step(x, y)
    assert calls == {"pre": 2, "post": 2}


def test_module_backward_hooks_are_refused_at_compile_time():
    model = Block()
    model.fc.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy)
    with pytest.raises(fleetc.CaptureError, match="fc backward hooks .*cannot trace module backward hooks"):
        trainer.step(*batches(1)[0])


def test_a_gradient_hook_reading_another_tensor_is_refused():
    model = Block()
    scale = torch.full((8, 8), 0.5)
    model.fc.weight.register_hook(lambda grad: grad * scale)
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy)
    with pytest.raises(fleetc.CaptureError, match="cannot trace the gradient hooks of 'fc.weight'"):
        trainer.step(*batches(1)[0])
