"""Runs a worker function in N processes on loopback (gloo), each with torchrun's environment, under a hard deadline."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

TESTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: still running at the deadline (killed)
    output: str
    result: object


def spawn(world: int, worker: str, args: dict, out_dir: pathlib.Path, deadline_s: float = 90.0,
          collective_timeout_s: float = 20.0) -> list[RankResult]:
    """Start `world` processes running `workers.<worker>(rank, args, out_dir)`; kill them all at the deadline."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", FLEETC_COLLECTIVE_TIMEOUT=str(collective_timeout_s),
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
        command = [sys.executable, "-m", "distributed.workers", worker, json.dumps(args), str(out_dir)]
        procs.append(subprocess.Popen(command, env=env, cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    end = time.monotonic() + deadline_s
    results = []
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=max(0.1, end - time.monotonic()))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            output, _ = proc.communicate()
            code = None
        path = out_dir / f"rank{rank}.pt"
        results.append(RankResult(rank, code, output, torch.load(path) if path.exists() else None))
    return results


def assert_all_ok(results: list[RankResult]) -> None:
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.output[-3000:]}"
