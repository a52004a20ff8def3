"""`lars` and `lamb`: against Paddle 3.3.1's numbers, plain-PyTorch references (Paddle rule and papers), and
composed with fusion, gradient merge and AMP."""
from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch
from helpers.amp import amp_strategy
from helpers.gradient_merge import merge_strategy
from helpers.layerwise import Lamb, Lars
from torch import nn
from zoo import ZOO

import fleetc

FIXTURES = json.loads((pathlib.Path(__file__).parent / "fixtures" / "paddle_lars_lamb.json").read_text())
CASES = FIXTURES["cases"]


class _Tensors(nn.Module):
    """The fixture's parameters; the loss sum(p * G) makes each gradient exactly the fed G."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Module()
        self.fc.weight = nn.Parameter(torch.tensor(FIXTURES["init"]["fc.weight"]))
        self.fc.bias = nn.Parameter(torch.tensor(FIXTURES["init"]["fc.bias"]))
        self.zero = nn.Module()
        self.zero.weight = nn.Parameter(torch.tensor(FIXTURES["init"]["zero.weight"]))

    def forward(self, g_weight, g_bias, g_zero):
        return (self.fc.weight * g_weight).sum() + (self.fc.bias * g_bias).sum() + (self.zero.weight * g_zero).sum()


def _strategy(case: dict) -> fleetc.DistributedStrategy:
    config, strategy = case["config"], fleetc.DistributedStrategy()
    if case["optimizer"] == "lars":
        strategy.lars = True
        strategy.lars_configs = {k: config[k] for k in ("lars_coeff", "lars_weight_decay", "epsilon",
                                                        "exclude_from_weight_decay")}
    else:
        strategy.lamb = True
        strategy.lamb_configs = {k: config[k] for k in ("lamb_weight_decay", "exclude_from_weight_decay")}
    return strategy


def _inner_optimizer(case: dict, params):
    config = case["config"]
    if case["optimizer"] == "lars":
        return torch.optim.SGD(params, lr=config["lr"], momentum=config["momentum"])
    return torch.optim.Adam(params, lr=config["lr"], betas=(config["beta1"], config["beta2"]), eps=config["epsilon"])


def _reference(case: dict, paddle: bool):
    config = case["config"]
    exclude = tuple(config["exclude_from_weight_decay"])
    if case["optimizer"] == "lars":
        return Lars(config["lr"], config["momentum"], config["lars_coeff"], config["lars_weight_decay"],
                    config["epsilon"], exclude, paddle)
    return Lamb(config["lr"], config["beta1"], config["beta2"], config["epsilon"], config["lamb_weight_decay"],
                exclude, paddle)


def _fixture_grads(step: int) -> tuple:
    return tuple(torch.tensor(FIXTURES["grads"][step][n]) for n in ("fc.weight", "fc.bias", "zero.weight"))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c['optimizer']}{i}" for i, c in enumerate(CASES)])
def test_compiled_update_matches_paddle(index):
    case = CASES[index]
    model = _Tensors()
    trainer = fleetc.compile(model, _strategy(case), optimizer=_inner_optimizer(case, model.parameters()),
                             verify=True)
    params = dict(model.named_parameters())
    for step, expected in enumerate(case["params"]):
        trainer.step(*_fixture_grads(step))
        for name, want in expected.items():
            torch.testing.assert_close(params[name], torch.tensor(want), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step}, {name}: {m}")
    assert trainer.report().stats[case["optimizer"]]["updates_replaced"] == 3


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c['optimizer']}{i}" for i, c in enumerate(CASES)])
def test_references_paddle_rule_matches_paddle_and_the_papers_differ_only_where_stated(index):
    """The papers adapt every layer; Paddle skips parameters without weight decay (excluded ones) and zero ones."""
    case = CASES[index]
    outcomes = {}
    for paddle in (True, False):
        model, reference = _Tensors(), _reference(case, paddle)
        params = dict(model.named_parameters())
        for step in range(len(case["params"])):
            reference.step(params, dict(zip(("fc.weight", "fc.bias", "zero.weight"), _fixture_grads(step))))
        outcomes[paddle] = {n: p.detach().clone() for n, p in params.items()}
    expected = {n: torch.tensor(v) for n, v in case["params"][-1].items()}
    for name, want in expected.items():
        torch.testing.assert_close(outcomes[True][name], want, rtol=1e-5, atol=1e-6)
    differs = {n for n, want in expected.items() if not torch.allclose(outcomes[False][n], want, rtol=1e-5, atol=1e-6)}
    excluded = {n for n in expected if any(p in n for p in case["config"]["exclude_from_weight_decay"])}
    assert differs == excluded | {"zero.weight"}


def _zoo_side_by_side(optimizer: str, strategy, reference, steps: int = 3, k_steps: int = 1):
    """The zoo MLP compiled under `strategy` next to eager forward/backward with `reference` doing the update
    (every k_steps, on the mean gradient)."""
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    eager = entry.make_model()
    compiled = copy.deepcopy(eager)
    opt = (torch.optim.SGD(compiled.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
           else torch.optim.Adam(compiled.parameters(), lr=0.01))
    trainer = fleetc.compile(compiled, strategy, optimizer=opt, loss_fn=entry.loss_fn, verify=True)
    params = dict(eager.named_parameters())
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        (x, y), _ = entry.make_batch(g)
        (entry.loss_fn(eager(x), y) / k_steps).backward()
        if (i + 1) % k_steps == 0:
            reference.step(params, {n: p.grad for n, p in params.items()})
            eager.zero_grad()
        trainer.step(x, y)
    return eager, compiled, trainer


def _layerwise(kind: str, base: fleetc.DistributedStrategy | None = None, **configs) -> fleetc.DistributedStrategy:
    strategy = base or fleetc.DistributedStrategy()
    setattr(strategy, kind, True)
    setattr(strategy, f"{kind}_configs", configs)
    return strategy


LARS_CONFIG = {"lars_coeff": 0.02, "lars_weight_decay": 0.01, "epsilon": 1e-6, "exclude_from_weight_decay": ["bias"]}
LAMB_CONFIG = {"lamb_weight_decay": 0.05, "exclude_from_weight_decay": ["bias"]}


def _references():
    return {"lars": ("sgd", lambda: Lars(0.1, 0.9, 0.02, 0.01, 1e-6, ("bias",))),
            "lamb": ("adam", lambda: Lamb(0.01, 0.9, 0.999, 1e-8, 0.05, ("bias",)))}


def _config(kind: str) -> dict:
    return LARS_CONFIG if kind == "lars" else LAMB_CONFIG


def _assert_models_close(eager, compiled) -> None:
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_zoo_model_matches_the_reference(kind):
    optimizer, make_reference = _references()[kind]
    eager, compiled, trainer = _zoo_side_by_side(optimizer, _layerwise(kind, **_config(kind)), make_reference())
    _assert_models_close(eager, compiled)
    report = trainer.report()
    assert report.stats[kind] == {"updates_replaced": 6, "excluded_from_weight_decay": 3}
    state = trainer.optimizer.state[compiled.fc1.weight]
    assert set(state) == ({"lars_velocity"} if kind == "lars" else {"exp_avg", "exp_avg_sq", "step"})


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_fused_updates_are_bit_identical(kind):
    optimizer, make_reference = _references()[kind]
    fused_strategy = _layerwise(kind, **_config(kind))
    fused_strategy.build_strategy.fuse_all_optimizer_ops = True
    _, fused, fused_trainer = _zoo_side_by_side(optimizer, fused_strategy, make_reference())
    _, plain, _ = _zoo_side_by_side(optimizer, _layerwise(kind, **_config(kind)), make_reference())
    for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
        assert torch.equal(a, b), name
    assert fused_trainer.report().stats["fuse_all_optimizer_ops"] == {"fused_ops": 1, "params_fused": 6,
                                                                     "ops_removed": 5}


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_under_gradient_merge_the_merged_gradient_is_used(kind):
    optimizer, make_reference = _references()[kind]
    eager, compiled, _ = _zoo_side_by_side(optimizer, _layerwise(kind, merge_strategy(2), **_config(kind)),
                                           make_reference(), steps=4, k_steps=2)
    _assert_models_close(eager, compiled)


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_under_amp_loss_scaling_the_update_is_unchanged(kind):
    """matmuls kept in float32, so AMP's exact power-of-two loss scaling is all that differs from the reference."""
    optimizer, make_reference = _references()[kind]
    strategy = _layerwise(kind, amp_strategy(custom_black_list=["matmul"]), **_config(kind))
    eager, compiled, _ = _zoo_side_by_side(optimizer, strategy, make_reference())
    _assert_models_close(eager, compiled)


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_pure_bf16_updates_float32_master_weights(kind):
    optimizer, make_reference = _references()[kind]
    strategy = _layerwise(kind, amp_strategy(use_pure_fp16=True, use_fp16_guard=False), **_config(kind))
    _, compiled, trainer = _zoo_side_by_side(optimizer, strategy, make_reference())
    program = trainer.program
    updates = [op for _, op in program.walk_ops() if op.type == f"fleetc.{'lars_momentum' if kind == 'lars' else kind}"]
    assert len(updates) == 6 and all(op.args[0].name.endswith("@master_weight") for op in updates)
    for param in compiled.parameters():
        master = trainer.optimizer.state[param]["master_weight"]
        assert param.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(param, master.to(torch.bfloat16)) and torch.isfinite(master).all()


