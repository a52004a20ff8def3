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


@dataclass
class Job:
    """Rank processes started together, killed together at `end`; each rank's output goes to a log file."""

    procs: list[subprocess.Popen]
    logs: list[pathlib.Path]
    out_dir: pathlib.Path
    end: float

    def collect(self) -> list[RankResult]:
        """Wait for every rank (all are killed at the deadline) and read what each left behind."""
        results = []
        for rank, proc in enumerate(self.procs):
            try:
                code = proc.wait(timeout=max(0.1, self.end - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in self.procs:
                    other.kill()
                proc.wait()
                code = None
            path = self.out_dir / f"rank{rank}.pt"
            results.append(RankResult(rank, code, self.logs[rank].read_text(errors="replace"),
                                      torch.load(path, weights_only=True) if path.exists() else None))
        return results


def start(world: int, worker: str, args: dict, out_dir: pathlib.Path, deadline_s: float = 90.0,
          collective_timeout_s: float = 20.0, module: str = "fleet.workers") -> Job:
    """Start `world` processes running `<module>.<worker>(rank, args, out_dir)`, to be killed at the deadline."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", FLEETC_COLLECTIVE_TIMEOUT=str(collective_timeout_s),
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
        command = [sys.executable, "-m", module, worker, json.dumps(args), str(out_dir)]
        logs.append(out_dir / f"rank{rank}.log")
        with logs[-1].open("w") as log:  # a file, not a pipe: a chatty rank never blocks on a full pipe
            procs.append(subprocess.Popen(command, env=env, cwd=TESTS, stdout=log, stderr=subprocess.STDOUT))
    return Job(procs, logs, out_dir, time.monotonic() + deadline_s)


def spawn(world: int, worker: str, args: dict, out_dir: pathlib.Path, deadline_s: float = 90.0,
          collective_timeout_s: float = 20.0, module: str = "fleet.workers") -> list[RankResult]:
    """Run `<module>.<worker>` in `world` processes and wait for them (all killed at the deadline)."""
    return start(world, worker, args, out_dir, deadline_s, collective_timeout_s, module).collect()


def assert_all_ok(results: list[RankResult]) -> None:
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.output[-3000:]}"


def start_ps(servers: int, workers: int, worker: str, args: dict, out_dir: pathlib.Path, deadline_s: float = 90.0,
             module: str = "fleet.ps_workers") -> Job:
    """A parameter-server job on loopback: `servers` then `workers` processes with Paddle's role environment (what
    `fleetc run --server_num --worker_num` sets), each running `<module>.<worker>`; rank i's log is rank<i>.log."""
    out_dir.mkdir(parents=True, exist_ok=True)
    endpoints = [f"127.0.0.1:{free_port()}" for _ in range(servers)]
    common = {"PADDLE_PSERVERS_IP_PORT_LIST": ",".join(endpoints), "PADDLE_TRAINERS_NUM": str(workers),
              "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    roles = [{"TRAINING_ROLE": "PSERVER", "POD_IP": "127.0.0.1", "PADDLE_PORT": e.rpartition(":")[2]}
             for e in endpoints] + [{"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(i)} for i in range(workers)]
    procs, logs = [], []
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    for rank, role in enumerate(roles):
        command = [sys.executable, "-m", module, worker, json.dumps(args), str(out_dir)]
        logs.append(out_dir / f"rank{rank}.log")
        with logs[-1].open("w") as log:
            procs.append(subprocess.Popen(command, env={**base, **common, **role}, cwd=TESTS, stdout=log,
                                          stderr=subprocess.STDOUT))
    return Job(procs, logs, out_dir, time.monotonic() + deadline_s)


def run_worker(namespace: dict, rank_variable: str = "RANK") -> None:
    """A worker module's `__main__`: call the function the launcher named (argv: name, JSON args, output path) with
    this process's rank (from `rank_variable`; -1 when unset) and those args. `dump_after_s` in the args makes a
    hung process print its stacks and exit before the test's deadline kills it."""
    import faulthandler

    name, args, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    if args.get("dump_after_s"):
        faulthandler.dump_traceback_later(args["dump_after_s"], exit=True)
    namespace[name](int(os.environ.get(rank_variable, "-1")), args, out)
