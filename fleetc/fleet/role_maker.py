"""Role makers: where `fleet.init` learns this process's rank, the world size and the worker endpoints."""
from __future__ import annotations

from fleetc.comm.env import Role, role_from_environment


class PaddleCloudRoleMaker:
    """The role from the launcher's environment (torchrun / `fleetc run`: RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""

    def __init__(self, is_collective: bool = True):
        self.is_collective = is_collective

    def role(self) -> Role:
        return role_from_environment()


class UserDefinedRoleMaker:
    """An explicit role: `current_id` (the rank) and `worker_endpoints` (one `ip:port` per rank, rank 0 first)."""

    def __init__(self, current_id: int, worker_endpoints: list[str], is_collective: bool = True):
        self.is_collective = is_collective
        self._role = Role(int(current_id), len(worker_endpoints), tuple(worker_endpoints))

    def role(self) -> Role:
        return self._role
