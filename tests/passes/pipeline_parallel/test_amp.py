"""Pipeline × AMP in one process (LocalPipeline): found_inf is summed over the stages, so every stage skips the
same steps, and every stage's loss-scaling state (scale, good and bad step counts) stays the one of the same
strategy without pipeline."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.pipeline import (
    SCALING_STATE,
    StagedGPT,
    TwoStageMLP,
    amp_pipeline_strategy,
)
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.errors import StrategyError


def _strategy(microbatches: int, pipeline: bool, mode: str = "1F1B", **amp) -> fleetc.DistributedStrategy:
    """Micro-batches of 2 samples (see amp_pipeline_strategy)."""
    return amp_pipeline_strategy({"microbatches": microbatches, "batch": 2 * microbatches, "mode": mode,
                                  "amp": amp}, pipeline)


def _scaling_state_per_stage(trainer) -> dict[int, list[float]]:
    """Every stage's own copy of (scale, good steps, bad steps)."""
    pipe = trainer._last_train.pipeline
    held = [pipe.held_values(name) for name in SCALING_STATE]
    assert set(held[0]) == set(range(pipe.schedule.stages))       # every stage holds the state
    return {s: [float(values[s]) for values in held] for s in held[0]}


def _scaling_state(trainer) -> list[float]:
    return [float(trainer.counters[name]) for name in SCALING_STATE]


@pytest.mark.parametrize("mode", ["1F1B", "ZBH1"])
def test_amp_pipeline_matches_the_same_strategy_without_pipeline(mode):
    """bf16 GPT on 2 stages (tied embeddings on both) against AMP with gradient merge over the same micro-batches:
    losses, parameters and every stage's loss-scaling state agree (the scale grows every 2 clean steps)."""
    m = 2
    torch.manual_seed(0)
    model = StagedGPT(2)
    reference = copy.deepcopy(model)
    amp = {"incr_every_n_steps": 2}
    trainer = fleetc.compile(model, _strategy(m, True, mode, **amp), optimizer=OPTIMIZERS["adam"](model.parameters()),
                             loss_fn=ZOO["gpt"].loss_fn, verify=True)
    merged = fleetc.compile(reference, _strategy(m, False, **amp),
                            optimizer=OPTIMIZERS["adam"](reference.parameters()), loss_fn=ZOO["gpt"].loss_fn)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        args, _ = ZOO["gpt"].make_batch(g)
        loss = trainer.step(*args)
        expected = torch.stack([merged.step(*micro) for micro in zip(*(a.chunk(m) for a in args))]).mean()
        torch.testing.assert_close(loss, expected, msg=lambda msg, step=step: f"step {step}: {msg}")
        for stage, state in _scaling_state_per_stage(trainer).items():
            assert state == _scaling_state(merged), f"step {step}, stage {stage}"
    assert _scaling_state(merged)[0] == 2.0 ** 16          # the scale grew once: the state really moves
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=lambda msg, name=name: f"{name}: {msg}")
    report = trainer.report()
    assert {"amp", "pipeline_split"} <= set(report.applied)


def test_an_overflow_on_one_stage_skips_the_step_on_every_stage():
    """Stage 1's huge weight overflows only the gradients of stage 0 (checked in eager); stage 1 skips the step
    too, and both keep the scaling state of the same strategy without pipeline."""
    scale = 2.0 ** 15
    torch.manual_seed(0)
    model = TwoStageMLP()
    model.make_overflow()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]
    probe = copy.deepcopy(model)         # eager: which stage's gradients overflow once scaled
    (F.cross_entropy(probe(batches[0][0]), batches[0][1]) * scale).backward()
    assert all(torch.isfinite(p.grad).all() for p in probe.b.parameters())
    assert not all(torch.isfinite(p.grad).all() for p in probe.a.parameters())
    amp = {"init_loss_scaling": scale, "decr_every_n_nan_or_inf": 2, "decr_ratio": 0.5}
    trainer = fleetc.compile(model, _strategy(2, True, **amp),
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy)
    plain = fleetc.DistributedStrategy()
    plain.amp, plain.amp_configs = True, {"dtype": "bfloat16", **amp}
    whole = fleetc.compile(reference, plain, optimizer=torch.optim.SGD(reference.parameters(), lr=0.1),
                           loss_fn=F.cross_entropy)
    before = copy.deepcopy(model.state_dict())
    expected_states = [[scale, 0.0, 1.0], [scale / 2, 0.0, 0.0]]  # one bad step, then the second halves the scale
    for step, batch in enumerate(batches):
        assert torch.isfinite(trainer.step(*batch))
        whole.step(*batch)
        assert _scaling_state(whole) == expected_states[step]
        assert _scaling_state_per_stage(trainer) == {0: expected_states[step], 1: expected_states[step]}
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} was updated on an overflowing step"


def test_amp_with_vpp_is_refused_by_name():
    model = StagedGPT(4)
    strategy = _strategy(2, True, "VPP")
    strategy.pipeline_configs = {"vpp_degree": 2}
    with pytest.raises(StrategyError, match=r"amp \(found_inf\) with schedule_mode VPP is not supported yet"):
        fleetc.compile(model, strategy, optimizer=OPTIMIZERS["sgd"](model.parameters()),
                       loss_fn=ZOO["gpt"].loss_fn).step(*ZOO["gpt"].make_batch(torch.Generator())[0])
