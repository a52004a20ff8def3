"""torch.distributed.rpc (TensorPipe) for a parameter-server job: joining, calling a server, leaving.

The rpc transport has no authentication or encryption: anyone who can reach the job's ports can call it, so a
parameter-server job belongs on a trusted network. Server 0 hosts the rendezvous store on its listed endpoint;
TensorPipe's own listeners bind ephemeral ports on the interface that reaches the listed addresses.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch.distributed.rpc as rpc

from fleetc.comm.ps.role import PsRole
from fleetc.errors import FleetcError

_LOOPBACK = ("127.", "localhost")


class ParameterServerError(FleetcError):
    """A server or worker of the job failed, or did not answer within the rpc timeout."""


def join(role: PsRole, timeout_s: float) -> None:
    """Join the job's rpc group (every server and worker must, within `timeout_s`)."""
    if all(e.startswith(_LOOPBACK) for e in role.server_endpoints):
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")  # loopback job: TensorPipe listens on loopback only
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{role.server_endpoints[0]}", rpc_timeout=timeout_s,
                                              num_worker_threads=16, _transports=["uv"], _channels=["basic"])
    try:
        rpc.init_rpc(role.name, rank=role.rpc_rank, world_size=role.server_num + role.worker_num,
                     rpc_backend_options=options)
    except RuntimeError as exc:
        raise ParameterServerError(f"{role.name} could not join the parameter-server job at "
                                   f"{role.server_endpoints[0]} within {timeout_s:g} s: "
                                   f"{' '.join(str(exc).split())[:300]}") from exc


def leave(graceful: bool) -> None:
    """Leave the rpc group: `graceful` waits for every process to leave too (the job's end); otherwise at once."""
    try:
        rpc.shutdown(graceful=graceful)
    except RuntimeError:
        if graceful:
            raise


def failed(server: str, what: str, exc: BaseException, timeout_s: float) -> ParameterServerError:
    """The error a worker raises when `server` did not answer `what`."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = (lines[-1] if "Traceback" in str(exc) else " ".join(lines))[:300] if lines else type(exc).__name__
    return ParameterServerError(
        f"parameter server {server} failed during {what} (rpc timeout {timeout_s:g} s): {text}. A server or, in sync "
        "mode, another worker may have died; the job cannot continue")


def call_all(calls: list[tuple[str, Callable, tuple]], what: str, timeout_s: float) -> list[Any]:
    """Issue one rpc per (server, fn, args) at once and wait for all; ParameterServerError naming the server."""
    futures = [(server, rpc.rpc_async(server, fn, args, timeout=timeout_s)) for server, fn, args in calls]
    results = []
    for server, future in futures:
        try:
            results.append(future.wait())
        except Exception as exc:  # rpc raises RuntimeError, or re-raises the server's exception
            raise failed(server, what, exc, timeout_s) from exc
    return results
