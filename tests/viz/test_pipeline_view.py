"""The HTML report draws the pipeline schedule as a timeline (rank × time)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fleetc
from fleetc.viz.report import report_html


def test_report_draws_one_box_per_compute_action():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    strategy = fleetc.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 3, "schedule_mode": "ZBH1"}
    strategy.hybrid_configs = {"pp_degree": 2}
    trainer = fleetc.compile(model, strategy, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=F.cross_entropy)
    trainer.step(torch.randn(6, 4), torch.randint(0, 3, (6,)))
    html = report_html(trainer.history)
    assert "pipeline timeline (ZBH1, simulated with uniform costs): 2 rank(s)" in html
    assert html.count("<title>F") == 2 * 3 and html.count("<title>Bi") == 2 * 3 and html.count("<title>W") == 2 * 3
    assert html.count("pipeline timeline") == 1   # drawn on the pipeline pass's record only
