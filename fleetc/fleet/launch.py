"""`fleetc run`: start a data-parallel job with torch.distributed.run (torchrun), as Paddle's fleetrun does."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from typing import Any

from fleetc.errors import CommandError

DESCRIPTION = """\
Run SCRIPT in several processes with torch.distributed.run (torchrun): one machine with
--nproc_per_node processes (or one per --gpus entry), or several machines (--ips) meeting at a
c10d rendezvous on the first address. Each process gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT, which fleet.init(is_collective=True) reads.

With --server_num S --worker_num W it starts a parameter-server job instead: S server and W worker
processes on this machine with Paddle's role environment (TRAINING_ROLE, PADDLE_PSERVERS_IP_PORT_LIST,
PADDLE_TRAINERS_NUM, PADDLE_TRAINER_ID, POD_IP, PADDLE_PORT), which fleet.init() reads. Servers listen
on the --servers endpoints (default: free loopback ports). The rpc transport is unauthenticated: run
parameter-server jobs on a trusted network only.
"""


def add_run_command(commands: Any) -> None:
    """Add `run` to the `fleetc` command line's subcommands."""
    run = commands.add_parser("run", help="launch a data-parallel training script (wraps torchrun)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.set_defaults(handler=run_command)
    count = run.add_mutually_exclusive_group()
    count.add_argument("--nproc_per_node", type=int, metavar="N", help="processes on this machine (default 1)")
    count.add_argument("--gpus", metavar="0,1,...", help="one process per listed GPU (sets CUDA_VISIBLE_DEVICES)")
    run.add_argument("--ips", metavar="HOST1,HOST2", help="the job's machines; the first hosts the rendezvous")
    run.add_argument("--master_port", type=int, default=29500, help="rendezvous port for --ips (default 29500)")
    run.add_argument("--server_num", type=int, metavar="S", help="parameter-server job: S server processes")
    run.add_argument("--worker_num", type=int, metavar="W", help="parameter-server job: W worker processes")
    run.add_argument("--servers", metavar="IP:PORT,...", help="parameter-server job: the servers' endpoints "
                     "(default: --server_num free ports on 127.0.0.1)")
    run.add_argument("script", metavar="SCRIPT", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to SCRIPT")


def torchrun_arguments(options: argparse.Namespace) -> list[str]:
    """The torch.distributed.run command line for `fleetc run` options."""

    if options.gpus is not None:
        gpus = [g for g in options.gpus.split(",") if g.strip()]
        if not all(g.strip().isdigit() for g in gpus) or not gpus:
            raise CommandError(f"--gpus {options.gpus!r} must list GPU indices, e.g. 0,1")
        nproc = len(gpus)
    else:
        nproc = options.nproc_per_node if options.nproc_per_node is not None else 1
    if nproc < 1:
        raise CommandError(f"--nproc_per_node must be at least 1, not {nproc}")
    if not os.path.isfile(options.script):
        raise CommandError(f"training script {options.script!r} does not exist")
    if not 1 <= options.master_port <= 65535:
        raise CommandError(f"--master_port {options.master_port} is not a TCP port (1 to 65535)")
    ips = [ip.strip() for ip in (options.ips or "").split(",") if ip.strip()]
    if len(ips) > 1:
        where = ["--nnodes", str(len(ips)), "--rdzv_backend", "c10d",
                 "--rdzv_endpoint", f"{ips[0]}:{options.master_port}"]
    else:
        where = ["--standalone"]
    return [*where, "--nproc_per_node", str(nproc), "--max_restarts", "0", options.script, *options.script_args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ps_environments(options: argparse.Namespace) -> list[tuple[str, dict[str, str]]]:
    """(name, environment additions) of every process of a parameter-server job, servers first."""
    if options.nproc_per_node is not None or options.gpus is not None or options.ips is not None:
        raise CommandError("--server_num/--worker_num start a parameter-server job; --nproc_per_node, --gpus and "
                           "--ips are for collective jobs")
    if options.servers:
        servers = [e.strip() for e in options.servers.split(",") if e.strip()]
        if options.server_num is not None and options.server_num != len(servers):
            raise CommandError(f"--servers lists {len(servers)} endpoint(s) but --server_num is {options.server_num}")
    else:
        if options.server_num is None or options.server_num < 1:
            raise CommandError(f"--server_num must be at least 1, not {options.server_num}")
        servers = [f"127.0.0.1:{_free_port()}" for _ in range(options.server_num)]
    if options.worker_num is None or options.worker_num < 1:
        raise CommandError(f"--worker_num must be at least 1, not {options.worker_num}")
    for endpoint in servers:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise CommandError(f"--servers entry {endpoint!r} is not ip:port")
    if not os.path.isfile(options.script):
        raise CommandError(f"training script {options.script!r} does not exist")
    common = {"PADDLE_PSERVERS_IP_PORT_LIST": ",".join(servers), "PADDLE_TRAINERS_NUM": str(options.worker_num)}
    jobs = [(f"server{i}", {**common, "TRAINING_ROLE": "PSERVER", "POD_IP": e.rpartition(":")[0],
                            "PADDLE_PORT": e.rpartition(":")[2]}) for i, e in enumerate(servers)]
    jobs += [(f"worker{i}", {**common, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(i)})
             for i in range(options.worker_num)]
    return jobs


def run_parameter_server_job(options: argparse.Namespace) -> int:
    """Start every server and worker; when one fails, stop the others. 0 when all succeeded, else 1."""
    procs = []
    for name, extra in ps_environments(options):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        procs.append((name, subprocess.Popen([sys.executable, options.script, *options.script_args],
                                             env={**env, **extra})))
    failed = None
    while failed is None and any(p.poll() is None for _, p in procs):
        failed = next((name for name, p in procs if p.poll() not in (None, 0)), None)
        time.sleep(0.1)
    failed = failed or next((name for name, p in procs if p.returncode != 0), None)
    for _, proc in procs:  # a failure: the others cannot finish the job; stop them rather than wait for timeouts
        if proc.poll() is None:
            proc.terminate()
    for _, proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if failed is not None:
        print(f"fleetc run: {options.script} failed in {failed} (exit status "
              f"{dict(procs)[failed].returncode}); the other processes were stopped")
        return 1
    return 0


def run_command(options: argparse.Namespace) -> int:
    """Launch and wait; the exit status is 0 when every process succeeded, 1 otherwise."""
    if options.server_num is not None or options.worker_num is not None or options.servers is not None:
        return run_parameter_server_job(options)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    arguments = torchrun_arguments(options)
    if "--rdzv_endpoint" in arguments:  # torchrun would retry an unknown host for minutes
        host = arguments[arguments.index("--rdzv_endpoint") + 1].rpartition(":")[0]
        try:
            socket.getaddrinfo(host, options.master_port)
        except (OSError, UnicodeError) as exc:
            raise CommandError(f"cannot resolve the rendezvous host {host!r} (the first of --ips): {exc}") from None
    if options.gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = options.gpus
    try:
        torchrun(arguments)
    except ChildFailedError as exc:
        print(f"fleetc run: {options.script} failed: {' '.join(str(exc).split())[:2000]}")
        return 1
    except Exception as exc:  # torchrun failed before any process ran (rendezvous, bad host, …): one line
        raise CommandError(f"torchrun could not start the job: {type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:500]}") from None
    return 0
