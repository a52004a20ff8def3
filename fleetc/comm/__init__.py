"""Data-parallel training on torch.distributed: environment, communicator groups, collective ops, Fleet API."""
from fleetc.comm import collectives, p2p, sharding_ops  # noqa: F401  (register the collective and pipeline op types)
from fleetc.comm.env import collective_timeout, set_collective_timeout, world_size
from fleetc.errors import CollectiveError

__all__ = ["CollectiveError", "collective_timeout", "set_collective_timeout", "world_size"]
