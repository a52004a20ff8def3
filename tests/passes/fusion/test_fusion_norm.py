"""Batch norm fusion: bn+act and bn+add+act on the zoo CNN (counts, eval, training) and the references."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import run_side_by_side
from fusion_helpers import assert_close_all, fusion_strategy, op_types, stats
from zoo import ZOO

import fleetc
from fleetc.ops.fused_norm import fused_bn_act, fused_bn_act_grad, fused_bn_add_act

aten = torch.ops.aten


def test_cnn_bn_add_act_fuses_both_residual_blocks_forward_and_backward():
    run = run_side_by_side("cnn", "momentum", strategy=fusion_strategy("fuse_bn_add_act_ops"))
    run.assert_same()
    assert stats(run.trainer, "fuse_bn_add_act") == {"forward_groups": 2, "backward_groups": 2, "ops_removed": 10}
    types = op_types(run.trainer.program)
    assert types.count("fleetc.fused_bn_add_act") == 2 and types.count("fleetc.fused_bn_act_grad") == 2
    assert types.count("aten.relu.default") == 3  # the stem's and each block's first bn+relu stay unfused


def test_cnn_bn_act_fuses_stem_and_first_bn_of_each_block():
    run = run_side_by_side("cnn", "sgd", strategy=fusion_strategy("fuse_bn_act_ops"))
    run.assert_same()
    assert stats(run.trainer, "fuse_bn_act") == {"forward_groups": 3, "backward_groups": 3, "ops_removed": 12}
    types = op_types(run.trainer.program)
    assert types.count("fleetc.fused_bn_act") == 3
    assert "aten.threshold_backward.default" in types  # the residual blocks' relu backward is not bn+act


def test_cnn_eval_program_fuses_with_running_statistics():
    strategy = fusion_strategy("fuse_bn_act_ops", "fuse_bn_add_act_ops")
    run = run_side_by_side("cnn", "sgd", strategy=strategy)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    run.eager_model.eval()
    with torch.no_grad():
        expected = run.eager_model(x)
    torch.testing.assert_close(run.trainer(x), expected, rtol=0, atol=0)  # bit-identical on CPU
    types = op_types(run.trainer.eval_program)
    assert types.count("fleetc.fused_bn_act") == 3 and types.count("fleetc.fused_bn_add_act") == 2
    assert "aten.relu.default" not in types


def test_flag_without_pattern_says_so_in_report():
    run = run_side_by_side("mlp", "sgd", steps=1, strategy=fusion_strategy("fuse_bn_act_ops"))
    reason = run.trainer.report().skipped["fuse_bn_act"]
    assert "no batch norm followed by an activation" in reason


def _bn_inputs(dtype, channels=6):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, channels, 5, 5, generator=g).to(dtype)
    z = torch.randn(4, channels, 5, 5, generator=g).to(dtype)
    w, b = torch.rand(channels, generator=g) + 0.5, torch.randn(channels, generator=g)
    rm, rv = torch.randn(channels, generator=g), torch.rand(channels, generator=g) + 0.5
    return x, z, w, b, rm, rv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("with_add", [False, True])
def test_bn_references_match_the_unfused_aten_sequence(dtype, training, with_add):
    x, z, w, b, rm, rv = _bn_inputs(dtype)
    rm_ref, rv_ref = rm.clone(), rv.clone()
    if training:
        normed, mean, rstd, new_rm, new_rv = aten._native_batch_norm_legit_functional(x, w, b, rm_ref, rv_ref, True,
                                                                                      0.1, 1e-5)
        rm_ref.copy_(new_rm)
        rv_ref.copy_(new_rv)
    else:
        normed, mean, rstd = aten._native_batch_norm_legit_no_training(x, w, b, rm_ref, rv_ref, 0.1, 1e-5)
    pre = aten.add(normed, z) if with_add else normed
    expected = (aten.relu(pre), pre, mean, rstd)
    if with_add:
        got = fused_bn_add_act(x, z, w, b, rm, rv, training, 0.1, 1e-5, "relu", None)
    else:
        got = fused_bn_act(x, w, b, rm, rv, training, 0.1, 1e-5, "relu", None)
    assert_close_all(got, expected, rtol=0, atol=0)
    assert torch.equal(rm, rm_ref) and torch.equal(rv, rv_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act, param", [("relu", None), ("gelu", "tanh"), ("silu", None)])
def test_bn_grad_reference_matches_the_unfused_aten_sequence(dtype, act, param):
    x, dout, w, b, rm, rv = _bn_inputs(dtype)
    normed, mean, rstd = aten._native_batch_norm_legit(x, w, b, rm, rv, True, 0.1, 1e-5)
    out = {"relu": aten.relu(normed), "gelu": normed, "silu": normed}[act]  # what each act's grad reads
    if act == "relu":
        dpre = aten.threshold_backward(dout, out, 0)
    elif act == "gelu":
        dpre = aten.gelu_backward(dout, normed, approximate="tanh")
    else:
        dpre = aten.silu_backward(dout, normed)
    expected = (*aten.native_batch_norm_backward(dpre, x, w, rm, rv, mean, rstd, True, 1e-5, [True, True, True]), dpre)
    got = fused_bn_act_grad(dout, out, x, w, rm, rv, mean, rstd, True, 1e-5, [True, True, True], act, param)
    assert_close_all(got, expected, rtol=0, atol=0)


@pytest.mark.slow
def test_bf16_cnn_trains_with_bn_fusions_like_eager():
    """A bf16 model (bf16 running stats, so capture casts the new stats before assigning them) fuses, bit for bit."""
    torch.manual_seed(0)
    model = ZOO["cnn"].make_model()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.bfloat16), torch.randint(0, 10, (4,))
    for m in (model, reference):
        m.to(torch.bfloat16)
    trainer = fleetc.compile(model, fusion_strategy("fuse_bn_act_ops", "fuse_bn_add_act_ops"),
                             loss_fn=torch.nn.functional.cross_entropy, verify=True)
    loss = trainer.step(x, y)
    expected = torch.nn.functional.cross_entropy(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    for (name, buf), ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(buf, ref, rtol=0, atol=0, msg=name)
    assert stats(trainer, "fuse_bn_add_act")["backward_groups"] == 2
