"""`import fleetc.fleet as fleet` in place of `import paddle.distributed.fleet as fleet`: the strategy classes."""
from fleetc.strategy import BuildStrategy, DistributedStrategy, ExecutionStrategy, Strategy

__all__ = ["BuildStrategy", "DistributedStrategy", "ExecutionStrategy", "Strategy"]
