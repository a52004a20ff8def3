"""Pass combinations on the zoo's GPT-style model (dropout on: RNG replay is exercised) and CNN.

Rule: a pass meant to be an exact rewrite (recompute, the fusion flags, auto fusion, fuse_all_optimizer_ops, the
memory planner's enable_inplace and memory_optimize) changes nothing but speed and memory, so a combination equals
the run with only its non-exact options (gradient merge, AMP bf16); with none, it matches eager PyTorch within fp32
tolerance. CI runs the all-on combinations and a few pairs; FLEETC_FULL=1 runs every pair. Data parallel is not in
this matrix (tests/fleet cover it on gloo processes).
"""
from __future__ import annotations

import itertools
import os
from functools import cache

import pytest
import torch
from conftest import SideBySide, run_side_by_side

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


def _strategy(model: str, names: tuple[str, ...]) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    for name in names:
        for key, value in _options(model)[name].items():
            section, _, field = key.partition(".")
            if field:
                setattr(getattr(strategy, section), field, value)
            else:
                setattr(strategy, key, value)
    return strategy


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
@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_every_pair(model):
    for pair in _pairs(model):
        _check(model, pair)
