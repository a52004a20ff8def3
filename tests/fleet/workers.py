"""Worker bodies the multi-process tests run (`python -m fleet.workers NAME ARGS_JSON OUT_DIR`, one per rank)."""
from __future__ import annotations

import os
import time

import torch
from torch import nn
from zoo import MLP, OPTIMIZERS, ZOO

import fleetc
import fleetc.fleet as fleet
from fleet.spawn import run_worker
from fleetc import CollectiveError


def global_batches(zoo_name: str, steps: int) -> list:
    """The same full batches on every rank (and in the single-process reference)."""
    g = torch.Generator().manual_seed(1)
    return [ZOO[zoo_name].make_batch(g)[0] for _ in range(steps)]


def shard(args: tuple, rank: int, world: int) -> tuple:
    return tuple(a.chunk(world)[rank] for a in args)


def make_strategy(settings: dict) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    for key, value in settings.items():
        setattr(strategy, key, value)
    return strategy


def make_model(config: dict) -> nn.Module:
    """The config's zoo model; `dropout_off` sets every dropout probability to 0."""
    model = ZOO[config["zoo"]].make_model()
    for module in model.modules():
        if config.get("dropout_off") and isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def train(rank: int, world: int, config: dict) -> dict:
    """Data-parallel training of a zoo model on this rank's shard of each global batch."""
    return train_with_trainer(rank, world, config)[1]


def train_with_trainer(rank: int, world: int, config: dict) -> tuple:
    """(the trainer, what `train` returns)."""
    entry = ZOO[config["zoo"]]
    torch.manual_seed(rank)  # different on every rank: the broadcast from rank 0 must make them equal
    model = make_model(config)
    opt = fleet.distributed_optimizer(OPTIMIZERS[config["optimizer"]](model.parameters()),
                                      make_strategy(config["strategy"]))
    # Every rank compiles the same model, strategy and shard shapes into the same Program: verifying one is enough
    # (not under sharding, where each rank's Program updates the parameters it owns).
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=entry.loss_fn,
                             verify=rank == 0 or bool(config["strategy"].get("sharding")))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    losses = [trainer.step(*shard(batch, rank, world)) for batch in global_batches(config["zoo"], config["steps"])]
    program = trainer.program
    starts = [block.idx for block, op in program.walk_ops() if op.type == "fleetc.c_allreduce_start"]
    # full_state_dict: whole parameters even where sharding stage 3 left this rank only its own
    return trainer, {"initial": initial, "losses": losses, "state": trainer.full_state_dict(),
                     "collectives": len(starts), "start_blocks": sorted(set(starts)), "report": trainer.report().stats,
                     "execution": trainer.report().execution,
                     "update_block": program.metadata.get("gradient_merge", {}).get("update_block"),
                     "groups": program.metadata["collective_groups"]}


def train_eagerly(rank: int, world: int, steps: int) -> dict:
    """A hand-written loop with fleet's optimizer: `step()` averages the gradients before updating."""
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    model = entry.make_model()
    opt = fleet.distributed_optimizer(OPTIMIZERS["sgd"](model.parameters()))
    for batch in global_batches("mlp", steps):
        x, y = shard(batch, rank, world)
        opt.clear_grad()
        entry.loss_fn(model(x), y).backward()
        opt.step()
    return {"state": model.state_dict()}


def train_configs(rank: int, args: dict, out_dir: str) -> None:
    fleet.init(is_collective=True)
    results = {"endpoints": fleet.worker_endpoints(), "index": fleet.worker_index(), "num": fleet.worker_num()}
    results["runs"] = [train(rank, fleet.worker_num(), config) for config in args["configs"]]
    results["eager"] = train_eagerly(rank, fleet.worker_num(), 2)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


