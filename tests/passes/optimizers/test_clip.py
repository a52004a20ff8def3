"""Gradient clipping inside the compiled step, against eager clipping between backward() and step()."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers.amp import amp_strategy, poisoned
from helpers.clip import clip_grads_
from helpers.gradient_merge import merge_strategy
from helpers.optimizers import TRACED
from zoo import OPTIMIZERS, ZOO

import fleetc

CLIPS = {"global_norm": fleetc.ClipGradByGlobalNorm(0.1),  # the MLP's gradient norm is 0.3 to 0.5
         "norm": fleetc.ClipGradByNorm(0.2),
         "value": fleetc.ClipGradByValue(0.01)}


def side_by_side(clip, optimizer="adamw", strategy=None, steps: int = 3, k_steps: int = 1, eager_clip=clip_grads_):
    """Eager MLP training that clips between backward() and step() (every k_steps, on the summed mean gradient)
    next to the compiled trainer with grad_clip; returns (eager model, compiled model, trainer, both losses)."""
    entry = ZOO["mlp"]
    make = optimizer if callable(optimizer) else OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    eager = entry.make_model()
    compiled = copy.deepcopy(eager)
    eager_opt = make(eager.parameters())
    trainer = fleetc.compile(compiled, strategy, optimizer=make(compiled.parameters()), loss_fn=entry.loss_fn,
                             verify=True, grad_clip=clip)
    g = torch.Generator().manual_seed(1)
    eager_losses, compiled_losses = [], []
    for i in range(steps):
        (x, y), _ = entry.make_batch(g)
        loss = entry.loss_fn(eager(x), y)
        (loss / k_steps).backward()
        if (i + 1) % k_steps == 0:
            eager_clip(eager.parameters(), clip)
            eager_opt.step()
            eager_opt.zero_grad()
        eager_losses.append(loss.detach())
        compiled_losses.append(trainer.step(x, y))
    return eager, compiled, trainer, eager_losses, compiled_losses


def assert_close_models(eager, compiled, rtol=1e-5, atol=1e-6) -> None:
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", sorted(CLIPS))
def test_clipping_matches_eager_paddle_rule(kind):
    eager, compiled, trainer, eager_losses, losses = side_by_side(CLIPS[kind])
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses))
    assert_close_models(eager, compiled)
    assert trainer.report().stats["grad_clip"] == {"gradients_clipped": 6}


def test_global_norm_matches_torch_clip_grad_norm_within_its_epsilon():
    """torch divides by norm + 1e-6: with a norm of about 0.4 that is a 3e-6 relative difference."""
    def torch_rule(params, clip):
        norm = torch.nn.utils.clip_grad_norm_(params, clip.clip_norm)
        assert norm > clip.clip_norm  # the clip is active, so the two rules differ
    eager, compiled, *_ = side_by_side(CLIPS["global_norm"], optimizer="sgd", eager_clip=torch_rule)
    assert_close_models(eager, compiled, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):  # tighter than the two rules' difference: they do differ
        assert_close_models(eager, compiled, rtol=0, atol=1e-8)


def test_by_value_matches_torch_clip_grad_value():
    eager, compiled, *_ = side_by_side(CLIPS["value"], optimizer="momentum",
                                       eager_clip=lambda ps, c: torch.nn.utils.clip_grad_value_(ps, c.max))
    assert_close_models(eager, compiled, rtol=0, atol=0)


def test_an_inactive_clip_changes_nothing():
    eager, compiled, *_ = side_by_side(fleetc.ClipGradByGlobalNorm(1e6), optimizer="sgd", eager_clip=lambda *a: None)
    assert_close_models(eager, compiled, rtol=0, atol=0)


def test_traced_optimizer_reads_the_clipped_gradients():
    eager, compiled, *_ = side_by_side(CLIPS["global_norm"], optimizer=TRACED["nadam"])
    assert_close_models(eager, compiled)


def test_under_gradient_merge_the_merged_gradient_is_clipped():
    eager, compiled, trainer, *_ = side_by_side(CLIPS["global_norm"], optimizer="momentum", strategy=merge_strategy(2),
                                                steps=4, k_steps=2)
    assert_close_models(eager, compiled)
    program = trainer.program
    update = program.blocks[program.metadata["gradient_merge"]["update_block"]]
    types = [op.type for op in update.ops]
    assert types.index("fleetc.divide") < types.index("fleetc.squared_global_norm") < types.index("fleetc.sgd")


def test_under_amp_the_unscaled_gradients_are_clipped_and_an_overflow_skips_the_update():
    """matmuls kept in float32, so AMP's loss scaling (2^15, exact) is all that differs from eager: same numbers."""
    strategy = amp_strategy(custom_black_list=["matmul"])
    eager, compiled, trainer, *_ = side_by_side(CLIPS["global_norm"], strategy=strategy)
    assert_close_models(eager, compiled)
    program = trainer.program
    types = [op.type for op in program.global_block.ops]
    skip_block = program.blocks[next(op.sub_block for op in program.global_block.ops if op.sub_block is not None)]
    assert types.index("fleetc.check_finite_and_unscale") < types.index("fleetc.conditional_block")
    assert [op.type for op in skip_block.ops][:2] == ["fleetc.squared_global_norm", "fleetc.clip_by_global_norm"]
    before = {n: p.detach().clone() for n, p in compiled.named_parameters()}
    trainer.step(*poisoned(ZOO["mlp"].make_batch(torch.Generator().manual_seed(7))[0]))
    assert all(torch.equal(p, before[n]) for n, p in compiled.named_parameters())


def test_fused_updates_read_the_clipped_gradients():
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.fuse_all_optimizer_ops = True
    eager, compiled, trainer, *_ = side_by_side(CLIPS["norm"], optimizer="adam", strategy=strategy)
    assert_close_models(eager, compiled)
    assert trainer.report().stats["fuse_all_optimizer_ops"]["fused_ops"] == 1


def test_bad_clip_settings_are_refused():
    with pytest.raises(fleetc.StrategyError, match="clip_norm must be a positive"):
        fleetc.ClipGradByGlobalNorm(0)
    with pytest.raises(fleetc.StrategyError, match="min must be a number below max"):
        fleetc.ClipGradByValue(1.0, min=2.0)
    with pytest.raises(fleetc.StrategyError, match="optimizer=None"):
        fleetc.compile(ZOO["mlp"].make_model(), grad_clip=CLIPS["norm"])
