"""Worker bodies for data parallel on Hugging Face architectures (`python -m fleet.hf_workers NAME ARGS OUT_DIR`)."""
from __future__ import annotations

import os

import torch
from models.factories import ARCHITECTURES

import fleetc
import fleetc.fleet as fleet
from fleet.spawn import run_worker

STEPS = 2


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def build(name: str):
    """The architecture's model with dropout off (eval mode: these models have no batch norm, so eval changes
    nothing else) and its global batches, seeded alike in every process."""
    case = ARCHITECTURES[name]()
    model, batches = case.build(STEPS)
    return case, model.eval(), batches


def shard(args: tuple, rank: int, world: int) -> tuple:
    return tuple(a.chunk(world)[rank] for a in args)


def train_hf(rank: int, args: dict, out_dir: str) -> None:
    """Data-parallel training of each named architecture on this rank's half of every global batch."""
    fleet.init(is_collective=True)
    results = {}
    for name in args["names"]:
        case, model, batches = build(name)
        trainer = fleetc.compile(model, optimizer=fleet.distributed_optimizer(sgd(model.parameters())),
                                 loss_fn=case.loss_fn)
        losses = [trainer.step(*shard(batch_args, rank, fleet.worker_num()), **kwargs)
                  for batch_args, kwargs in batches]
        program = trainer.program
        results[name] = {"losses": losses, "state": trainer.full_state_dict(),
                         "collectives": sum(op.type == "fleetc.c_allreduce_start" for _, op in program.walk_ops())}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


if __name__ == "__main__":
    run_worker(globals())
