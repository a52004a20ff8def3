"""Pipeline schedules on 2 (or 4) processes (gloo, loopback): measured step time and idle fraction per rank, next to
the simulator's prediction, and peak memory per rank, measured next to an estimate.

Usage: OMP_NUM_THREADS=1 python bench/pipeline.py [--world 2] [--layers 8] [--width 512] [--micro-batch 16]
                                                  [--microbatches 8] [--steps 8]
Starts `--world` ranks itself; rank 0 prints the table. The model is a stack of Linear+ReLU layers cut into `world`
stages (2·world chunks for VPP, 2 per rank) with device_guard. "idle" is the wall time a rank spent blocked on P2P
messages (receives and send completions) over its step time; "predicted" is the simulator's idle fraction for the
same schedule with uniform costs (F = 1, B = 2, B = W = 1 when split). Each schedule runs `--steps` timed steps
after 2 warm-up steps; the table gives medians. With 4 ranks on 2 cores the times measure the OS scheduler; read
the memory columns only.

Memory, per rank, in MiB: "measured" is the bytes of its chunks' state (parameters and optimizer state) and the
step's inputs, plus the allocation peak of one more step (`fleetc.runtime.memory.allocation_peak_bytes`: gradient
sums, stashed activations, transients). "estimated" is state + one gradient sum per parameter + the simulator's peak
number of micro-batch chunks the rank holds activations of (until their weight gradient, for ZB-H1) times the bytes a
chunk's forward keeps for its backward (its forward Program's fetches, views of parameters excluded), inputs
included. Transients (an op's temporaries, messages in flight) are not estimated.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fleetc
from fleetc.capture import capture_train_program
from fleetc.ir.liveness import aliased_input
from fleetc.ir.program import Program
from fleetc.passes.pipeline_parallel.partition import partition
from fleetc.passes.pipeline_parallel.schedule import build_schedule
from fleetc.passes.pipeline_parallel.simulate import simulate
from fleetc.runtime.memory import allocation_peak_bytes, held_bytes
from fleetc.runtime.pipeline_local import DistributedPipeline

SCHEDULES = [("FThenB", 1), ("1F1B", 1), ("VPP", 2), ("ZBH1", 1)]
MiB = 2 ** 20


class Stack(nn.Module):
    def __init__(self, layers: int, width: int, stages: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.stages = stages

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            with fleetc.device_guard(f"stage:{i * self.stages // len(self.layers)}"):
                x = F.relu(layer(x))
        return x


def state_bytes(pipe: DistributedPipeline, inputs: list[torch.Tensor]) -> int:
    """Bytes of this rank's chunks' persistables (parameters, optimizer state) and the step's inputs."""
    resolved = pipe.binding.resolve()
    return held_bytes([resolved[name] for name in pipe.holders] + inputs)


def stash_bytes(forward: Program) -> int:
    """Bytes a chunk's forward keeps per micro-batch for its backward: its fetches, views (`t(w)`) excluded."""
    views = {name for _, op in forward.walk_ops() for i, name in enumerate(op.outputs)
             if name and aliased_input(op, i) is not None}
    return sum(v.nbytes() for name in forward.fetches.values()
               if name not in views and (v := forward.find_var(name)) is not None)


def estimated_bytes(pipe: DistributedPipeline, rank: int, inputs: list[torch.Tensor]) -> int:
    """State + a gradient sum per parameter + peak held micro-batch chunks × what a chunk's forward keeps."""
    sim = simulate(pipe.schedule)
    chunks = pipe.chunks
    stash = [stash_bytes(pipe.plan.stages[s].phases["forward"]) for s in chunks]
    held = max(sim.peak_in_flight[rank], *(sim.peak_until_weights[rank:rank + 1] or [0]))
    grads = sum(pipe.binding.resolve()[name].nbytes for s in chunks for name in pipe.plan.stages[s].params)
    return state_bytes(pipe, inputs) + grads + held * max(stash)


def run(options: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for mode, vpp in SCHEDULES:
        torch.manual_seed(0)
        model = Stack(options.layers, options.width, world * vpp)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        m = options.microbatches
        x = torch.randn(options.micro_batch * m, options.width)
        y = torch.randn(options.micro_batch * m, options.width)
        program = capture_train_program(model, F.mse_loss, opt, (x[:options.micro_batch], y[:options.micro_batch]), {})
        schedule = build_schedule(mode, world, m, vpp)
        pipe = DistributedPipeline(program, partition(program, m), schedule, model, opt)
        times, waits = [], []
        for i in range(2 + options.steps):
            dist.barrier()
            start = time.perf_counter()
            pipe.step(x, y)
            if i >= 2:
                times.append(time.perf_counter() - start)
                waits.append(pipe.last_wait_s / times[-1])
        dist.barrier()
        measured = state_bytes(pipe, [x, y]) + allocation_peak_bytes(lambda p=pipe, a=(x, y): p.step(*a))
        gathered = [None] * world
        dist.all_gather_object(gathered, (statistics.median(times), statistics.median(waits), measured,
                                          estimated_bytes(pipe, pipe.ranks_here[0], [x, y])))
        sim = simulate(schedule)
        rows.append((mode + (f" (vpp {vpp})" if vpp > 1 else ""), gathered,
                     [sim.idle[r] / sim.makespan for r in range(world)]))
    if rank == 0:
        print(f"{options.layers} layers × width {options.width}, {options.microbatches} micro-batches of "
              f"{options.micro_batch}, {world} ranks, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        print(f"{'schedule':<14} {'step ms':>8}  " + "  ".join(f"rank {r} idle / predicted" for r in range(world)))
        for name, gathered, predicted in rows:
            step_ms = max(g[0] for g in gathered) * 1000
            cells = "  ".join(f"{g[1]:>10.1%} / {p:>9.1%}" for g, p in zip(gathered, predicted))
            print(f"{name:<14} {step_ms:>8.1f}  {cells}")
        print(f"\n{'schedule':<14}  " + "  ".join(f"rank {r} MiB measured / estimated" for r in range(world)))
        for name, gathered, _ in rows:
            print(f"{name:<14}  " + "  ".join(f"{g[2] / MiB:>17.2f} / {g[3] / MiB:>9.2f}" for g in gathered))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.rank is not None:
        run(options)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(r)],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(options.world),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))) for r in range(options.world)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
