"""`import fleetc.fleet as fleet` in place of `import paddle.distributed.fleet as fleet`: strategies and the Fleet API.

Collective (data-parallel) mode on torch.distributed; parameter-server mode on torch.distributed.rpc.
"""
from fleetc.fleet.fleet_api import Fleet
from fleetc.fleet.optimizer import DistributedOptimizer
from fleetc.fleet.role_maker import PaddleCloudRoleMaker, UserDefinedRoleMaker
from fleetc.strategy import (
    BuildStrategy,
    DistributedStrategy,
    ExecutionStrategy,
    Strategy,
)

_fleet = Fleet()
init = _fleet.init
worker_index = _fleet.worker_index
worker_num = _fleet.worker_num
is_first_worker = _fleet.is_first_worker
is_worker = _fleet.is_worker
worker_endpoints = _fleet.worker_endpoints
barrier_worker = _fleet.barrier_worker
init_worker = _fleet.init_worker
stop_worker = _fleet.stop_worker
distributed_optimizer = _fleet.distributed_optimizer
distributed_model = _fleet.distributed_model
save_persistables = _fleet.save_persistables
load_persistables = _fleet.load_persistables
save_inference_model = _fleet.save_inference_model
is_server = _fleet.is_server
init_server = _fleet.init_server
run_server = _fleet.run_server
stop_server = _fleet.stop_server
server_num = _fleet.server_num
server_index = _fleet.server_index
server_endpoints = _fleet.server_endpoints

__all__ = [
    "BuildStrategy", "DistributedOptimizer", "DistributedStrategy", "ExecutionStrategy", "Fleet",
    "PaddleCloudRoleMaker", "Strategy", "UserDefinedRoleMaker", "barrier_worker", "distributed_model",
    "distributed_optimizer", "init", "init_worker", "is_first_worker", "is_worker", "load_persistables",
    "save_inference_model", "save_persistables", "stop_worker", "worker_endpoints", "worker_index", "worker_num",
    "init_server", "is_server", "run_server", "server_endpoints", "server_index", "server_num", "stop_server",
]
