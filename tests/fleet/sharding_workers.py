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
