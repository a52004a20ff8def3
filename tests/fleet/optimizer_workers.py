"""Worker bodies for the optimizer tests on several ranks (`python -m fleet.optimizer_workers NAME ARGS OUT_DIR`)."""
from __future__ import annotations

import os

import torch
from helpers.optimizers import TRACED
from zoo import OPTIMIZERS, ZOO

import fleetc
import fleetc.fleet as fleet
from fleet.spawn import run_worker
from fleet.workers import global_batches, make_strategy, shard

CLIPS = {"global_norm": fleetc.ClipGradByGlobalNorm, "norm": fleetc.ClipGradByNorm, "value": fleetc.ClipGradByValue}


def optimizer_factory(name: str):
    return OPTIMIZERS.get(name) or TRACED[name]


def grad_clip(config: dict):
    clip = config.get("grad_clip")
    return CLIPS[clip[0]](clip[1]) if clip else None


def train(rank: int, world: int, config: dict) -> dict:
    """The zoo MLP, data parallel under the config's strategy and grad_clip, on this rank's shards."""
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    model = entry.make_model()
    opt = fleet.distributed_optimizer(optimizer_factory(config["optimizer"])(model.parameters()),
                                      make_strategy(config["strategy"]))
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=entry.loss_fn, verify=rank == 0,
                             grad_clip=grad_clip(config))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    losses = [trainer.step(*shard(batch, rank, world)) for batch in global_batches("mlp", config["steps"])]
    program = trainer.program
    report = trainer.report()
    return {"initial": initial, "losses": losses, "state": trainer.full_state_dict(),
            "counters": {k: v.clone() for k, v in trainer.counters.items()}, "stats": report.stats,
            "notes": report.notes, "skipped": report.skipped,
            "collectives": sum(op.type == "fleetc.c_allreduce_start" for _, op in program.walk_ops())}


def train_configs(rank: int, args: dict, out_dir: str) -> None:
    fleet.init(is_collective=True)
    results = [train(rank, fleet.worker_num(), config) for config in args["configs"]]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


if __name__ == "__main__":
    run_worker(globals())
