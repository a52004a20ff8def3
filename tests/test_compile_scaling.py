"""Compile work grows linearly with model depth: Op/Var visits of capture, every pass, the pass manager's own work
and codegen (deterministic counts, not times; fleetc.ir.visits) for a 32-layer nn.TransformerEncoder are at most
2.2x those of a 16-layer one, with the default strategy and with every fusion + recompute "auto" (issue 25).

The recompute min-cut runs in networkx, which the visit counter does not see; its Python function calls are
counted instead. The memory-budget search (`recompute_configs.memory_budget_mb`) builds, costs and (at worst) tries
about two candidate plans per repeated block, each a sweep over the whole forward region or Program: the test
bounds the number of sweeps, which grows linearly, so the search is quadratic in depth (planning per distinct
block would make it linear; not done).
"""
from __future__ import annotations

import sys

import pytest
from helpers.scaling import (
    STRATEGIES,
    all_passes_strategy,
    encoder_and_batch,
    stage_visits,
)

from fleetc.capture import capture_train_program
from fleetc.errors import PassStrategyError
from fleetc.ir.block_copies import REUSE_ENV
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.visits import count_visits
from fleetc.passes.base import PassReport
from fleetc.passes.fusion import dropout, elementwise, gemm
from fleetc.passes.manager import History, PassManager, PassRecord
from fleetc.passes.order import ordered_passes
from fleetc.passes.precision import amp
from fleetc.passes.recompute import Recompute, RecomputePolicy, auto, checkpoints
from fleetc.passes.recompute.auto import budget_plan, min_cut_plan
from fleetc.passes.recompute.plan import forward_region
from fleetc.strategy import resolve_conflicts, resolve_strategy

LIMIT = 2.2
SHALLOW, DEEP = 16, 32


@pytest.fixture(scope="module")
def visits() -> dict[int, dict[str, dict[str, int]]]:
    return {depth: stage_visits(depth) for depth in (SHALLOW, DEEP)}


def visit_ratios(shallow: dict[str, int], deep: dict[str, int]) -> dict[str, float]:
    """Each stage's visits at the deeper depth over those at the shallower one. A pass with nothing to do (the
    data-parallel passes in one process) looks at no op since the manager stopped copying the Program for each
    pass: no work at either depth is linear too, so such a stage is left out."""
    return {stage: deep[stage] / shallow[stage] if shallow[stage] else float("inf")
            for stage in shallow if not shallow[stage] == deep[stage] == 0}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_stage_grows_linearly(visits, strategy):
    shallow, deep = visits[SHALLOW][strategy], visits[DEEP][strategy]
    assert shallow.keys() == deep.keys()
    assert {"capture", "dead_code_elimination", "pass_manager", "codegen", "codegen_source"} <= shallow.keys()
    if strategy == "all_passes":
        assert {"recompute", "fuse_gemm_epilogue", "auto_fusion"} <= shallow.keys()
    ratios = visit_ratios(shallow, deep)
    superlinear = {stage: round(r, 2) for stage, r in ratios.items() if r > LIMIT}
    assert not superlinear, f"{DEEP} vs {SHALLOW} layers, visits ratio above {LIMIT}: {superlinear}"
    flat = {stage: (shallow[stage], deep[stage]) for stage, r in ratios.items() if r <= 1.5}
    assert not flat, f"a stage did not grow with depth at all (visits at {SHALLOW} and {DEEP} layers): {flat}"


def _min_cut_calls(depth: int) -> int:
    model, optimizer, batch = encoder_and_batch(depth)
    region = forward_region(capture_train_program(model, None, optimizer, batch, {}), RecomputePolicy())
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profile)
    try:
        min_cut_plan(region)
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.slow
def test_min_cut_grows_linearly():
    shallow, deep = _min_cut_calls(4), _min_cut_calls(8)
    assert 1.5 < deep / shallow <= LIMIT, (shallow, deep)


def _budget_search_sweeps(depth: int, monkeypatch) -> int:
    """Region- or Program-sized sweeps of a memory-budget search that fits nothing (so it tries every candidate):
    segment builds, re-run cost sums and peak estimates."""
    model, optimizer, batch = encoder_and_batch(depth)
    program = capture_train_program(model, None, optimizer, batch, {})
    policy = RecomputePolicy()
    sweeps = 0

    def counted(fn):
        def wrapper(*args, **kwargs):
            nonlocal sweeps
            sweeps += 1
            return fn(*args, **kwargs)
        return wrapper

    estimate = counted(lambda plan: Recompute(policy)._estimate_peak(program, plan))
    with monkeypatch.context() as patch, pytest.raises(PassStrategyError, match="no recompute plan fits"):
        patch.setattr(checkpoints, "_segments", counted(checkpoints._segments))
        patch.setattr(auto, "recompute_cost", counted(auto.recompute_cost))
        budget_plan(forward_region(program, policy), policy, 1e-6, estimate)
    return sweeps


