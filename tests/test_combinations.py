"""Pass combinations on the zoo's GPT-style model (dropout on: RNG replay is exercised) and CNN.

Rule: a pass meant to be an exact rewrite (recompute, the fusion flags, auto fusion, fuse_all_optimizer_ops, the
memory planner's enable_inplace and memory_optimize) changes nothing but speed and memory, so a combination equals
the run with only its non-exact options (gradient merge, AMP bf16); with none, it matches eager PyTorch within fp32
tolerance. CI runs the all-on combinations and a few pairs; FLEETC_FULL=1 runs every pair.

Data parallel pairs run in 2 gloo processes on loopback, dropout off (each rank draws its own masks). The reference is
eager PyTorch accumulating over the same shards, gradient merge included. AMP has no exact eager counterpart, so
data parallel + AMP bf16 is compared with the single-process AMP run that accumulates the same shards by gradient
merge: each shard's forward and backward are the same computation in both, only the fp32 sums differ.
"""
from __future__ import annotations

import itertools
import os
from functools import cache

import pytest
import torch
from conftest import SideBySide, run_side_by_side
from fleet.spawn import assert_all_ok, spawn
from fleet.test_data_parallel import check_run
from fleet.workers import global_batches, make_model, shard
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.passes.order import fusion_flags

_CHECKPOINTS = {"gpt": ["layers.0", "layers.1"], "cnn": ["blocks.0", "blocks.1"]}
_INEXACT = ("gradient_merge", "amp_bf16")  # they change the numbers: the reference runs them too


def _options(model: str) -> dict[str, dict]:
    options = {
        "recompute_auto": {"recompute": True, "recompute_configs": {"checkpoints": "auto"}},
        "recompute_manual": {"recompute": True, "recompute_configs": {"checkpoints": _CHECKPOINTS[model]}},
        "gradient_merge": {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}},
        "amp_bf16": {"amp": True, "amp_configs": {"dtype": "bfloat16"}},
        "enable_auto_fusion": {"build_strategy.enable_auto_fusion": True},
        "memory_planner": {"build_strategy.enable_inplace": True, "build_strategy.memory_optimize": True},
    }
    options.update({flag: {f"build_strategy.{flag}": True} for flag in fusion_flags()})
    return options


def _settings(model: str, names: tuple[str, ...]) -> dict:
    """The options' fields as the nested dict `DistributedStrategy.from_dict` takes (and the rank workers set)."""
    settings: dict = {}
    for name in names:
        for key, value in _options(model)[name].items():
            section, _, field = key.partition(".")
            if field:
                settings.setdefault(section, {})[field] = value
            else:
                settings[key] = value
    return settings


def _strategy(model: str, names: tuple[str, ...]) -> fleetc.DistributedStrategy:
    return fleetc.DistributedStrategy.from_dict(_settings(model, names))


@cache
def _run(model: str, names: tuple[str, ...]) -> SideBySide:
    return run_side_by_side(model, "adamw", steps=4, strategy=_strategy(model, names))


def _check(model: str, names: tuple[str, ...]) -> None:
    run = _run(model, names)
    inexact = tuple(n for n in names if n in _INEXACT)
    if not inexact:
        run.assert_same()  # fp32, exact rewrites only: eager within fp32 tolerance
        return
    reference = _run(model, inexact)
    for step, (a, b) in enumerate(zip(run.compiled_losses, reference.compiled_losses)):
        assert torch.equal(a, b), f"{names}: loss of step {step} {a} != {b} with only {inexact}"
    for (name, a), b in zip(run.compiled_model.state_dict().items(), reference.compiled_model.state_dict().values()):
        assert torch.equal(a, b), f"{names}: {name} differs from the run with only {inexact}"


def _pairs(model: str) -> list[tuple[str, str]]:
    return [pair for pair in itertools.combinations(_options(model), 2)
            if set(pair) != {"recompute_auto", "recompute_manual"}]


