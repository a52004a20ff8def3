"""Data-parallel Programs run as one of two ranks inside the test process: an identity transport and a trainer."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from fleetc.distributed import collectives, trainer as dp_trainer
from fleetc.distributed.trainer import DataParallelTrainer
from fleetc.ops import registry
from fleetc.passes.allreduce import START
from zoo import OPTIMIZERS, ZOO


class _Done:
    """A finished collective in a world of one rank (averaging over one rank changes nothing)."""

    def wait(self, timeout):
        return True


@pytest.fixture
def one_rank_transport(monkeypatch):
    """Data-parallel Programs (world size 2 as compiled) run in this process with an identity allreduce.

    The start op's real packing code runs (copies and in-place checks); each start's buffer and gradients are
    recorded; the real wait op returns the views of the buffer.
    """
    issued = []

    def start(flat, grads, in_place, group, algorithm, label):
        collectives.fill_bucket(flat, grads, in_place, label)
        issued.append((flat, list(grads), list(in_place)))
        return collectives.PendingAllreduce(_Done(), label, collectives.FLAT, group)

    monkeypatch.setitem(registry._REGISTRY, START, dataclasses.replace(registry.op_def(START), reference=start))
    monkeypatch.setattr(dp_trainer.groups, "ensure_groups", lambda partitions: None)
    monkeypatch.setattr(dp_trainer, "check_plans_agree", lambda program: None)
    return issued


def simulated_rank(zoo_name: str, optimizer_name: str, strategy) -> tuple:
    """(eager model, its optimizer, trainer compiled as one of two ranks) from copies of one zoo model."""
    entry = ZOO[zoo_name]
    torch.manual_seed(0)
    model = entry.make_model()
    eager = copy.deepcopy(model)
    eager_opt = OPTIMIZERS[optimizer_name](eager.parameters())
    trainer = DataParallelTrainer(model, strategy, optimizer=OPTIMIZERS[optimizer_name](model.parameters()),
                                  loss_fn=entry.loss_fn, verify=True)
    trainer.world_size = 2  # the identity transport stands in for the other rank
    return eager, eager_opt, trainer
