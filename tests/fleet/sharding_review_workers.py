"""Worker bodies of the sharding review tests (`python -m fleet.sharding_review_workers NAME ARGS_JSON OUT_DIR`).

Each config trains the way a user would (fleet.init, fleet.distributed_optimizer, fleetc.compile), possibly with
two parameter groups, gradient clipping or the newer `fleetc.Strategy`, then evaluates and gathers the whole
state; an eager reference accumulating over the same shards of the batch runs beside it in the same process.
"""
from __future__ import annotations

import os

import torch
from zoo import ZOO

import fleetc
import fleetc.fleet as fleet
from fleet.optimizer_workers import CLIPS
from fleet.spawn import run_worker
from fleet.workers import global_batches, make_model, make_strategy, shard

# The optimizers of the review, each with weight decay. `groups`: the matrices in one group at the base lr, the
# rest (biases, norms, embeddings' 1-D parts) in a second group at 0.3x the lr and without weight decay.
OPTIMIZERS = {
    "momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-3}),
    "nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    "amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 1e-3}),
}


def make_optimizer(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    """`freeze`: parameter names left out of training (requires_grad off, not given to the optimizer)."""
    kind, options = OPTIMIZERS[config["optimizer"]]
    for name, param in model.named_parameters():
        param.requires_grad_(name not in config.get("freeze", ()))
    params = [p for p in model.parameters() if p.requires_grad]
    if not config.get("groups"):
        return kind(params, **options)
    return kind([{"params": [p for p in params if p.dim() >= 2]},
                 {"params": [p for p in params if p.dim() < 2], "lr": options["lr"] * 0.3, "weight_decay": 0.0}],
                **options)


def strategy_of(config: dict):
    """`new_style`: the same sharding as `fleetc.Strategy({"sharding": {...}})` instead of a DistributedStrategy."""
    if config.get("new_style"):
        return fleetc.Strategy({"sharding": config["new_style"]})
    return make_strategy(config["strategy"])


def user_batches(config: dict) -> list:
    """The global batches; `ragged`: the last one smaller (a loader without drop_last), so the step is captured
    again."""
    batches = global_batches(config["zoo"], config["steps"])
    if config.get("ragged"):
        batches[-1] = tuple(t[: t.shape[0] * 3 // 4] for t in batches[-1])
    return batches


def eager_reference(config: dict, initial: dict, world: int) -> dict:
    """Eager PyTorch: each step sums every shard's own forward and backward (divided by the world, as the
    average), clips the summed gradient as configured and steps the same optimizer (and LR scheduler)."""
    entry = ZOO[config["zoo"]]
    model = make_model(config)
    model.load_state_dict(initial)
    opt = make_optimizer(model, config)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if config.get("scheduler") else None
    clip = config.get("grad_clip")
    merge = config["strategy"].get("gradient_merge_configs", {}).get("k_steps", 1)
    losses = []
    for i, batch in enumerate(user_batches(config)):
        step_loss = 0.0
        for r in range(world):
            *inputs, target = shard(batch, r, world)
            loss = entry.loss_fn(model(*inputs), target)
            (loss / (world * merge)).backward()
            step_loss += loss.detach() / world
        losses.append(step_loss)
        if (i + 1) % merge == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip[1])
            opt.step()
            opt.zero_grad()
        if schedule is not None:
            schedule.step()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def run(rank: int, world: int, config: dict) -> dict:
    entry = ZOO[config["zoo"]]
    torch.manual_seed(rank)  # different on every rank: the broadcast from rank 0 must make them equal
    model = make_model(config)
    opt = fleet.distributed_optimizer(make_optimizer(model, config), strategy_of(config))
    clip = config.get("grad_clip")
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=entry.loss_fn, verify=True,
                             grad_clip=CLIPS[clip[0]](clip[1]) if clip else None)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    batches = user_batches(config)
    schedule = torch.optim.lr_scheduler.StepLR(opt.inner, 1, gamma=0.5) if config.get("scheduler") else None
    losses, evals = [], []
    for batch in batches:
        losses.append(trainer.step(*shard(batch, rank, world)))
        if schedule is not None:
            schedule.step()
        if config.get("eval_between"):  # an evaluation call between training steps
            evals.append(trainer(*shard(batch, rank, world)[:-1]))
    full = trainer.full_state_dict()
    module = {k: v.detach().clone() for k, v in model.state_dict().items()}  # what the user's module holds
    *inputs, _ = shard(batches[0], rank, world)
    out = trainer(*inputs)  # evaluation after training, on this rank's shard
    eager = make_model(config)
    eager.load_state_dict(full)
    eager.eval()
    with torch.no_grad():
        eager_out = eager(*inputs)
    report = trainer.report()
    result = {"initial": initial, "losses": losses, "state": full, "evals": evals, "module_state": module, "eval": out, "eager_eval": eager_out,
              "stats": report.stats, "decisions": [str(d) for d in report.decisions],
              "skipped": [str(s) for s in report.skipped], "notes": [str(n) for n in report.notes],
              "memory": trainer.memory_stats().get("sharding"), "op_types": sorted({op.type for _, op in trainer.program.walk_ops()}),
              "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]}
    if config.get("eager"):
        result["eager"] = eager_reference(config, initial, world)
    return result


def refused(rank: int, world: int, config: dict) -> str | None:
    """The StrategyError a config's first step raises (a sharding degree that does not divide the world size)."""
    model = make_model({"zoo": "mlp"})
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy_of(config))
    try:
        trainer = fleetc.compile(model, optimizer=opt, loss_fn=ZOO["mlp"].loss_fn)
        trainer.step(*shard(global_batches("mlp", 1)[0], rank, world))
    except fleetc.StrategyError as exc:
        return str(exc)
    return None


def train_configs(rank: int, args: dict, out_dir: str) -> None:
    """`configs`: trained (`run`); `refused`: configs whose first step should raise a StrategyError."""
    fleet.init(is_collective=True)
    runs = [run(rank, fleet.worker_num(), config) for config in args["configs"]]
    errors = [refused(rank, fleet.worker_num(), config) for config in args.get("refused", [])]
    torch.save({"runs": runs, "refused": errors}, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


def resume_mid_period(rank: int, args: dict, out_dir: str) -> None:
    """Each config: train `save_after` steps, checkpoint and take `trainer.state_dict()` (fleetc's own state, on
    every rank), train the rest; then a fresh model and trainer load the checkpoint and train the rest. Without
    sharding a third one loads the first rank's model, optimizer and fleetc state_dicts (a user's own checkpoint)
    and trains the rest too. The end states, whole, and each rank's fleetc state_dict."""
    fleet.init(is_collective=True)
    world = fleet.worker_num()
    out = []
    for config in args["configs"]:
        batches = user_batches(config)
        path = os.path.join(args["dir"], f"ckpt{len(out)}")
        own = os.path.join(args["dir"], f"state_dicts{len(out)}.pt")

        def build(seed: int, config=config):
            torch.manual_seed(seed)
            model = make_model(config)
            opt = fleet.distributed_optimizer(make_optimizer(model, config), strategy_of(config))
            return fleetc.compile(model, optimizer=opt, loss_fn=ZOO[config["zoo"]].loss_fn, verify=True), opt

        def rest(trainer) -> list:
            return [trainer.step(*shard(batch, rank, world)) for batch in batches[config["save_after"]:]]

        trainer, opt = build(0)
        for batch in batches[: config["save_after"]]:
            trainer.step(*shard(batch, rank, world))
        trainer.save_checkpoint(path)
        fleetc_state = trainer.state_dict()
        unsharded = not config["strategy"].get("sharding")
        if unsharded and rank == 0:
            torch.save({"model": trainer.model.state_dict(), "opt": opt.state_dict(), "fleetc": fleetc_state}, own)
        continued = rest(trainer)
        result = {"continued": continued, "continued_state": trainer.full_state_dict(), "fleetc_state": fleetc_state}
        trainer, _ = build(rank + 7)
        trainer.load_checkpoint(path)
        result.update(resumed=rest(trainer), resumed_state=trainer.full_state_dict())
        if unsharded:
            fleet.barrier_worker()  # the first rank's state_dicts are written
            saved = torch.load(own, weights_only=True)
            trainer, opt = build(rank + 11)
            trainer.model.load_state_dict(saved["model"])
            opt.set_state_dict(saved["opt"])
            trainer.load_state_dict(saved["fleetc"])
            result.update(from_state_dicts=rest(trainer), from_state_dicts_state=trainer.full_state_dict())
        out.append(result)
    if args.get("eager"):
        out.append(eager_resume_mid_period(rank, world, args["eager"], os.path.join(args["dir"], "eager.pt")))
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


def eager_resume_mid_period(rank: int, world: int, config: dict, path: str) -> dict:
    """A hand-written loop over `fleet.distributed_optimizer` (eager gradient merge): after `save_after` micro-steps,
    mid period, every rank takes `opt.state_dict()` and the first rank saves it with the model's; the run goes on,
    and a fresh model and optimizer on every rank load the first rank's file and train the same rest."""
    batches = user_batches(config)

    def build(seed: int):
        torch.manual_seed(seed)
        model = make_model(config)
        return model, fleet.distributed_optimizer(make_optimizer(model, config), strategy_of(config))

    def train(model, opt, part) -> None:
        for batch in part:
            x, y = shard(batch, rank, world)
            ZOO[config["zoo"]].loss_fn(model(x), y).backward()
            opt.step()
            opt.clear_grad()

    model, opt = build(0)
    train(model, opt, batches[: config["save_after"]])
    state = {"model": model.state_dict(), "opt": opt.state_dict()}  # a collective mid period: every rank
    if rank == 0:
        torch.save(state, path)
    train(model, opt, batches[config["save_after"]:])
    fleet.barrier_worker()
    saved = torch.load(path, weights_only=True)
    resumed, resumed_opt = build(rank + 7)
    resumed.load_state_dict(saved["model"])
    resumed_opt.set_state_dict(saved["opt"])
    train(resumed, resumed_opt, batches[config["save_after"]:])
    return {"continued_state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "resumed_state": {k: v.detach().clone() for k, v in resumed.state_dict().items()},
            "merge_state": state["opt"]["fleetc_gradient_merge"]}


if __name__ == "__main__":
    run_worker(globals())
