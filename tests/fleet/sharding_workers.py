"""Worker bodies of the sharding tests (`python -m fleet.sharding_workers NAME ARGS_JSON OUT_DIR`, one per rank)."""
from __future__ import annotations

import dataclasses
import os
import time

import torch
from zoo import OPTIMIZERS, ZOO

import fleetc
import fleetc.fleet as fleet
from fleet.spawn import run_worker
from fleet.workers import (
    global_batches,
    make_model,
    make_strategy,
    shard,
    train_with_trainer,
)
from fleetc import CollectiveError
from fleetc.ir import registry
from fleetc.passes.sharding.optimizer_sharding import RS_START
from fleetc.runtime import checkpoint_commit


def optimizer_state_elements(trainer) -> int:
    """Elements of optimizer state this rank holds."""
    return sum(t.numel() for slot in trainer.optimizer.state.values() for t in slot.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def train_sharded(rank: int, args: dict, out_dir: str) -> None:
    """Each config trained as in data parallel, plus what the rank keeps of the optimizer state and the plan."""
    fleet.init(is_collective=True)
    runs = [sharded_run(rank, config) for config in args["configs"]]
    torch.save({"runs": runs}, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


def sharded_run(rank: int, config: dict) -> dict:
    """One config of `train_sharded` (`save`: a checkpoint directory written after the steps)."""
    trainer, run = train_with_trainer(rank, fleet.worker_num(), config)
    program = trainer.program
    run["state_elements"] = optimizer_state_elements(trainer)
    run["params"] = len(list(trainer.model.parameters()))
    run["full_state"] = trainer.full_state_dict()
    run["held_param_elements"] = sum(p.numel() for p in trainer.model.parameters())
    run["memory"] = trainer.memory_stats().get("sharding")
    inputs = shard(global_batches(config["zoo"], 1)[0], rank, fleet.worker_num())[:-1]
    run["eval"] = trainer(*inputs)  # forward only under sharding, beside eager eval on the same parameters
    eager = make_model(config)  # the trained parameters, whole (under stage 3 this rank holds only its own)
    eager.load_state_dict(run["full_state"])
    eager.eval()
    with torch.no_grad():
        run["eager_eval"] = eager(*inputs)
    # What the guards see when their cheap identity check misses (stage 3: the released parameters) must still
    # match what they recorded, or every such step would recompile.
    run["guard_failures"] = [step.guards.failure() for step in (trainer._last_train, trainer._last_eval)]
    run["op_types"] = sorted({op.type for _, op in program.walk_ops()})
    run["applied"], run["skipped"] = trainer.report().applied, trainer.report().skipped
    run["model_keys"] = list(eager.state_dict())
    if config.get("save"):
        trainer.save_checkpoint(config["save"])
    return run


def checkpoint_round_trip(rank: int, args: dict, out_dir: str) -> None:
    """`save`: train 2 steps, checkpoint, train a third; `load`: a fresh model and optimizer resume from the
    checkpoint and train the third step (`step_before_load`: after a first step that compiles, so the rank knows
    what it owns when it loads). mlp with Adam, sharded by `args["strategy"]`. Records the optimizer shard files
    each load read."""
    fleet.init(is_collective=True)
    world = fleet.worker_num()
    batches = global_batches("mlp", 3)

    def build(seed: int):
        torch.manual_seed(seed)
        model = ZOO["mlp"].make_model()
        opt = fleet.distributed_optimizer(OPTIMIZERS["adam"](model.parameters()), make_strategy(args["strategy"]))
        return model, fleetc.compile(model, optimizer=opt, loss_fn=ZOO["mlp"].loss_fn, verify=True)

    out = {}
    if args.get("save"):
        model, trainer = build(0)
        for batch in batches[:2]:
            trainer.step(*shard(batch, rank, world))
        trainer.save_checkpoint(args["save"])
        out["saved"] = trainer.full_state_dict()
        # what this rank held of the optimizer state when it saved (stage 3 flat: pieces, at `saved_pieces`)
        out["saved_state"] = {name: {key: value.clone() for key, value in trainer.optimizer.state[p].items()}
                              for name, p in model.named_parameters() if p in trainer.optimizer.state}
        out["saved_pieces"] = trainer.program.metadata.get("sharding", {}).get("param_pieces")
        trainer.step(*shard(batches[2], rank, world))
        out["continued"] = trainer.full_state_dict()
    if args.get("load"):
        model, trainer = build(rank + 1)
        if args.get("step_before_load"):
            trainer.step(*shard(batches[0], rank, world))
        read = checkpoint_commit.CheckpointVersion.read
        out["shards_read"] = []

        def recording(version, name):
            out["shards_read"] += [name] if name.startswith("optimizer.shard") else []
            return read(version, name)
        checkpoint_commit.CheckpointVersion.read = recording
        trainer.load_checkpoint(args["load"])
        checkpoint_commit.CheckpointVersion.read = read
        trainer.step(*shard(batches[2], rank, world))
        out["resumed"] = trainer.full_state_dict()
        out["state_elements"] = optimizer_state_elements(trainer)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


def owns_nothing(rank: int, args: dict, out_dir: str) -> None:
    """Stages 1, 2 and 3 on a model of one 1-element parameter: rank 0 owns it (stage 1: whole; stages 2 and 3: the
    bucket's first segment), every other rank owns nothing (its segment is all padding). Beside eager Adam on the
    full batch from rank 0's initial value (which the trainer broadcasts)."""
    fleet.init(is_collective=True)
    world = fleet.worker_num()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 1, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]
    runs = []
    for stage in (1, 2, 3):
        models = []
        for seed in (rank, 0):  # this rank's model, and the eager reference from rank 0's initial value
            torch.manual_seed(seed)
            models.append(torch.nn.Linear(1, 1, bias=False))
        model, eager = models
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                          make_strategy({"sharding": True, "sharding_configs": {"stage": stage}}))
        trainer = fleetc.compile(model, optimizer=opt, loss_fn=torch.nn.functional.mse_loss, verify=True)
        eager_opt = torch.optim.Adam(eager.parameters(), lr=0.1)
        run = {"losses": [], "eager_losses": []}
        for x, y in batches:
            run["losses"].append(trainer.step(*shard((x, y), rank, world)))
            eager_opt.zero_grad()
            loss = torch.nn.functional.mse_loss(eager(x), y)
            loss.backward()
            eager_opt.step()
            run["eager_losses"].append(loss.detach())
        run["owned"] = trainer.report().stats["sharding"]["owned_params"]
        run["state_elements"] = optimizer_state_elements(trainer)
        run["state"] = trainer.full_state_dict()
        run["eager_state"] = eager.state_dict()
        run["eval"] = trainer(batches[0][0])
        with torch.no_grad():
            run["eager_eval"] = eager(batches[0][0])
        runs.append(run)
    torch.save({"runs": runs}, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


def failed_shard_write(rank: int, args: dict, out_dir: str) -> None:
    """Stage 2 on the mlp (Adam): one step, a checkpoint, a second step, then a checkpoint whose optimizer shard
    rank 1 fails to write (OSError). Every rank must get a CheckpointError, the first version must stay the current
    one, and a fresh trainer that loads the checkpoint must hold the state of the first save."""
    fleet.init(is_collective=True)
    world = fleet.worker_num()
    torch.manual_seed(rank)
    model = ZOO["mlp"].make_model()
    opt = fleet.distributed_optimizer(OPTIMIZERS["adam"](model.parameters()), make_strategy(args["strategy"]))
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=ZOO["mlp"].loss_fn)
    batches = global_batches("mlp", 2)
    trainer.step(*shard(batches[0], rank, world))
    out = {"first": os.path.basename(trainer.save_checkpoint(args["save"])), "saved": trainer.full_state_dict()}
    trainer.step(*shard(batches[1], rank, world))
    write = checkpoint_commit.StagedVersion.write

    def failing(version, name, value):
        if rank == 1 and name.startswith("optimizer.shard"):
            raise OSError(28, "No space left on device")
        return write(version, name, value)
    checkpoint_commit.StagedVersion.write = failing
    try:
        trainer.save_checkpoint(args["save"])
        out["error"] = None
    except fleetc.CheckpointError as exc:
        out["error"] = str(exc)
    checkpoint_commit.StagedVersion.write = write
    fleet.barrier_worker()
    out["entries"] = sorted(os.listdir(args["save"]))
    torch.manual_seed(rank + 7)
    fresh = ZOO["mlp"].make_model()
    opt = fleet.distributed_optimizer(OPTIMIZERS["adam"](fresh.parameters()), make_strategy(args["strategy"]))
    out["loaded_version"] = os.path.basename(fleetc.compile(fresh, optimizer=opt, loss_fn=ZOO["mlp"].loss_fn)
                                             .load_checkpoint(args["save"]))
    out["loaded"] = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


