"""Op/Var visits per compile stage (capture, then each pass) for nn.TransformerEncoder stacks of a given depth.

Shared by tests/test_compile_scaling.py and bench/compile_scaling.py: the model, batch and strategies of
issue 25's measurements (d=64, 4 heads, ff=128, seq 32, batch 4, AdamW).
"""
from __future__ import annotations

import torch
from torch import nn

import fleetc
from fleetc.capture import capture_train_program
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.visits import count_visits
from fleetc.passes.base import PassReport
from fleetc.passes.instruments import VisitCountInstrument
from fleetc.passes.manager import History, PassManager, PassRecord
from fleetc.passes.order import ordered_passes
from fleetc.runtime.executor import Executable
from fleetc.strategy import resolve_conflicts, resolve_strategy

DIM, HEADS, FF, SEQ, BATCH = 64, 4, 128, 32, 4


class Encoder(nn.Module):
    """`depth` TransformerEncoder layers and a linear head; the loss is the mean square of the output."""

    def __init__(self, depth: int):
        super().__init__()
        layer = nn.TransformerEncoderLayer(DIM, HEADS, FF, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)).pow(2).mean()


def encoder_and_batch(depth: int) -> tuple[nn.Module, torch.optim.Optimizer, tuple]:
    torch.manual_seed(0)
    model = Encoder(depth)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), (torch.randn(BATCH, SEQ, DIM),)


def all_passes_strategy() -> fleetc.DistributedStrategy:
    """Every fusion on, and recompute with the min-cut planner."""
    strategy = fleetc.DistributedStrategy()
    build = strategy.build_strategy
    for flag in ("fuse_gemm_epilogue", "fuse_elewise_add_act_ops", "fuse_dropout_add", "enable_auto_fusion",
                 "fuse_all_optimizer_ops"):
        setattr(build, flag, True)
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": "auto"}
    return strategy


def amp_strategy(dtype: str) -> fleetc.DistributedStrategy:
    """AMP alone in `dtype`; its default dynamic loss scaling comes with it."""
    strategy = fleetc.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"dtype": dtype}
    return strategy


STRATEGIES = {"default": lambda: None, "all_passes": all_passes_strategy,
              "amp_bf16": lambda: amp_strategy("bfloat16"), "amp_fp16": lambda: amp_strategy("float16")}


def stage_visits(depth: int, strategy_names: tuple[str, ...] = tuple(STRATEGIES)) -> dict[str, dict[str, int]]:
    """{strategy: {stage: Op/Var attribute reads}} for compiles of one captured Program: `capture` (fleetc's part
    of it; the same Program serves every strategy, as capture does not depend on the strategy), every pass, and
    `pass_manager` (the manager's own work around the passes: its copy of the Program, fingerprints, the final
    memory estimate), `codegen` (building the Executable); `codegen_source` is the generated step's length in
    characters, which CPython's `compile` of it is linear in (visits do not see that compile)."""
    model, optimizer, batch = encoder_and_batch(depth)
    results = {}
    with count_visits() as counter:
        captured = capture_train_program(model, None, optimizer, batch, {})
        capture = counter.total
        for name in strategy_names:
            config, _ = resolve_conflicts(resolve_strategy(STRATEGIES[name]()))
            instrument = VisitCountInstrument(counter)
            program = captured.clone()
            history = History([PassRecord("capture", program, PassReport("capture"), 0.0, estimate_memory(program))])
            start = counter.total
            final = PassManager(ordered_passes(config), [instrument]).run(program, config, history)
            manager = counter.total - start - sum(instrument.visits.values())
            start = counter.total
            executable = Executable(final)
            results[name] = {"capture": capture, **instrument.visits, "pass_manager": manager,
                             "codegen": counter.total - start,
                             "codegen_source": len(executable.source)}
    return results
