"""fleetc: a graph compiler for PyTorch training with PaddlePaddle Fleet's strategy-driven optimizations."""
from fleetc import (
    ops,  # noqa: F401  (registers fleetc's op types)
    viz,  # noqa: F401,E402  (registers the notebook views of Programs and pass records)
)
from fleetc.capture.device_guard import device_guard
from fleetc.compiler import CompiledTrainer, compile
from fleetc.errors import (
    CaptureError,
    CheckpointError,
    CollectiveError,
    FleetcError,
    GuardError,
    PassError,
    StrategyError,
    UnsupportedOptimizerError,
    VerificationError,
)
from fleetc.ir.program import Block, Op, OpRole, Program, Var, VarKind
from fleetc.report import CompileReport
from fleetc.strategy import (
    BuildStrategy,
    DistributedStrategy,
    ExecutionStrategy,
    Strategy,
)

__version__ = "0.1.0"

__all__ = [
    "Block", "BuildStrategy", "CaptureError", "CheckpointError", "CollectiveError", "CompileReport",
    "CompiledTrainer", "DistributedStrategy",
    "ExecutionStrategy", "FleetcError", "GuardError", "Op", "OpRole", "PassError", "Program", "Strategy", "StrategyError",
    "UnsupportedOptimizerError", "Var", "VarKind", "VerificationError", "compile", "device_guard",
]
