"""Start a benchmark script once per rank on loopback, with torchrun's environment, and wait for every rank."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

DEADLINE_S = 900


def launch_ranks(script: str, argv: list[str], world: int) -> int:
    """Run `python script *argv` as `world` ranks (gloo on 127.0.0.1); the worst exit status, 1 on a timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), FLEETC_COLLECTIVE_TIMEOUT="120")
        procs.append(subprocess.Popen([sys.executable, script, *argv], env=env))
    try:
        return max(p.wait(timeout=DEADLINE_S) for p in procs)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        print(f"bench/{pathlib.Path(script).name}: ranks did not finish within {DEADLINE_S} s", file=sys.stderr)
        return 1
