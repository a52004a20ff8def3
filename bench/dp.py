"""Data-parallel step time and collective count: fleetc unfused vs fused (vs overlapped) vs torch DDP, side by side.

"fused, packing copy" is fused with the `allreduce_views` pass disabled: the start op copies every gradient
into the bucket buffer instead of the producers writing into it.

Usage: OMP_NUM_THREADS=1 python bench/dp.py [--layers 25] [--width 256] [--batch 32] [--rounds 7] [--steps 10]
Starts 2 ranks on loopback (gloo) itself; rank 0 prints the table. The model is a stack of Linear+ReLU
layers (2 parameter tensors per layer, so 25 layers = 50 tensors). Each round times every variant for
`--steps` steps in turn (interleaved, so machine load affects all alike); the table gives the median.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import launch_ranks  # bench/ranks.py (the script's folder is on sys.path)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fleetc.fleet as fleet
from fleetc.passes.data_parallel.allreduce import START

WORLD = 2
VARIANTS = {  # name → (strategy fields, passes disabled)
    "fleetc unfused": ({"fuse_all_reduce_ops": False}, ()),
    "fleetc fused, packing copy": ({"fuse_all_reduce_ops": True}, ("allreduce_views",)),
    "fleetc fused": ({"fuse_all_reduce_ops": True}, ()),
    "fleetc fused+overlap": ({"fuse_all_reduce_ops": True, "sync_nccl_allreduce": False}, ()),
}


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def fleetc_trainer(options: argparse.Namespace, fields: dict, disabled: tuple):
    model = make_model(options.layers, options.width)
    strategy = fleet.DistributedStrategy()
    for key, value in fields.items():
        setattr(strategy, key, value)
    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3), strategy)
    trainer = fleet.distributed_model(model, loss_fn=F.mse_loss, disable_passes=disabled)
    return trainer.step, trainer


def ddp_step(options: argparse.Namespace):
    model = DistributedDataParallel(make_model(options.layers, options.width))  # default bucket_cap_mb
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return step, model


def worker(options: argparse.Namespace) -> None:
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    x, y = torch.randn(options.batch, options.width), torch.randn(options.batch, options.width)
    steps, counts, views = {}, {}, {}
    for name, (fields, disabled) in VARIANTS.items():
        steps[name], trainer = fleetc_trainer(options, fields, disabled)
        steps[name](x, y)  # compile
        counts[name] = sum(op.type == START for _, op in trainer.program.walk_ops())
        views[name] = trainer.report().stats.get("allreduce_views", {})
    steps["torch DDP"], ddp = ddp_step(options)
    steps["torch DDP"](x, y)
    steps["torch DDP"](x, y)  # DDP rebuilds its buckets after the first iteration
    counts["torch DDP"] = len(ddp._get_ddp_logging_data()["bucket_sizes"].split(", "))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(options.rounds):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(options.steps):
                step(x, y)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / options.steps)
    if rank == 0:
        params = len(list(make_model(options.layers, options.width).parameters()))
        unfused = statistics.median(times["fleetc unfused"])
        ddp_time = statistics.median(times["torch DDP"])
        print(f"{WORLD} ranks (gloo, loopback), {params} parameter tensors, "
              f"{options.layers}x Linear({options.width},{options.width}), batch {options.batch} per rank, "
              f"median of {options.rounds} rounds x {options.steps} steps")
        print(f"{'variant':<26} {'collectives/step':>16} {'step ms':>9} {'vs unfused':>10} {'vs DDP':>8}")
        for name in steps:
            median = statistics.median(times[name])
            print(f"{name:<26} {counts[name]:>16} {median * 1e3:>9.2f} {median / unfused:>10.2f} "
                  f"{median / ddp_time:>8.2f}")
        print("gradients written into the bucket buffer / copied into it: "
              + ", ".join(f"{name} {v['in_place']}/{v['copied']}" if v else f"{name} all copied (pass off)"
                          for name, v in views.items()))
    fleet.stop_worker()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=25)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    options = parser.parse_args()
    if "RANK" not in os.environ:
        return launch_ranks(__file__, sys.argv[1:], WORLD)
    worker(options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
