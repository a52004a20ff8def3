"""Role makers: where `fleet.init` learns this process's rank, the world size and the worker endpoints."""
from __future__ import annotations

from fleetc.comm.env import Role, role_from_environment
from fleetc.comm.ps.role import PsRole, role_from_ps_environment


class PaddleCloudRoleMaker:
    """The role from the launcher's environment: collective (torchrun / `fleetc run`: RANK, WORLD_SIZE,
    MASTER_ADDR/PORT) or parameter server (`fleetc run --server_num`: TRAINING_ROLE, PADDLE_PSERVERS_IP_PORT_LIST,
    PADDLE_TRAINERS_NUM, PADDLE_TRAINER_ID, POD_IP, PADDLE_PORT)."""

    def __init__(self, is_collective: bool = True):
        self.is_collective = is_collective

    def role(self) -> Role:
        return role_from_environment()

    def ps_role(self) -> PsRole:
        return role_from_ps_environment()


class UserDefinedRoleMaker:
    """An explicit role: `current_id` (the rank) and `worker_endpoints` (one `ip:port` per rank, rank 0 first)."""

    def __init__(self, current_id: int, worker_endpoints: list[str], is_collective: bool = True):
        self.is_collective = is_collective
        self._role = Role(int(current_id), len(worker_endpoints), tuple(worker_endpoints))

    def role(self) -> Role:
        return self._role
