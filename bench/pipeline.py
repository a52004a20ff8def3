"""Pipeline schedules on 2 processes (gloo, loopback): measured step time and idle fraction per rank, next to the
simulator's prediction.

Usage: OMP_NUM_THREADS=1 python bench/pipeline.py [--layers 8] [--width 512] [--micro-batch 16]
                                                  [--microbatches 8] [--steps 8]
Starts 2 ranks itself; rank 0 prints the table. The model is a stack of Linear+ReLU layers cut into 2 stages
(4 chunks for VPP, 2 per rank) with device_guard. "idle" is the wall time a rank spent blocked on P2P messages
(receives and send completions) over its step time; "predicted" is the simulator's idle fraction for the same
schedule with uniform costs (F = 1, B = 2, B = W = 1 when split). Each schedule runs `--steps` timed steps after
2 warm-up steps; the table gives medians.
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
from fleetc.passes.pipeline_parallel.partition import partition
from fleetc.passes.pipeline_parallel.schedule import build_schedule
from fleetc.passes.pipeline_parallel.simulate import simulate
from fleetc.runtime.pipeline_local import DistributedPipeline

WORLD = 2
SCHEDULES = [("FThenB", 1), ("1F1B", 1), ("VPP", 2), ("ZBH1", 1)]


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


def run(options: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    rows = []
    for mode, vpp in SCHEDULES:
        torch.manual_seed(0)
        model = Stack(options.layers, options.width, WORLD * vpp)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        m = options.microbatches
        x = torch.randn(options.micro_batch * m, options.width)
        y = torch.randn(options.micro_batch * m, options.width)
        program = capture_train_program(model, F.mse_loss, opt, (x[:options.micro_batch], y[:options.micro_batch]), {})
        schedule = build_schedule(mode, WORLD, m, vpp)
        pipe = DistributedPipeline(program, partition(program, m), schedule, model, opt)
        times, waits = [], []
        for i in range(2 + options.steps):
            dist.barrier()
            start = time.perf_counter()
            pipe.step(x, y)
            if i >= 2:
                times.append(time.perf_counter() - start)
                waits.append(pipe.last_wait_s / times[-1])
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, (statistics.median(times), statistics.median(waits)))
        sim = simulate(schedule)
        rows.append((mode + (f" (vpp {vpp})" if vpp > 1 else ""), gathered,
                     [sim.idle[r] / sim.makespan for r in range(WORLD)]))
    if rank == 0:
        print(f"{options.layers} layers × width {options.width}, {options.microbatches} micro-batches of "
              f"{options.micro_batch}, {WORLD} ranks, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        print(f"{'schedule':<14} {'step ms':>8}  " + "  ".join(f"rank {r} idle / predicted" for r in range(WORLD)))
        for name, gathered, predicted in rows:
            step_ms = max(t for t, _ in gathered) * 1000
            cells = "  ".join(f"{w:>10.1%} / {p:>9.1%}" for (_, w), p in zip(gathered, predicted))
            print(f"{name:<14} {step_ms:>8.1f}  {cells}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port))) for r in range(WORLD)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
