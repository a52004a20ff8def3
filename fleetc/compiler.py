"""`fleetc.compile`: capture → passes → executable, cached by input signature, behind CompiledTrainer."""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from fleetc.capture import (
    capture_eval_program,
    capture_train_program,
    optimizer_signature,
    param_names,
)
from fleetc.codegen.cpu.backend import resolve_mode
from fleetc.errors import PassError
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Program
from fleetc.ir.verifier import verify
from fleetc.passes.base import PassReport
from fleetc.passes.instruments import PassInstrument, PrintInstrument, VerifyInstrument
from fleetc.passes.manager import History, PassManager, PassRecord
from fleetc.passes.order import (
    all_pass_names,
    ordered_passes,
    strategy_requests_without_pass,
)
from fleetc.passes.progress import CompileProgress, ProgressInstrument, progress_stage
from fleetc.passes.recompute import RecomputePolicy
from fleetc.report import CompileReport
from fleetc.runtime.checkpoint import load_owned_state, owned_state_dict
from fleetc.runtime.executor import Executable
from fleetc.runtime.state import StateBinding
from fleetc.strategy import resolve_conflicts, resolve_strategy


@dataclass
class CompiledStep:
    """Everything compiled for one input signature."""

    program: Program
    history: History
    executable: Executable
    binding: StateBinding
    report: CompileReport
    out_spec: TreeSpec | None = None
    momentum_probes: tuple = ()  # per param group: (feeds "fresh"?, a param whose missing buffer means fresh)


