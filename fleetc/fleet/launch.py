"""`fleetc run`: start a data-parallel job with torch.distributed.run (torchrun), as Paddle's fleetrun does."""
from __future__ import annotations

import argparse
import os
import socket
from typing import Any

from fleetc.errors import CommandError

DESCRIPTION = """\
Run SCRIPT in several processes with torch.distributed.run (torchrun): one machine with
--nproc_per_node processes (or one per --gpus entry), or several machines (--ips) meeting at a
c10d rendezvous on the first address. Each process gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT, which fleet.init(is_collective=True) reads.
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


def run_command(options: argparse.Namespace) -> int:
    """Launch and wait; the exit status is 0 when every process succeeded, 1 otherwise."""
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
