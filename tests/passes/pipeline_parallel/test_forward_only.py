"""Forward-only pipelining in one process: evaluation calls run the stages' forward Programs micro-batch by
micro-batch (ForwardPipeline) and return what the eager model returns."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.pipeline import STAGED, TwoStageMLP, eager_accumulating_step
from torch import nn
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.runtime.pipeline_forward import ForwardPipeline


def _strategy(mode: str = "1F1B", vpp: int = 1) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2, "schedule_mode": mode,
                                 "vpp_degree": vpp}
    return strategy


@pytest.mark.parametrize("zoo_name, mode, vpp", [("gpt", "1F1B", 1), ("cnn", "FThenB", 1), ("gpt", "VPP", 2)])
def test_evaluation_runs_pipelined_and_matches_the_eager_model(zoo_name, mode, vpp):
    """After a training step, evaluation (eval mode: BatchNorm running statistics) through the stages equals the
    eager model's output, on the training batch and on another one."""
    make, optimizer_name = STAGED[zoo_name]
    torch.manual_seed(0)
    model = make(2 * vpp)
    reference = copy.deepcopy(model)
    trainer = fleetc.compile(model, _strategy(mode, vpp), optimizer=OPTIMIZERS[optimizer_name](model.parameters()),
                             loss_fn=ZOO[zoo_name].loss_fn, verify=True)
    g = torch.Generator().manual_seed(1)
    args, _ = ZOO[zoo_name].make_batch(g)
    trainer.step(*args)
    eager_accumulating_step(reference, OPTIMIZERS[optimizer_name](reference.parameters()), ZOO[zoo_name].loss_fn,
                            args, 2)
    reference.eval()
    for batch in (args[0], ZOO[zoo_name].make_batch(g)[0][0]):
        with torch.no_grad():
            expected = reference(batch)
        torch.testing.assert_close(trainer(batch), expected)
        assert isinstance(trainer._last_eval.pipeline, ForwardPipeline)
        assert trainer._last_eval.pipeline.plan.microbatches == 2
    notes = trainer._last_eval.report.notes["pipeline_split"]
    assert notes[0] == f"forward-only pipeline: {2 * vpp} stage(s), 2 micro-batch(es)"


class SummedOutput(TwoStageMLP):
    """An output without a batch dimension: it cannot be concatenated over micro-batches."""

    def forward(self, x):
        return super().forward(x).sum()


def test_an_output_without_batch_dimension_runs_as_one_microbatch():
    torch.manual_seed(0)
    model = SummedOutput()
    trainer = fleetc.compile(model, _strategy(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=lambda out, y: out * 0 + F.mse_loss(out, y.float().sum()))
    x = torch.randn(4, 4)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(trainer(x), expected)
    assert trainer._last_eval.pipeline.plan.microbatches == 1


class Unannotated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x):
        return self.a(x)


def test_evaluation_without_stages_runs_whole_with_the_reason():
    model = Unannotated()
    trainer = fleetc.compile(model, _strategy(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=F.cross_entropy)
    x = torch.randn(4, 4)
    torch.testing.assert_close(trainer(x), model(x).detach())
    assert trainer._last_eval.pipeline is None
    assert "without device_guard stages runs whole" in trainer._last_eval.report.skipped["pipeline_split"]
