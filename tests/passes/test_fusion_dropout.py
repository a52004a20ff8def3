"""Dropout + add fusion: counts on the zoo GPT, exact against the reference with the same mask, statistics."""
from __future__ import annotations

import torch
from fusion_helpers import fusion_strategy, op_types, stats

import fleetc
from conftest import run_side_by_side
from fleetc.ops.fused_add_act import fused_dropout_add, fused_dropout_add_grad

aten = torch.ops.aten


def test_gpt_residual_dropouts_fuse_forward_and_backward():
    run = run_side_by_side("gpt", "adamw", steps=2, strategy=fusion_strategy("fuse_dropout_add"))
    run.assert_same()
    # two residual dropouts per block; the embedding and attention-probability dropouts have no add after them
    assert stats(run.trainer, "fuse_dropout_add") == {"forward_groups": 4, "backward_groups": 4, "ops_removed": 4}
    types = op_types(run.trainer.program)
    assert types.count("aten.native_dropout.default") == 3 and types.count("fleetc.fused_dropout_add") == 4


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