@contextlib.contextmanager
def _gc_paused():
    """Compiling allocates many small objects (ops, Vars, Program copies) that live on; the cyclic collector's full
    passes over them would make compile time grow faster than the model, so it waits until the compile is done."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _signature(leaves: list, spec: TreeSpec) -> tuple:
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(("tensor", tuple(leaf.shape), leaf.dtype, str(leaf.device)))
        else:
            parts.append(("value", type(leaf).__name__, repr(leaf)))
    return (str(spec), *parts)


class CompiledTrainer:
    """A model's training step compiled into a Program: `step()` trains, calling it evaluates."""

    def __init__(self, model: nn.Module, strategy: Any = None, *, optimizer: torch.optim.Optimizer | None = None,
                 loss_fn: Callable | None = None, measure_memory: bool = False, verify: bool = False,
                 disable_passes: Iterable[str] = (), print_after: str | None = None,
                 recompute_policy: RecomputePolicy | None = None, cpu_kernels: str | None = None):
        self.model = model
        self.cpu_kernels = resolve_mode(cpu_kernels)
        self.recompute_policy = recompute_policy
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.measure_memory = measure_memory
        self.verify = verify
        self.config, decisions = resolve_conflicts(resolve_strategy(strategy))
        self.decisions = [str(d) for d in decisions]
        self.disable_passes = tuple(disable_passes)
        unknown = set(self.disable_passes) - set(all_pass_names())
        if unknown:
            raise PassError(f"cannot disable unknown pass(es) {sorted(unknown)}; passes: {all_pass_names()}")
        if print_after not in (None, "all", "change"):
            raise ValueError(f"print_after must be None, 'all' or 'change', not {print_after!r}")
        self.print_after = print_after
        self.counters: dict[str, torch.Tensor] = {}
        self._train_cache: dict[tuple, CompiledStep] = {}
        self._eval_cache: dict[tuple, CompiledStep] = {}
        self._last_train: CompiledStep | None = None
        self._last_eval: CompiledStep | None = None

    # ----- compiling -------------------------------------------------------------------------
    def _instruments(self) -> list[PassInstrument]:
        instruments: list[PassInstrument] = [VerifyInstrument()] if self.verify else []
        instruments.append(ProgressInstrument())
        if self.print_after:
            instruments.append(PrintInstrument(only_changed=self.print_after == "change"))
        return instruments

    def _optimize(self, program: Program, capture_seconds: float) -> tuple[Program, History, CompileReport]:
        if self.verify:
            verify(program, after_pass="capture")
        capture_report = PassReport("capture", changed=True, stats={"ops": program.num_ops()})
        history = History([PassRecord("capture", program, capture_report, capture_seconds, estimate_memory(program))])
        passes = ordered_passes(self.config, recompute_policy=self.recompute_policy)
        manager = PassManager(passes, self._instruments(), self.disable_passes)
        final = manager.run(program, self.config, history)
        report = CompileReport(decisions=list(self.decisions), ops_before=program.num_ops(), ops_after=final.num_ops())
        for record in history[1:]:
            report.stats[record.name] = dict(record.report.stats)
            if record.report.notes:
                report.notes[record.name] = list(record.report.notes)
            if record.report.changed:
                report.applied.append(record.name)
            elif record.report.skipped_reason:
                report.skipped[record.name] = record.report.skipped_reason
        report.skipped.update(strategy_requests_without_pass(self.config))
        report.memory = history[-1].memory.as_dict()
        return final, history, report

    def _compile(self, kind: str, args: tuple, kwargs: dict) -> CompiledStep:
        start = time.perf_counter()
        progress_stage("capture")
        if kind == "train":
            program, out_spec = capture_train_program(self.model, self.loss_fn, self.optimizer, args, kwargs), None
        else:
            program, out_spec = capture_eval_program(self.model, args, kwargs)
        final, history, report = self._optimize(program, time.perf_counter() - start)
        progress_stage("codegen")
        executable = Executable(final, measure_memory=self.measure_memory, cpu_kernels=self.cpu_kernels)
        binding = StateBinding(final, self.model, self.optimizer, self.counters)
        report.compile_seconds = time.perf_counter() - start
        report.kernels = executable.kernel_usage
        return CompiledStep(final, history, executable, binding, report, out_spec, self._momentum_probes(final))

    def _lookup(self, kind: str, args: tuple, kwargs: dict) -> tuple[CompiledStep, list]:
        leaves, spec = tree_flatten((args, kwargs))
        key = _signature(leaves, spec) + (self.model.training,)
        if kind == "train" and self.optimizer is not None:
            key += optimizer_signature(self.optimizer)
        cache = self._train_cache if kind == "train" else self._eval_cache
        if key not in cache:
            with CompileProgress(f"fleetc: compiling the {kind} step"), _gc_paused():
                cache[key] = self._compile(kind, args, kwargs)
        return cache[key], leaves

    # ----- running ---------------------------------------------------------------------------
    def _momentum_probes(self, program: Program) -> tuple:
        meta = program.metadata.get("optimizer")
        if meta is None:
            return ()
        names = param_names(self.model)
        probes = []
        for group, group_meta in zip(self.optimizer.param_groups, meta["groups"]):
            stateful = [p for p in group["params"] if program.find_var(f"{names[id(p)]}@momentum_buffer")]
            probes.append((group_meta["momentum_fresh"] is not None, stateful[0] if stateful else None))
        return tuple(probes)

    def _hyper_feeds(self, compiled: CompiledStep) -> list:
        """Per param group, in the order capture declared them: lr, then (SGD momentum) whether state is fresh."""
        if self.optimizer is None:
            return []
        feeds = []
        for group, (feeds_fresh, probe) in zip(self.optimizer.param_groups, compiled.momentum_probes):
            feeds.append(float(group["lr"]))
            if feeds_fresh:
                feeds.append(probe is None or "momentum_buffer" not in self.optimizer.state[probe])
        return feeds

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One training step: forward, loss, backward and the optimizer update. Returns the loss."""
        compiled, leaves = self._lookup("train", args, kwargs)
        self._last_train = compiled
        feeds = leaves + self._hyper_feeds(compiled)
        out = compiled.executable.run(compiled.binding.resolve(), feeds)
        if self.optimizer is None:
            self._store_grads(compiled.program, out)
        return out["loss"]

    def _store_grads(self, program: Program, out: dict[str, Any]) -> None:
        """Accumulate into `p.grad`, as `loss.backward()` does."""
        params = dict(self.model.named_parameters())
        for key, value in out.items():
            if key.startswith("grad:"):
                param = params[key[5:]]
                if param.grad is None:
                    param.grad = value
                else:
                    param.grad += value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, with eval semantics (dropout off, BatchNorm running stats) and no grad."""
        was_training = self.model.training
        self.model.eval()
        try:
            compiled, leaves = self._lookup("eval", args, kwargs)
        finally:
            self.model.train(was_training)
        self._last_eval = compiled
        out = compiled.executable.run(compiled.binding.resolve(), leaves)
        outputs = [out[f"output.{i}"] for i in range(len(out))]
        return tree_unflatten(outputs, compiled.out_spec)

    # ----- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Copies of fleetc-owned state (step counters, gradient-merge accumulators, …): checkpoint it beside
        `model.state_dict()` and `optimizer.state_dict()`."""
        return owned_state_dict(self.counters)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict()` output, before or after the first step; a resumed run continues mid-cycle."""
        load_owned_state(self.counters, state_dict)

    # ----- inspecting ------------------------------------------------------------------------
    def _require_train(self) -> CompiledStep:
        if self._last_train is None:
            raise RuntimeError("nothing compiled yet: call step(*example_inputs) first (compilation is lazy)")
        return self._last_train

    @property
    def program(self) -> Program:
        """The final training Program of the most recent step's signature."""
        return self._require_train().program

    @property
    def history(self) -> History:
        """One record per pass (capture first): name, Program after it, report, seconds, memory."""
        return self._require_train().history

    @property
    def eval_program(self) -> Program:
        if self._last_eval is None:
            raise RuntimeError("no evaluation call yet: call the trainer (trainer(x)) first")
        return self._last_eval.program

    def report(self) -> CompileReport:
        return self._require_train().report

    def generated_source(self) -> str:
        """The Python the runtime generated for the training Program."""
        return self._require_train().executable.source

    def memory_stats(self) -> dict[str, Any]:
        compiled = self._require_train()
        stats = estimate_memory(compiled.program).as_dict()
        if compiled.executable.last_measured_peak_bytes is not None:
            stats["measured_peak_bytes"] = compiled.executable.last_measured_peak_bytes
        return stats


