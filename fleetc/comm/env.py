"""The data-parallel environment: rank, world size and endpoints, and the process group built from them."""
from __future__ import annotations

import datetime
import math
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fleetc.errors import FleetcError

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "FLEETC_COLLECTIVE_TIMEOUT"


@dataclass(frozen=True)
class Role:
    """Who this process is in the job: its rank, the world size and every worker's host:port."""

    rank: int
    world_size: int
    endpoints: tuple[str, ...]

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise FleetcError(f"rank {self.rank} is outside the world of {self.world_size} worker(s)")
        if len(self.endpoints) != self.world_size:
            raise FleetcError(f"{len(self.endpoints)} worker endpoint(s) given for a world of {self.world_size}")


def role_from_environment() -> Role:
    """The role torchrun (or `fleetc run`) gives a process through RANK, WORLD_SIZE, MASTER_ADDR/PORT."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        return Role(0, 1, ("127.0.0.1:0",))
    world = int(os.environ["WORLD_SIZE"])
    # torchrun publishes only the rendezvous endpoint; peers' addresses are exchanged after joining.
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return Role(int(os.environ["RANK"]), world, (master,) * world)


def exchange_endpoints(role: Role) -> Role:
    """The role with every worker's own `ip:port` (its host address, the job's rendezvous port), gathered once."""
    if role.world_size == 1:
        return role
    port = role.endpoints[0].rpartition(":")[2]
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = "127.0.0.1"
    gathered: list = [None] * role.world_size
    dist.all_gather_object(gathered, f"{address}:{port}")
    return Role(role.rank, role.world_size, tuple(gathered))


_timeout_s: float | None = None  # set by fleet.init(timeout=...); else read from the environment when first needed


def _positive_seconds(value: object, source: str) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise FleetcError(f"{source} must be a number of seconds, not {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise FleetcError(f"{source} must be a positive, finite number of seconds, not {value!r}")
    return seconds


def collective_timeout() -> datetime.timedelta:
    """How long any collective wait may take before the job fails (fleet.init(timeout=...), else
    FLEETC_COLLECTIVE_TIMEOUT, else 300 s); FleetcError naming the variable when it is not a positive number."""
    if _timeout_s is not None:
        return datetime.timedelta(seconds=_timeout_s)
    return datetime.timedelta(seconds=_positive_seconds(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S),
                                                        f"the environment variable {TIMEOUT_ENV}"))


def set_collective_timeout(seconds: float) -> None:
    global _timeout_s
    _timeout_s = _positive_seconds(seconds, "the collective timeout")


def world_size() -> int:
    """Data-parallel world size; 1 when no process group is initialized."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def init_process_group(role: Role) -> None:
    """Join the job's default process group (gloo on CPU, NCCL when CUDA is available), bounded by the timeout."""
    if role.world_size == 1 or dist.is_initialized():
        return
    backend = "gloo"
    if torch.cuda.is_available():  # CPU tensors over gloo, CUDA tensors over NCCL, one GPU per local rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", role.rank)) % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, init_method=f"tcp://{role.endpoints[0]}", rank=role.rank,
                            world_size=role.world_size, timeout=collective_timeout())