_CI_PAIRS = [("recompute_manual", "amp_bf16"), ("fuse_dropout_add", "amp_bf16"), ("recompute_auto", "gradient_merge"),
             ("enable_auto_fusion", "fuse_all_optimizer_ops"), ("fuse_gemm_epilogue", "recompute_manual")]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_all_on(model):
    names = tuple(n for n in _options(model) if n != "recompute_auto")
    _check(model, names)


@pytest.mark.slow
@pytest.mark.parametrize("pair", _CI_PAIRS, ids="+".join)
def test_ci_pairs_on_gpt(pair):
    _check("gpt", pair)


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="every pair of options: FLEETC_FULL=1")
@pytest.mark.parametrize(("model", "pair"), [(model, pair) for model in ("gpt", "cnn") for pair in _pairs(model)],
                         ids=lambda value: "+".join(value) if isinstance(value, tuple) else value)
def test_every_pair(model, pair):
    _check(model, pair)


# ----- data parallel on 2 gloo processes --------------------------------------------------------------------------
_WORLD = 2


def _dp_config(model: str, name: str) -> dict:
    """Momentum SGD, not AdamW: gpt's key bias has a gradient that is zero but for rounding, which differs between
    an allreduce and one process's sum, and Adam's normalization turns that 1e-9 into a parameter difference."""
    return {"zoo": model, "optimizer": "momentum", "steps": 4, "dropout_off": True,
            "strategy": _settings(model, (name,))}


def _merged_over_shards(config: dict, initial: dict) -> tuple[list, dict]:
    """Single-process compiled training that accumulates the ranks' shards in turn by gradient merge."""
    entry = ZOO[config["zoo"]]
    model = make_model(config)
    model.load_state_dict(initial)
    k_steps = config["strategy"].get("gradient_merge_configs", {}).get("k_steps", 1)
    strategy = fleetc.DistributedStrategy.from_dict(
        {**config["strategy"], "gradient_merge": True, "gradient_merge_configs": {"k_steps": _WORLD * k_steps}})
    trainer = fleetc.compile(model, strategy, optimizer=OPTIMIZERS[config["optimizer"]](model.parameters()),
                             loss_fn=entry.loss_fn, verify=True)
    losses = [sum(trainer.step(*shard(batch, rank, _WORLD)) for rank in range(_WORLD)) / _WORLD
              for batch in global_batches(config["zoo"], config["steps"])]
    return losses, model.state_dict()


def _check_amp_against_merged_shards(results, index: int, config: dict) -> None:
    runs = [r.result["runs"][index] for r in results]
    losses, state = _merged_over_shards(config, runs[0]["initial"])
    for step in range(config["steps"]):
        got = sum(run["losses"][step] for run in runs) / _WORLD
        torch.testing.assert_close(got, losses[step], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, step=step: f"loss of step {step}: {m}")
    for name, want in state.items():
        if "running" in name or "num_batches" in name:  # merge ran each shard's BatchNorm; each rank ran one
            continue
        for run in runs:
            torch.testing.assert_close(run["state"][name], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")


def _check_data_parallel(model: str, names: list[str], tmp_path) -> None:
    configs = [_dp_config(model, name) for name in names]
    results = spawn(_WORLD, "train_configs", {"configs": configs}, tmp_path, deadline_s=120 + 60 * len(configs))
    assert_all_ok(results)
    for index, (name, config) in enumerate(zip(names, configs)):
        if name == "amp_bf16":
            _check_amp_against_merged_shards(results, index, config)
        else:
            check_run(results, index, _WORLD, config, per_shard=True)


_CI_DATA_PARALLEL = ["recompute_manual", "gradient_merge", "amp_bf16", "fuse_all_optimizer_ops"]


@pytest.mark.slow
def test_ci_data_parallel_pairs_on_gpt(tmp_path):
    _check_data_parallel("gpt", _CI_DATA_PARALLEL, tmp_path)


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="every option with data parallel: FLEETC_FULL=1")
@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_every_option_with_data_parallel(model, tmp_path):
    _check_data_parallel(model, list(_options(model)), tmp_path)
