"""Worker bodies of the per-stage pipeline checkpoint tests (`python -m fleet.pipeline_checkpoint_workers NAME ARGS
OUT_DIR`): the zoo GPT (tied embeddings, Adam) on two stages, one per process, with gradient merge k_steps=2."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from helpers.pipeline import STAGED
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleet.spawn import run_worker
from fleetc import fleet


def _trainer(args: dict, seed: int):
    fleet.init(is_collective=True)
    make, optimizer_name = STAGED[args["model"]]
    torch.manual_seed(seed)
    model = make(args["stages"])
    strategy = fleetc.DistributedStrategy()
    strategy.pipeline = True
    replicas = dist.get_world_size() // args["stages"]
    strategy.pipeline_configs = {"micro_batch_size": args["batch"] // (replicas * args["microbatches"]),
                                 "accumulate_steps": args["microbatches"], "schedule_mode": args["mode"]}
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": args["k_steps"]}
    if args.get("pp_degree"):  # the depth known before the first step's capture
        strategy.hybrid_configs = {"pp_degree": args["pp_degree"]}
    if args.get("amp_configs"):
        strategy.amp = True
        strategy.amp_configs = args["amp_configs"]
    opt = fleet.distributed_optimizer(OPTIMIZERS[optimizer_name](model.parameters()), strategy)
    return model, fleetc.compile(model, optimizer=opt, loss_fn=ZOO[args["model"]].loss_fn)


def _batches(args: dict, rank: int) -> list[tuple]:
    """This rank's replica's share of the same global batches on every run."""
    g = torch.Generator().manual_seed(1)
    replicas = dist.get_world_size() // args["stages"]
    return [tuple(a.chunk(replicas)[rank // args["stages"]] for a in ZOO[args["model"]].make_batch(g)[0])
            for _ in range(args["steps"])]


def _finish(rank: int, model, trainer, losses: list[float], out_dir: str) -> None:
    """Saves the losses, this rank's stage parameters, their Adam `exp_avg` and fleetc's counters (AMP's
    loss-scaling state)."""
    pipe = trainer._last_train.pipeline
    named = dict(model.named_parameters())
    held = pipe.plan.stages[pipe.ranks_here[0]].params
    torch.save({"losses": losses, "params": {n: named[n].detach().clone() for n in held},
                "exp_avg": {n: trainer.optimizer.state[named[n]]["exp_avg"].clone() for n in held},
                "counters": {n: v.clone() for n, v in trainer.counters.items()}},
               os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


def uninterrupted(rank: int, args: dict, out_dir: str) -> None:
    """`steps` steps without a break, saving checkpoints on the way: `saves` maps a step count to a directory."""
    model, trainer = _trainer(args, seed=rank)
    losses = []
    for i, batch in enumerate(_batches(args, rank)):
        losses.append(float(trainer.step(*batch)))
        if str(i + 1) in args["saves"]:
            fleet.save_persistables(args["saves"][str(i + 1)], trainer)
    _finish(rank, model, trainer, losses, out_dir)


def resumed(rank: int, args: dict, out_dir: str) -> None:
    """New processes, other initial weights: load the checkpoint and take the remaining steps."""
    model, trainer = _trainer(args, seed=100 + rank)
    fleet.load_persistables(args["saves"][str(args["resume_after"])], trainer)
    losses = [float(trainer.step(*batch)) for batch in _batches(args, rank)[args["resume_after"]:]]
    _finish(rank, model, trainer, losses, out_dir)


def refused(rank: int, args: dict, out_dir: str) -> None:
    """Load the checkpoint saved after `resume_after` steps and try the next step, once with the depth from the
    device_guard stages alone and once with `hybrid_configs.pp_degree` set: saves the CheckpointError each rank gets
    and where ("load" or "step"; None: it trained), by the pp_degree given (0: none)."""
    found = {}
    for pp_degree in (0, args["stages"]):
        _, trainer = _trainer({**args, "pp_degree": pp_degree}, seed=100 + rank)
        at = "load"
        try:
            fleet.load_persistables(args["saves"][str(args["resume_after"])], trainer)
            at = "step"
            trainer.step(*_batches(args, rank)[args["resume_after"]])
            found[pp_degree] = None
        except fleetc.CheckpointError as exc:
            found[pp_degree] = (at, str(exc))
    torch.save(found, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


if __name__ == "__main__":
    run_worker(globals())
