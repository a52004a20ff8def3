"""Paddle's parameter-server role environment (what `fleetc run --server_num S --worker_num W` sets) as a PsRole."""
from __future__ import annotations

import os
from dataclasses import dataclass

from fleetc.errors import FleetcError

SERVER = "PSERVER"
TRAINER = "TRAINER"
# The variables a parameter-server process needs, and what each says.
REQUIRED = {
    "TRAINING_ROLE": "PSERVER or TRAINER",
    "PADDLE_PSERVERS_IP_PORT_LIST": "every server's ip:port, comma separated",
    "PADDLE_TRAINERS_NUM": "the number of workers",
}


@dataclass(frozen=True)
class PsRole:
    """A process of a parameter-server job: server or worker, its index, the servers' endpoints, the worker count."""

    is_server: bool
    index: int
    server_endpoints: tuple[str, ...]
    worker_num: int

    def __post_init__(self) -> None:
        if not self.server_endpoints:
            raise FleetcError("a parameter-server job needs at least one server endpoint")
        if self.worker_num < 1:
            raise FleetcError(f"a parameter-server job needs at least one worker, not {self.worker_num}")
        count = len(self.server_endpoints) if self.is_server else self.worker_num
        if not 0 <= self.index < count:
            kind = "server" if self.is_server else "worker"
            raise FleetcError(f"{kind} index {self.index} is outside the job's {count} {kind}(s)")

    @property
    def server_num(self) -> int:
        return len(self.server_endpoints)

    @property
    def name(self) -> str:
        """This process's rpc name: `server<i>` or `worker<i>`."""
        return f"server{self.index}" if self.is_server else f"worker{self.index}"

    @property
    def rpc_rank(self) -> int:
        """Servers take rpc ranks 0..S-1 (server 0 hosts the rendezvous store on its listed endpoint), workers S..."""
        return self.index if self.is_server else self.server_num + self.index


def ps_environment_present() -> bool:
    """Whether the launcher set a parameter-server role (TRAINING_ROLE)."""
    return "TRAINING_ROLE" in os.environ


def _int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise FleetcError(f"the environment variable {name} must be an integer, not {value!r}") from None


def role_from_ps_environment() -> PsRole:
    """The role from TRAINING_ROLE, PADDLE_PSERVERS_IP_PORT_LIST, PADDLE_TRAINERS_NUM and PADDLE_TRAINER_ID (workers)
    or PADDLE_PORT / POD_IP (servers: which listed endpoint is this one); FleetcError naming what is missing."""
    missing = [f"{k} ({why})" for k, why in REQUIRED.items() if not os.environ.get(k)]
    if missing:
        raise FleetcError("fleet.init(is_collective=False) is parameter-server mode and reads the launcher's "
                          f"environment, but {', '.join(missing)} is not set. Start the job with "
                          "`fleetc run --server_num S --worker_num W script.py`, or pass a role maker.")
    role = os.environ["TRAINING_ROLE"].upper()
    if role not in (SERVER, TRAINER):
        raise FleetcError(f"TRAINING_ROLE must be PSERVER or TRAINER, not {os.environ['TRAINING_ROLE']!r}")
    endpoints = tuple(e.strip() for e in os.environ["PADDLE_PSERVERS_IP_PORT_LIST"].split(",") if e.strip())
    workers = _int("PADDLE_TRAINERS_NUM")
    if role == TRAINER:
        if "PADDLE_TRAINER_ID" not in os.environ:
            raise FleetcError("TRAINING_ROLE=TRAINER needs PADDLE_TRAINER_ID (this worker's index)")
        return PsRole(False, _int("PADDLE_TRAINER_ID"), endpoints, workers)
    if "PADDLE_PORT" not in os.environ:
        raise FleetcError("TRAINING_ROLE=PSERVER needs PADDLE_PORT (and POD_IP) naming this server's endpoint")
    mine = f"{os.environ.get('POD_IP', '127.0.0.1')}:{os.environ['PADDLE_PORT']}"
    if mine not in endpoints:
        raise FleetcError(f"this server's endpoint {mine} (POD_IP:PADDLE_PORT) is not in "
                          f"PADDLE_PSERVERS_IP_PORT_LIST={','.join(endpoints)}")
    return PsRole(True, endpoints.index(mine), endpoints, workers)
