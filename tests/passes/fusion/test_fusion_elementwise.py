"""Elementwise add + activation fusion: every activation in both shapes, the zoo CNN, overlap with bn+add+act."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import run_side_by_side
from fusion_helpers import fusion_strategy, op_types, stats
from torch import nn

import fleetc
from fleetc.ops.activations import ACTIVATIONS
from fleetc.ops.fused_add_act import fused_elemwise_add_act, fused_elemwise_add_act_grad
from fleetc.passes.fusion.elementwise import FuseElementwiseAddAct
from fleetc.passes.fusion.norm import FuseBnAddAct

# (activation, its constant, the torch function a user writes)
CASES = [
    ("relu", None, F.relu),
    ("gelu", "none", F.gelu),
    ("gelu", "tanh", lambda t: F.gelu(t, approximate="tanh")),
    ("silu", None, F.silu),
    ("sigmoid", None, torch.sigmoid),
    ("tanh", None, torch.tanh),
    ("leaky_relu", 0.1, lambda t: F.leaky_relu(t, 0.1)),
    ("scale", 0.5, lambda t: t * 0.5),
]


class EveryActivation(nn.Module):
    """act(a + b) for every activation, then a + act(b) for every activation; returns a scalar loss."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, z = self.a(x), self.b(x)
        outs = [fn(h + z) for _, _, fn in CASES] + [h + fn(z) for _, _, fn in CASES]
        return sum((o * o).mean() for o in outs)


def test_every_activation_fuses_in_both_shapes_and_trains_like_eager():
    torch.manual_seed(0)
    model = EveryActivation()
    eager = copy.deepcopy(model)
    trainer = fleetc.compile(model, fusion_strategy("fuse_elewise_add_act_ops"),
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1), verify=True)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g)
        eager_opt.zero_grad()
        expected = eager(x)
        expected.backward()
        eager_opt.step()
        torch.testing.assert_close(trainer.step(x), expected.detach(), rtol=1e-6, atol=1e-7)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert stats(trainer, "fuse_elewise_add_act") == {"forward_groups": 16, "backward_groups": 16, "ops_removed": 16}
    fused = [op for op in trainer.program.global_block.ops if op.type == "fleetc.fused_elemwise_add_act"]
    assert sorted((op.args[3], op.args[4], op.args[2]) for op in fused) == sorted(
        (name, param, first) for name, param, _ in CASES for first in (False, True))


def test_cnn_residual_add_relu_fuses_alone_but_yields_to_bn_add_act():
    alone = run_side_by_side("cnn", "sgd", steps=2, strategy=fusion_strategy("fuse_elewise_add_act_ops"))
    alone.assert_same()
    assert stats(alone.trainer, "fuse_elewise_add_act") == {"forward_groups": 2, "backward_groups": 2,
                                                           "ops_removed": 2}
    # bn+add+act runs first and claims the same adds: the outcome is fixed by pass order, every time
    both = run_side_by_side("cnn", "sgd", steps=2,
                            strategy=fusion_strategy("fuse_elewise_add_act_ops", "fuse_bn_add_act_ops"))
    both.assert_same()
    assert stats(both.trainer, "fuse_bn_add_act")["forward_groups"] == 2
    assert "fuse_elewise_add_act" in both.trainer.report().skipped
    assert "fleetc.fused_elemwise_add_act" not in op_types(both.trainer.program)
    # rerunning the passes on the captured Program gives the same Program, and every fused backward op
    # differentiates a fused forward op of the same pass (the same branch)
    captured = both.trainer.history["remove_noop_views"].program
    again = captured.clone()
    for fusion in (FuseBnAddAct(), FuseElementwiseAddAct()):
        again, _ = fusion.run(again, both.trainer.config)
    assert str(again) == str(both.trainer.history["fuse_elewise_add_act"].program)
    ops = {op.name: op for op in again.global_block.ops}
    grads = [op for op in ops.values() if op.type == "fleetc.fused_bn_act_grad"]
    assert len(grads) == 2 and all(ops[op.attrs["forward_op"]].type == "fleetc.fused_bn_add_act" for op in grads)


@pytest.mark.parametrize("act, param, fn", CASES)
@pytest.mark.parametrize("act_first", [False, True])
def test_references_match_unfused_aten_and_autograd(act, param, fn, act_first):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 7, generator=g, requires_grad=True)
    y = torch.randn(5, 7, generator=g, requires_grad=True)
    inter = fn(y) if act_first else x + y
    out = x + inter if act_first else fn(inter)
    got_out, got_inter = fused_elemwise_add_act(x.detach(), y.detach(), act_first, act, param)
    assert torch.equal(got_out, out.detach()) and torch.equal(got_inter, inter.detach())

    dout = torch.randn(5, 7, generator=g)
    dx, dy = torch.autograd.grad(out, (x, y), dout)
    saves = ACTIVATIONS[act].saves
    pre = y.detach() if act_first else inter.detach()
    post = got_inter if act_first else got_out
    saved = {"input": pre, "output": post, None: None}[saves]
    d_act = fused_elemwise_add_act_grad(dout, saved, act, param)
    torch.testing.assert_close(d_act, dy, rtol=1e-6, atol=1e-7)  # the activated addend's gradient
    torch.testing.assert_close(dout if act_first else d_act, dx, rtol=1e-6, atol=1e-7)
