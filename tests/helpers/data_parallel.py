"""Data-parallel Programs without processes: captured zoo Programs through the passes as one of two ranks, an
identity transport and a trainer compiled as one of two ranks."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.comm import collectives
from fleetc.fleet import trainer as dp_trainer
from fleetc.fleet.trainer import DataParallelTrainer
from fleetc.ir import registry
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Program
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel.allreduce import START
from fleetc.passes.instruments import VerifyInstrument
from fleetc.passes.manager import History, PassManager, PassRecord
from fleetc.passes.order import ordered_passes
from fleetc.strategy import resolve_strategy


def captured_program(zoo_name: str) -> Program:
    """The zoo model's training Program after no-op view removal (where the allreduce passes start)."""
    entry = ZOO[zoo_name]
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, optimizer=OPTIMIZERS["momentum"](model.parameters()), loss_fn=entry.loss_fn)
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(1))
    trainer.step(*args, **kwargs)
    return trainer.history["remove_noop_views"].program


def run_data_parallel_passes(program: Program, world: int = 2, grad_clip=None, **fields) -> tuple[Program, History]:
    """The default pass order (without no-op view removal) on a copy of `program` stamped as `world` ranks (with
    `fleetc.compile`'s `grad_clip`, if given)."""
    program = program.clone()
    program.metadata["data_parallel"] = {"world_size": world}
    strategy = fleetc.DistributedStrategy()
    for key, value in fields.items():
        setattr(strategy, key, value)
    history = History([PassRecord("start", program, PassReport("start"), 0.0, estimate_memory(program))])
    config = resolve_strategy(strategy)
    passes = [p for p in ordered_passes(config, grad_clip=grad_clip) if p.name != "remove_noop_views"]  # the fixture ran it already
    final = PassManager(passes, [VerifyInstrument()]).run(program, config, history)
    return final, history


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
    monkeypatch.setattr(dp_trainer, "check_plans_agree", lambda program, settings=None: None)
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
