"""fleetc: a graph compiler for PyTorch training with PaddlePaddle Fleet's strategy-driven optimizations."""
from fleetc import (
    ops,  # noqa: F401  (registers fleetc's op types)
    viz,  # noqa: F401,E402  (registers the notebook views of Programs and pass records)
)
from fleetc.capture.device_guard import device_guard
from fleetc.capture.fp16_guard import fp16_guard
from fleetc.compiler import CompiledTrainer, compile
from fleetc.errors import (
    CaptureError,
    CheckpointError,
    CollectiveError,
    ExecutionError,
    ExportError,
    FleetcError,
    GuardError,
    PassError,
    ProgramParseError,
    StrategyError,
    UnsupportedOptimizerError,
    VerificationError,
)
from fleetc.fleet.inference import load_inference_model
from fleetc.ir.program import Block, Op, OpRole, Program, Var, VarKind
from fleetc.passes.optimizers import ClipGradByGlobalNorm, ClipGradByNorm, ClipGradByValue
from fleetc.report import CompileReport
from fleetc.runtime.checkpoint import read_checkpoint
from fleetc.strategy import (
    BuildStrategy,
    DistributedStrategy,
    ExecutionStrategy,
    Strategy,
)

__version__ = "0.1.0"

__all__ = [
    "Block", "BuildStrategy", "CaptureError", "CheckpointError", "ClipGradByGlobalNorm", "ClipGradByNorm",
    "ClipGradByValue", "CollectiveError", "CompileReport", "CompiledTrainer", "DistributedStrategy",
    "ExecutionError", "ExecutionStrategy", "ExportError", "FleetcError", "GuardError", "Op", "OpRole", "PassError", "Program",
    "ProgramParseError", "Strategy", "StrategyError", "UnsupportedOptimizerError", "Var", "VarKind",
    "VerificationError", "compile", "device_guard", "fp16_guard", "load_inference_model",
    "read_checkpoint",
]