def test_each_replaces_only_its_inner_optimizer_and_says_why():
    entry = ZOO["mlp"]
    for kind, optimizer, why in (("lars", torch.optim.Adam, "lars replaces Momentum"),
                                 ("lars", torch.optim.SGD, "lars replaces Momentum"),  # momentum 0: plain SGD
                                 ("lamb", torch.optim.AdamW, "lamb replaces Adam")):
        model = entry.make_model()
        trainer = fleetc.compile(model, _layerwise(kind), optimizer=optimizer(model.parameters(), lr=0.01),
                                 loss_fn=entry.loss_fn, verify=True)
        trainer.step(*entry.make_batch(torch.Generator().manual_seed(1))[0])
        assert trainer.report().skipped[kind].startswith(why)


def test_unmatched_exclusion_patterns_and_dropped_settings_are_reported():
    entry = ZOO["mlp"]
    model = entry.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    trainer = fleetc.compile(model, _layerwise("lars", exclude_from_weight_decay=["bias", "norm"]), optimizer=opt,
                             loss_fn=entry.loss_fn, verify=True)
    trainer.step(*entry.make_batch(torch.Generator().manual_seed(1))[0])
    notes = trainer.report().notes["lars"]
    assert "lars_configs.exclude_from_weight_decay: 'norm' is in no parameter name" in notes
    assert any("nesterov" in note for note in notes)
    assert not any("momentum_fresh" in name for name in trainer.program.feeds)  # LARS has no fresh flag