@pytest.mark.slow
def test_memory_budget_search_sweeps_grow_linearly(monkeypatch):
    shallow, deep = _budget_search_sweeps(4, monkeypatch), _budget_search_sweeps(8, monkeypatch)
    # before candidates skipped the unused-checkpoint analysis: 33 → 87 sweeps (x2.6, quadratic in blocks)
    assert 1.5 < deep / shallow <= LIMIT, (shallow, deep)


def _matching_work(depth: int, reuse: bool, monkeypatch) -> dict[str, int]:
    """Op/Var visits inside the named fusions' matchers, and fake-tensor inputs built by AMP's dtype inference, in
    one run of the pass order with every fusion, recompute "auto" and AMP (the work reuse of repeated blocks saves;
    the rest of each pass is measured by test_every_stage_grows_linearly)."""
    monkeypatch.setenv(REUSE_ENV, "1" if reuse else "0")
    model, optimizer, batch = encoder_and_batch(depth)
    program = capture_train_program(model, None, optimizer, batch, {})
    strategy = all_passes_strategy()
    strategy.amp = True
    config, _ = resolve_conflicts(resolve_strategy(strategy))
    work = {"matchers": 0, "amp_fakes": 0}
    with count_visits() as counter, monkeypatch.context() as patch:
        def measured(fn, key):
            def wrapper(*args, **kwargs):
                start = counter.total
                try:
                    return fn(*args, **kwargs)
                finally:
                    work[key] += counter.total - start if key == "matchers" else 1
            return wrapper

        for module in (gemm, elementwise, dropout):
            patch.setattr(module, "_match_forward", measured(module._match_forward, "matchers"))
            patch.setattr(module, "_match_backward", measured(module._match_backward, "matchers"))
        patch.setattr(amp._CastRewriter, "fake", measured(amp._CastRewriter.fake, "amp_fakes"))
        history = History([PassRecord("capture", program, PassReport("capture"), 0.0, estimate_memory(program))])
        PassManager(ordered_passes(config)).run(program, config, history)
    return work


@pytest.mark.slow
def test_reuse_of_repeated_blocks_makes_matching_work_independent_of_depth(monkeypatch):
    """With reuse, the fusion matchers and AMP's inference run about once per distinct block: 4 → 8 layers (2 → 6
    identical middle layers) leaves their work nearly unchanged; without it, the work doubles (the measure sees
    the difference)."""
    reused = {depth: _matching_work(depth, True, monkeypatch) for depth in (4, 8)}
    plain = {depth: _matching_work(depth, False, monkeypatch) for depth in (4, 8)}
    for key in ("matchers", "amp_fakes"):
        assert reused[8][key] <= 1.25 * reused[4][key], (key, reused)
        assert plain[8][key] >= 1.6 * plain[4][key], (key, plain)
        assert reused[8][key] < plain[8][key] / 2, (key, reused, plain)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["amp_bf16", "amp_fp16"])
def test_amp_and_loss_scaling_grow_linearly(visits, strategy):
    """AMP's cast sweep and loss scaling (both dtypes scale the loss by default): before the producer index and the
    one splice of casts (precision/amp.py), AMP's visits grew x3.0 from 16 to 32 layers."""
    shallow, deep = visits[SHALLOW][strategy]["amp"], visits[DEEP][strategy]["amp"]
    assert 1.5 < deep / shallow <= LIMIT, (shallow, deep)


@pytest.mark.slow
def test_recompute_auto_by_pieces_grows_linearly(monkeypatch):
    """Recompute "auto" with its min-cut solved once per distinct piece of the blocks (FLEETC_BLOCK_REUSE=recompute,
    recompute/pieces.py), every fusion on: each stage's visits at 16 layers are at most 2.2x those at 8."""
    monkeypatch.setenv(REUSE_ENV, "recompute")
    shallow, deep = (stage_visits(depth, ("all_passes",))["all_passes"] for depth in (8, 16))
    ratios = visit_ratios(shallow, deep)
    assert "recompute" in ratios and all(1.5 < r <= LIMIT for r in ratios.values()), ratios
