"""Sharding: per-rank state bytes and step time of fleetc's stages 0-3 beside torch DDP and FSDP2 (fully_shard).

Usage: OMP_NUM_THREADS=1 python bench/sharding.py [--world 2] [--layers 12] [--width 256] [--batch 32]
                                                  [--rounds 5] [--steps 10]
Starts `--world` ranks on loopback (gloo) itself; rank 0 prints the table. Model: a stack of Linear+ReLU
layers, AdamW, MSE loss. "state MB per rank" is what a rank holds between steps plus the gradients it keeps
for its update: parameters + gradients + optimizer state (fleetc: `memory_stats()["sharding"]`, stage 0 counted
the same way; stage 3's parameters gathered in flight are not in it: the "in flight MB" column gives them,
`gathered_in_flight_bytes`; DDP and FSDP2: the local tensors, FSDP2's DTensor shards by their local size).
"peak MB per rank" is the step's peak: the tensors a rank holds across steps (parameters, kept gradients and
optimizer state, local parts only, and the batch) plus one step's allocation peak above them, from torch.profiler's
allocator events (`fleetc.runtime.memory.allocation_peak_bytes`): activations, gathered buckets and collective
buffers included.
Step times are the median over interleaved rounds; take them with 2 ranks only (more ranks than cores measure
the scheduler). "fleetc stage 3, one layer per bucket" sets `segment_broadcast_MB` to one Linear's weight and
bias, the buckets FSDP2's per-layer `fully_shard` makes.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import fleetc.fleet as fleet
from fleetc.runtime.memory import allocation_peak_bytes

MB = 1 << 20


def make_model(options: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(options.layers) for m in (nn.Linear(options.width, options.width),
                                                                      nn.ReLU())])


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(local_bytes(t) for slot in optimizer.state.values() for t in slot.values()
               if isinstance(t, torch.Tensor) and t.dim())


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state held by this rank (eager variants)."""
    params = list(model.parameters())
    return sum(local_bytes(p) for p in params) + sum(local_bytes(p.grad) for p in params if p.grad is not None) + \
        state_bytes(optimizer)


def fleetc_variant(options: argparse.Namespace, stage: int, segment_mb: float | None = None):
    """`segment_mb`: stage 3's parameter buckets (`segment_broadcast_MB`; default 32 MB: this model is one bucket)."""
    model = make_model(options)
    strategy = fleet.DistributedStrategy()
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage, **({"segment_broadcast_MB": segment_mb} if segment_mb else {})}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fleet.distributed_optimizer(optimizer, strategy)
    trainer = fleet.distributed_model(model, loss_fn=F.mse_loss)

    def held() -> tuple[int, int]:
        """(state bytes, stage 3's parameters gathered in flight at most)."""
        if stage:
            stats = trainer.memory_stats()["sharding"]
            return stats["total_bytes"], stats["gathered_in_flight_bytes"]
        return 2 * sum(local_bytes(p) for p in model.parameters()) + state_bytes(optimizer), 0  # every gradient kept
    return trainer.step, held, lambda: (model, optimizer)


def eager_variant(model: nn.Module):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x, y):
        optimizer.zero_grad(set_to_none=False)  # keep the gradients: they count as held
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss
    return step, lambda: (held_bytes(model, optimizer), 0), lambda: (model, optimizer)


def step_peak_bytes(step, holders, x: torch.Tensor, y: torch.Tensor) -> int:
    """Tensors held across steps (local parts; parameters, gradients kept, optimizer state, the batch) plus one
    step's allocation peak above them."""
    model, optimizer = holders()
    params = list(model.parameters())
    kept = [p.grad for p in params if p.grad is not None]
    state = [t for slot in optimizer.state.values() for t in slot.values() if isinstance(t, torch.Tensor) and t.dim()]
    return sum(local_bytes(t) for t in (*params, *kept, *state, x, y)) + allocation_peak_bytes(lambda: step(x, y))


def worker(options: argparse.Namespace) -> None:
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    x, y = torch.randn(options.batch, options.width), torch.randn(options.batch, options.width)
    variants = {f"fleetc stage {s}" + (" (plain data parallel)" if s == 0 else ""): fleetc_variant(options, s)
                for s in (0, 1, 2, 3)}
    layer_mb = (options.width + 1) * options.width * 4 / MB * 1.01  # one Linear's weight and bias per bucket
    variants["fleetc stage 3, one layer per bucket"] = fleetc_variant(options, 3, layer_mb)
    variants["torch DDP"] = eager_variant(DistributedDataParallel(make_model(options)))
    fsdp = make_model(options)
    mesh = init_device_mesh("cpu", (world,))
    for layer in fsdp:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    variants["torch FSDP2 (fully_shard)"] = eager_variant(fsdp)
    for step, *_ in variants.values():  # compile / build buckets
        step(x, y)
        step(x, y)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(options.rounds):
        for name, (step, *_) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(options.steps):
                step(x, y)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / options.steps)
    peaks = {name: step_peak_bytes(step, holders, x, y) for name, (step, _, holders) in variants.items()}
    held = {name: (*held(), peaks[name]) for name, (_, held, _) in variants.items()}
    every = [None] * world
    dist.all_gather_object(every, held)
    if rank == 0:
        params = sum(p.numel() for p in make_model(options).parameters())
        print(f"{world} ranks (gloo, loopback), {options.layers}x Linear({options.width},{options.width}) = {params} "
              f"parameters, AdamW, batch {options.batch} per rank, median of {options.rounds} rounds x "
              f"{options.steps} steps")
        print(f"{'variant':<38} {'state MB per rank (min-max)':>28} {'step ms':>9} {'in flight MB':>13} "
              f"{'peak MB per rank (min-max)':>27}")
        for name in variants:
            sizes = [h[name][0] / MB for h in every]
            flight = max(h[name][1] for h in every) / MB
            peak = [h[name][2] / MB for h in every]
            print(f"{name:<38} {min(sizes):>13.2f} - {max(sizes):<12.2f} {statistics.median(times[name]) * 1e3:>9.2f} "
                  f"{flight:>13.2f} {min(peak):>13.2f} - {max(peak):<11.2f}")
    fleet.stop_worker()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    options = parser.parse_args()
    if "RANK" not in os.environ:
        return launch_ranks(__file__, sys.argv[1:], options.world)
    worker(options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
