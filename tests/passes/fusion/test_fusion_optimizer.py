"""Optimizer fusion: one multi-tensor op per group, bit-identical to torch.optim, no per-parameter item()."""
from __future__ import annotations

import pytest
import torch
from conftest import run_side_by_side
from fusion_helpers import fusion_strategy, op_types, stats
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.ops.fused_optimizer import fused_adam, fused_sgd
from fleetc.ops.optimizer import adam, sgd


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_fused_updates_are_bit_identical_to_torch_optim(optimizer_name):
    run = run_side_by_side("mlp", optimizer_name, strategy=fusion_strategy("fuse_all_optimizer_ops"))
    run.assert_same(rtol=0, atol=0)
    assert stats(run.trainer, "fuse_all_optimizer_ops") == {"fused_ops": 1, "params_fused": 6, "ops_removed": 5}
    assert not {"fleetc.sgd", "fleetc.adam"} & set(op_types(run.trainer.program))


def test_one_fused_op_per_hyperparameter_group():
    torch.manual_seed(0)
    model = ZOO["cnn"].make_model()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3)
    trainer = fleetc.compile(model, fusion_strategy("fuse_all_optimizer_ops"), optimizer=opt,
                             loss_fn=ZOO["cnn"].loss_fn, verify=True)
    args, _ = ZOO["cnn"].make_batch(torch.Generator().manual_seed(1))
    trainer.step(*args)
    assert stats(trainer, "fuse_all_optimizer_ops") == {"fused_ops": 2, "params_fused": 17, "ops_removed": 15}
    assert float(opt.state_dict()["state"][0]["step"]) == 1.0


def test_unused_param_gets_no_update_and_no_state():
    run = run_side_by_side("unused_param", "adamw", strategy=fusion_strategy("fuse_all_optimizer_ops"))
    run.assert_same(rtol=0, atol=0)
    assert stats(run.trainer, "fuse_all_optimizer_ops")["params_fused"] == 2


def _tensors(seed, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g) for _ in range(n)]


@pytest.mark.parametrize("momentum, nesterov, fresh", [(0.0, False, False), (0.9, False, True), (0.9, True, False)])
def test_fused_sgd_equals_per_parameter_sgd(momentum, nesterov, fresh):
    params, grads, bufs = _tensors(0), _tensors(1), _tensors(2) if momentum else None
    ref_params, ref_bufs = [p.clone() for p in params], [b.clone() for b in bufs] if bufs else [None] * 3
    fused_sgd(params, grads, bufs, [fresh] * 3, 0.1, momentum, 0.1 if not nesterov else 0.0, nesterov, 1e-2, True)
    for p, g, b in zip(ref_params, grads, ref_bufs):
        sgd(p, g, b, fresh, 0.1, momentum, 0.1 if not nesterov else 0.0, nesterov, 1e-2, True)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    if bufs:
        assert all(torch.equal(a, b) for a, b in zip(bufs, ref_bufs))


@pytest.mark.parametrize("decoupled", [False, True])
def test_fused_adam_equals_per_parameter_adam_without_item(decoupled, monkeypatch):
    params, grads = _tensors(0), _tensors(1)
    m, v = [t.abs() for t in _tensors(2)], [t.abs() for t in _tensors(3)]
    steps = [torch.tensor(4.0) for _ in params]
    ref = [[t.clone() for t in ts] for ts in (params, m, v, steps)]
    for args in zip(*ref[:3], grads, ref[3]):
        p, m_, v_, g, s = args
        adam(p, g, m_, v_, s, 1e-2, 0.9, 0.99, 1e-8, 1e-2, decoupled, False)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("per-parameter item() in the fused update"))
    fused_adam(params, grads, m, v, steps, 1e-2, 0.9, 0.99, 1e-8, 1e-2, decoupled, False)
    for got, want in zip((params, m, v, steps), ref):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