def plan_mismatch(rank: int, args: dict, out_dir: str) -> None:
    """The ranks shard with different settings (`args["configs"][rank]`): each must refuse before the first
    collective of the step (the cross-rank plan check), and its parameters must be as they were."""
    fleet.init(is_collective=True)
    model = ZOO["mlp"].make_model()
    opt = fleet.distributed_optimizer(OPTIMIZERS["adam"](model.parameters()),
                                      make_strategy(args["configs"][rank]))
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=ZOO["mlp"].loss_fn)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        trainer.step(*shard(global_batches("mlp", 1)[0], rank, fleet.worker_num()))
        outcome = {"error": None}
    except CollectiveError as exc:
        outcome = {"error": str(exc)}
    outcome["unchanged"] = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # the ranks disagree; skip the group's teardown


def dead_rank_in_reduce_scatter(rank: int, args: dict, out_dir: str) -> None:
    """Stage 2 on mlp; rank 1 dies where it would issue its first gradient reduce-scatter."""
    fleet.init(is_collective=True)
    if rank == 1:
        dies = dataclasses.replace(registry.op_def(RS_START), reference=lambda *a, **k: os._exit(3))
        registry._REGISTRY[RS_START] = dies
    model = ZOO["mlp"].make_model()
    opt = fleet.distributed_optimizer(OPTIMIZERS["adam"](model.parameters()), make_strategy(args["strategy"]))
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=ZOO["mlp"].loss_fn)
    started = time.monotonic()
    try:
        trainer.step(*shard(global_batches("mlp", 1)[0], rank, fleet.worker_num()))
        outcome = {"error": None}
    except CollectiveError as exc:
        outcome = {"error": str(exc)}
    outcome["seconds"] = time.monotonic() - started
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # the process group is broken; skip its teardown


if __name__ == "__main__":
    run_worker(globals())
