"""Training strategies: Paddle-compatible strategy objects, checked on assignment, and their frozen form.

Users build a DistributedStrategy (or BuildStrategy, ExecutionStrategy, or the newer Strategy);
the compiler turns it into a hashable StrategyConfig with resolve_strategy and settles
conflicting switches with resolve_conflicts.
"""

from fleetc.strategy.config import ConfigSection, StrategyConfig, resolve_strategy
from fleetc.strategy.conflicts import Decision, resolve_conflicts
from fleetc.strategy.distributed import DistributedStrategy
from fleetc.strategy.files import load_strategy_file
from fleetc.strategy.names import UnknownFieldError
from fleetc.strategy.new_style import Strategy
from fleetc.strategy.views import BuildStrategy, ExecutionStrategy

__all__ = [
    "BuildStrategy",
    "ConfigSection",
    "Decision",
    "DistributedStrategy",
    "ExecutionStrategy",
    "Strategy",
    "StrategyConfig",
    "UnknownFieldError",
    "load_strategy_file",
    "resolve_conflicts",
    "resolve_strategy",
]
