"""Worker bodies of the multi-process pipeline tests (`python -m fleet.pipeline_workers NAME ARGS OUT_DIR`)."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.pipeline import SCALING_STATE, STAGED, TwoStageMLP, amp_pipeline_strategy
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleet.spawn import run_worker
from fleetc import CollectiveError, fleet
from fleetc.capture import capture_train_program
from fleetc.comm.mesh import ProcessMesh
from fleetc.passes.pipeline_parallel.partition import partition
from fleetc.passes.pipeline_parallel.schedule import build_schedule
from fleetc.runtime.pipeline_local import DistributedPipeline


def _pipeline(rank: int, args: dict) -> tuple:
    make, optimizer_name = STAGED[args["model"]]
    torch.manual_seed(0)
    model = make(dist.get_world_size())
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    batch, _ = ZOO[args["model"]].make_batch(torch.Generator().manual_seed(0))
    micro = tuple(a.chunk(args["microbatches"])[0] for a in batch)
    program = capture_train_program(model, ZOO[args["model"]].loss_fn, optimizer, micro, {})
    plan = partition(program, args["microbatches"])
    schedule = build_schedule(args["mode"], dist.get_world_size(), args["microbatches"])
    pipe = DistributedPipeline(program, plan, schedule, model, optimizer, timeout_s=args.get("timeout_s", 30.0))
    return model, plan, pipe


def train(rank: int, args: dict, out_dir: str) -> None:
    """Steps on the same batches on every rank; saves the losses and this rank's stage parameters."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    model, plan, pipe = _pipeline(rank, args)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(args["steps"]):
        batch, _ = ZOO[args["model"]].make_batch(g)
        losses.append(float(pipe.step(*batch)))
    named = dict(model.named_parameters())
    torch.save({"losses": losses, "params": {n: named[n].detach() for n in plan.stages[rank].params}},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def fleet_train(rank: int, args: dict, out_dir: str) -> None:
    """The user's path: fleet.init, distributed_optimizer and fleetc.compile with strategy.pipeline on, each pipeline
    replica (mesh order: dp outermost) fed its shard of the same global batches. Saves the losses, the mesh and this
    rank's stage parameters."""
    fleet.init(is_collective=True)
    world, stages = dist.get_world_size(), args["stages"]
    replicas = world // stages
    make, optimizer_name = STAGED[args["model"]]
    torch.manual_seed(rank)  # different on every rank: the trainer broadcasts rank 0's parameters
    vpp = args.get("vpp", 1)  # VPP: each process holds vpp of the model's device_guard stages
    model = make(stages * vpp)
    strategy, replica = _strategy(rank, args, stages, replicas)
    if args.get("k_steps", 1) > 1:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": args["k_steps"]}
    if args.get("amp") is not None:  # bf16 AMP (O1) with these amp_configs
        strategy.amp = True
        strategy.amp_configs = {"dtype": "bfloat16", **args["amp"]}
    opt = fleet.distributed_optimizer(OPTIMIZERS[optimizer_name](model.parameters()), strategy)
    clip = fleetc.ClipGradByGlobalNorm(args["clip_norm"]) if args.get("clip_norm") else None
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=ZOO[args["model"]].loss_fn, grad_clip=clip)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(args["steps"]):
        batch, _ = ZOO[args["model"]].make_batch(g)
        losses.append(float(trainer.step(*(a.chunk(replicas)[replica] for a in batch))))
    pipe = trainer._last_train.pipeline
    phases = pipe.plan.stages[pipe.ranks_here[0]].phases
    optimizer_program = phases["optimizer"]
    sharding = {"owned": sorted(trainer._owned or ()),
                "optimizer_ops": [op.type for op in optimizer_program.global_block.ops],
                "gather_ops": [op.type for op in phases["gather"].global_block.ops] if "gather" in phases else [],
                "state": sorted(n for n, p in model.named_parameters() if trainer.optimizer.state.get(p)),
                "state_pieces": len(optimizer_program.metadata.get("state_pieces", {})),
                "state_elements": sum(t.numel() for slot in trainer.optimizer.state.values() for t in slot.values()
                                      if isinstance(t, torch.Tensor) and t.dim() > 0)}
    stage_params = {n for s in pipe.chunks for n in pipe.plan.stages[s].params}
    # AMP: this rank's loss-scaling state after the last step
    scaling = [float(pipe.held_values(n)[pipe.chunks[0]]) for n in SCALING_STATE] if args.get("amp") else None
    # stage 3: the elements of its stage's parameters this rank holds between steps
    held = {n: p.numel() for n, p in model.named_parameters() if n in stage_params}
    memory = trainer.memory_stats().get("sharding")  # this rank's stage: Ψ its parameters
    named = _current(trainer, model)  # before a checkpoint gathers the rest
    full = trainer.full_state_dict() if args.get("sharding_stage") == 3 else None  # every stage's, on every rank
    evaluated = trainer(batch[0]) if args.get("evaluate") else None   # every rank calls it
    eval_executor = type(trainer._last_eval.pipeline).__name__ if args.get("evaluate") else None
    resumed = {}
    if args.get("checkpoint"):
        fleet.save_persistables(os.path.join(out_dir, "checkpoint"))
        resumed = _resume(rank, args, strategy, os.path.join(out_dir, "checkpoint"), g, replica)
    torch.save({"losses": losses, "mesh": str(trainer.mesh), "executor": type(pipe).__name__, "evaluated": evaluated, "resumed": resumed,
                "eval_executor": eval_executor,
                "skipped": trainer.report().skipped, "sharding": sharding, "held": held, "full": full,
                "memory": memory, "scaling": scaling,
                "params": {n: named[n] for n in stage_params}},
               os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


def _strategy(rank: int, args: dict, stages: int, replicas: int) -> tuple[fleetc.DistributedStrategy, int]:
    """The strategy of `stages` pipeline stages (1: no pipeline) whose replicas form the sharding group (stage
    `args["sharding_stage"]`, when given; else they are data-parallel replicas), each pipeline taking the global
    batch in `args["microbatches"]` micro-batches per replica; and this rank's replica index (mesh order: dp, then
    pp, then sharding)."""
    strategy = fleetc.DistributedStrategy()
    if stages > 1:
        strategy.pipeline = True
        strategy.pipeline_configs = {"micro_batch_size": args["batch"] // (replicas * args["microbatches"]),
                                     "accumulate_steps": args["microbatches"], "schedule_mode": args["mode"],
                                     "vpp_degree": args.get("vpp", 1)}
    if not args.get("sharding_stage"):
        return strategy, rank // stages
    strategy.sharding = True  # every replica of a stage is in its sharding group
    strategy.sharding_configs = {"stage": args["sharding_stage"], "sharding_degree": replicas}
    return strategy, ProcessMesh(pp=stages, sharding=replicas).coordinates(rank)["sharding"]


def fleet_resume(rank: int, args: dict, out_dir: str) -> None:
    """Resharding: a mesh of `stages` pipeline stages (1: none) × sharding (or replicas) loads the checkpoint `load`,
    which another mesh wrote, and continues: `steps` more steps on the global batches after the first `skip`, each
    replica fed its share; then saves its own checkpoint into `save`. Saves the losses, the mesh and the parameters
    this rank's stages hold (every one without a pipeline)."""
    fleet.init(is_collective=True)
    stages = args["stages"]
    replicas = dist.get_world_size() // stages
    make, optimizer_name = STAGED[args["model"]]
    torch.manual_seed(100 + rank)  # not the checkpoint's weights: the load must bring them
    model = make(stages * args.get("vpp", 1))
    strategy, replica = _strategy(rank, args, stages, replicas)
    opt = fleet.distributed_optimizer(OPTIMIZERS[optimizer_name](model.parameters()), strategy)
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=ZOO[args["model"]].loss_fn)
    fleet.load_persistables(args["load"], trainer)
    g = torch.Generator().manual_seed(1)
    batches = [ZOO[args["model"]].make_batch(g)[0] for _ in range(args["skip"] + args["steps"])][args["skip"]:]
    losses = [float(trainer.step(*(a.chunk(replicas)[replica] for a in batch))) for batch in batches]
    pipe = trainer._last_train.pipeline
    held = {n for s in pipe.chunks for n in pipe.plan.stages[s].params} if pipe is not None else None
    params = {n: p for n, p in _current(trainer, model).items() if held is None or n in held}
    fleet.save_persistables(args["save"], trainer)
    torch.save({"losses": losses, "mesh": str(trainer.mesh), "params": params},
               os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


def amp_train(rank: int, args: dict, out_dir: str) -> None:
    """Pipeline × AMP through fleet.init: TwoStageMLP, one stage per process, bf16 with dynamic loss scaling; from
    step `overflow_step` on, stage 1's weight is made huge so that only stage 0's gradients overflow. On 4
    processes, two replicas (mesh order: dp outermost), each fed its half of the global batch. Saves per step the
    loss, this rank's loss-scaling state and its stage's parameters."""
    fleet.init(is_collective=True)
    replicas = dist.get_world_size() // 2
    torch.manual_seed(0)
    model = TwoStageMLP()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      amp_pipeline_strategy(args))
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    steps = []
    for step in range(args["steps"]):
        if step == args["overflow_step"]:
            model.make_overflow()
        size = args["batch"] * replicas
        x, y = torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g)
        loss = float(trainer.step(x.chunk(replicas)[rank // 2], y.chunk(replicas)[rank // 2]))
        pipe = trainer._last_train.pipeline
        stage = pipe.plan.stages[pipe.ranks_here[0]]
        steps.append({"loss": loss, "scaling": [float(pipe.held_values(n)[stage.stage]) for n in SCALING_STATE],
                      "params": {n: p.detach().clone() for n, p in model.named_parameters() if n in stage.params}})
    torch.save({"steps": steps, "executor": type(pipe).__name__}, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


def _resume(rank: int, args: dict, strategy, dirname: str, g: torch.Generator, replica: int) -> dict:
    """A fresh model and trainer on the same pipeline load the checkpoint and take the next step on this rank's
    replica's share of the batch: this rank's stage parameters after it."""
    make, optimizer_name = STAGED[args["model"]]
    torch.manual_seed(100 + rank)
    model = make(args["stages"] * args.get("vpp", 1))
    opt = fleet.distributed_optimizer(OPTIMIZERS[optimizer_name](model.parameters()), strategy)
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=ZOO[args["model"]].loss_fn)
    fleet.load_persistables(dirname, trainer)
    batch, _ = ZOO[args["model"]].make_batch(g)
    replicas = dist.get_world_size() // args["stages"]
    trainer.step(*(a.chunk(replicas)[replica] for a in batch))
    pipe = trainer._last_train.pipeline
    named = _current(trainer, model)
    return {n: named[n] for s in pipe.chunks for n in pipe.plan.stages[s].params}


def _current(trainer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the model's parameters as this rank's stages left them (sharding stage 3: whole, gathered from the
    pieces over the stage's sharding group, a collective)."""
    with trainer.whole_parameters():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def faults(rank: int, args: dict, out_dir: str) -> None:
    """First rank 1 builds another schedule: both ranks must refuse before the first message. Then both build the
    same one and take a good step, after which rank 1 dies (or hangs): rank 0's next step must fail with a
    CollectiveError, not hang."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    _, _, pipe = _pipeline(rank, {**args, "mode": args["mode"] if rank == 0 else "FThenB"})
    batch, _ = ZOO[args["model"]].make_batch(torch.Generator().manual_seed(1))
    outcome = {"plans": _outcome(pipe, batch)}
    _, _, pipe = _pipeline(rank, {**args, "timeout_s": 5.0})
    pipe.step(*batch)   # one good step: the plan check and the first messages pass
    if rank == 1:
        torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))
        if args["fault"] == "kill":
            os._exit(3)
        import time
        time.sleep(10)
        os._exit(0)
    outcome["fault"] = _outcome(pipe, batch)
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # the process group is broken; skip its teardown


def _outcome(pipe: DistributedPipeline, batch: tuple) -> str:
    try:
        pipe.step(*batch)
        return "completed"
    except CollectiveError as exc:
        return str(exc)


if __name__ == "__main__":
    run_worker(globals())