def faults(rank: int, args: dict, out_dir: str) -> None:
    """First a plan mismatch (every rank must refuse to run), then rank 1 dies or hangs in step 2."""
    fleet.init(is_collective=True)
    entry = ZOO["mlp"]
    outcome = {}
    model = entry.make_model()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      make_strategy({"fuse_all_reduce_ops": rank == 0}))
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=entry.loss_fn)
    batch = shard(global_batches("mlp", 1)[0], rank, fleet.worker_num())
    try:
        trainer.step(*batch)
    except CollectiveError as exc:
        outcome["mismatch"] = str(exc)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), make_strategy({}))
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=entry.loss_fn)
    trainer.step(*batch)
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))
    reported = os.path.join(out_dir, "survivor_reported")
    if rank == 1:
        if args["mode"] == "hang":  # silent past the survivor's timeout: until it has reported (hang_s at most)
            give_up = time.monotonic() + args["hang_s"]
            while time.monotonic() < give_up and not os.path.exists(reported):
                time.sleep(0.1)
        os._exit(3)
    start = time.monotonic()
    try:
        trainer.step(*batch)
        outcome["second_step"] = "completed"
    except CollectiveError as exc:
        outcome["error"] = str(exc)
    outcome["seconds"] = time.monotonic() - start
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))
    open(reported, "w").close()
    os._exit(0)  # the process group is broken; skip its teardown


def export_inference(rank: int, args: dict, out_dir: str) -> None:
    """Data-parallel training, then fleet.save_inference_model: rank 0 writes, every rank returns after a barrier."""
    fleet.init(is_collective=True)
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    model = entry.make_model()
    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    trainer = fleet.distributed_model(model, loss_fn=entry.loss_fn)
    x, y = shard(global_batches("mlp", 1)[0], rank, fleet.worker_num())
    trainer.step(x, y)
    result = fleet.save_inference_model(None, args["dirname"], ["x"], ["output"])
    model.eval()
    outcome = {"wrote": result is not None, "files_after_barrier": sorted(os.listdir(args["dirname"])),
               "x": x, "eager": model(x).detach()}
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.stop_worker()


def disagreements(rank: int, args: dict, out_dir: str) -> None:
    """Ranks that built different models or optimizers refuse to start; a data-parallel checkpoint restores every
    rank's own RNG state; a rank dying before its first step fails the other with a CollectiveError."""
    fleet.init(is_collective=True)
    entry = ZOO["mlp"]
    batch = shard(global_batches("mlp", 1)[0], rank, fleet.worker_num())
    outcome = {}
    model = MLP(hidden=64 if rank == 0 else 96)
    try:
        fleetc.compile(model, optimizer=fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
                       loss_fn=entry.loss_fn)
    except CollectiveError as exc:
        outcome["model"] = str(exc)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.0 if rank == 0 else 0.01)
    trainer = fleetc.compile(model, optimizer=fleet.distributed_optimizer(optimizer), loss_fn=entry.loss_fn)
    try:
        trainer.step(*batch)
    except CollectiveError as exc:
        outcome["optimizer"] = str(exc)

    torch.manual_seed(100 + rank)  # each rank its own dropout stream
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 10))
    optimizer = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    trainer = fleet.distributed_model(model, loss_fn=entry.loss_fn)
    trainer.step(*batch)
    fleet.save_persistables(os.path.join(out_dir, "ckpt"))
    first = [trainer.step(*batch) for _ in range(2)]
    fleet.load_persistables(os.path.join(out_dir, "ckpt"))
    again = [trainer.step(*batch) for _ in range(2)]
    outcome["resumed"] = (first, again)
    outcome["versions"] = sorted(os.listdir(os.path.join(out_dir, "ckpt")))

    dying = nn.Linear(32, 10)
    trainer = fleetc.compile(dying, optimizer=fleet.distributed_optimizer(torch.optim.SGD(dying.parameters(), lr=0.1)),
                             loss_fn=entry.loss_fn)
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))
    if rank == 1:
        os._exit(3)  # dies before its first step
    try:
        trainer.step(*batch)
        outcome["after_death"] = "completed"
    except CollectiveError as exc:
        outcome["after_death"] = str(exc)
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # the process group is broken; skip its teardown


if __name__ == "__main__":
    run_worker(globals())