def compile(model: nn.Module, strategy: Any = None, *, optimizer: torch.optim.Optimizer | None = None,
            loss_fn: Callable | None = None, measure_memory: bool = False, verify: bool = False,
            disable_passes: Iterable[str] = (), print_after: str | None = None,
            recompute_policy: RecomputePolicy | None = None, cpu_kernels: str | None = None) -> CompiledTrainer:
    """Compile `model`'s training step under `strategy` (any fleetc strategy object, or None for defaults).

    Compilation is lazy: the first `step(*inputs)` captures and compiles for that input signature.
    `verify=True` runs the IR verifier after every pass; `disable_passes` names passes to skip;
    `print_after` is None, "all" or "change"; `recompute_policy` replaces the default RecomputePolicy;
    `cpu_kernels` ("off", "background", "sync"; default $FLEETC_CPU_KERNELS, else "off") runs fused ops on CPU
    tensors as generated C++ kernels, built in the background or before the first step (docs/cpu_backend.md). An
    optimizer from `fleet.distributed_optimizer` gives a data-parallel trainer (its strategy applies when
    `strategy` is None).
    """
    options = dict(loss_fn=loss_fn, measure_memory=measure_memory, verify=verify, disable_passes=disable_passes,
                   print_after=print_after, recompute_policy=recompute_policy, cpu_kernels=cpu_kernels)
    # An optimizer from fleet.distributed_optimizer builds its own (data-parallel) trainer: fleet sits above the
    # compiler and supplies it, so the compiler never imports the Fleet API.
    compile_trainer = getattr(optimizer, "compile_trainer", None)
    if compile_trainer is not None:
        return compile_trainer(model, strategy, **options)
    return CompiledTrainer(model, strategy, optimizer=optimizer, **options)
