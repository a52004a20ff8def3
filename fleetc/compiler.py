"""`fleetc.compile`: capture → passes → executable, cached by input signature, behind CompiledTrainer."""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from fleetc.capture import (
    DynamicDims,
    SIZE_ONE,
    OptimizerSignature,
    capture_eval_program,
    capture_train_program,
    tensor_feed_names,
)
from fleetc.capture.dim_bounds import config_bounds
from fleetc.capture.hooks import optimizer_step_hooks, run_step_hooks
from fleetc.capture.int_arguments import tensor_positions
from fleetc.capture.to_program import INPUT_GRAD_FETCH
from fleetc.codegen.cpu.backend import resolve_mode
from fleetc.errors import CaptureError, GuardError, PassError, StrategyError
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Program
from fleetc.ir.repeated_blocks import find_repeated_blocks
from fleetc.ir.verifier import verify
from fleetc.passes.base import PassReport
from fleetc.passes.instruments import PassInstrument, PrintInstrument, VerifyInstrument
from fleetc.passes.manager import History, PassManager, PassRecord
from fleetc.passes.optimizers import GradClip
from fleetc.passes.order import (
    all_pass_names,
    ordered_passes,
    strategy_requests_without_pass,
)
from fleetc.passes.progress import CompileProgress, ProgressInstrument, progress_stage
from fleetc.passes.recompute import RecomputePolicy
from fleetc.report import CompileReport
from fleetc.runtime.checkpoint import (
    STATE_KEY,
    TrainerState,
    check_owned_state,
    load_checkpoint,
    owned_state_dict,
    rng_state,
    save_checkpoint,
)
from fleetc.compile_cache import CompileCache, CompileCacheError
from fleetc.runtime.execution import ExecutionPlan
from fleetc.runtime.dynamic_policy import DynamicPolicy
from fleetc.runtime.executor import Executable
from fleetc.runtime.memory import eager_peak_bytes
from fleetc.runtime.guards import GuardCheck, input_key, observe_guards
from fleetc.runtime.guards.shapes import ShapeGuards
from fleetc.runtime.hyperparameters import HyperparameterFeeds
from fleetc.runtime.pipeline_forward import ForwardPipeline, capture_microbatched, forward_pipeline
from fleetc.runtime.pipeline_local import PipelineExecutor, first_microbatch, make_pipeline
from fleetc.runtime.state import StateBinding
from fleetc.runtime.step_cache import DEFAULT_CACHE_LIMIT, StepCache
from fleetc.strategy import resolve_conflicts, resolve_strategy


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """The model in eval mode; afterwards every submodule's own training flag is back as it was."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


@dataclass
class CompiledStep:
    """Everything compiled for one input signature (and the world its guards describe)."""

    program: Program
    history: History
    executable: Executable
    binding: StateBinding
    report: CompileReport
    guards: GuardCheck
    tensor_positions: list[int]  # which leaves of (args, kwargs) are fed; the others are baked in
    out_spec: TreeSpec | None = None
    hyper_feeds: HyperparameterFeeds | None = None  # the optimizer's values the Program is fed every step
    post_hooked: list = ()  # without an optimizer: (name, param) of params with post-accumulate-grad hooks
    shapes: ShapeGuards | None = None  # a dynamic Program's shape guards (None: static, the cache key decides)
    pipeline: PipelineExecutor | ForwardPipeline | None = None  # strategy.pipeline: runs the per-stage Programs


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


class CompiledTrainer:
    """A model's training step compiled into a Program: `step()` trains, calling it evaluates."""

    def __init__(self, model: nn.Module, strategy: Any = None, *, optimizer: torch.optim.Optimizer | None = None,
                 loss_fn: Callable | None = None, measure_memory: bool = False, verify: bool = False,
                 disable_passes: Iterable[str] = (), print_after: str | None = None,
                 recompute_policy: RecomputePolicy | None = None, grad_clip: GradClip | None = None,
                 cpu_kernels: str | None = None, on_guard_failure: str = "recompile",
                 cache_limit: int = DEFAULT_CACHE_LIMIT, dynamic: bool | None = None,
                 dynamic_dims: dict[str, dict[int, str]] | None = None, compile_cache: str | None = None):
        self.model = model
        self.compile_cache = CompileCache(compile_cache)
        self.dynamic = DynamicPolicy(dynamic, dynamic_dims, config_bounds(model))
        self.cpu_kernels = resolve_mode(cpu_kernels)
        self.recompute_policy = recompute_policy
        if grad_clip is not None and optimizer is None:
            raise StrategyError("grad_clip clips the gradients the optimizer update reads, but optimizer=None "
                                "(gradients go to p.grad): pass an optimizer, or clip p.grad yourself")
        self.grad_clip = grad_clip
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.measure_memory = measure_memory
        self.verify = verify
        self.config, decisions = resolve_conflicts(resolve_strategy(strategy))
        self.decisions = [str(d) for d in decisions]
        self.execution = ExecutionPlan.from_config(self.config)
        self.disable_passes = tuple(disable_passes)
        unknown = set(self.disable_passes) - set(all_pass_names())
        if unknown:
            raise PassError(f"cannot disable unknown pass(es) {sorted(unknown)}; passes: {all_pass_names()}")
        if print_after not in (None, "all", "change"):
            raise ValueError(f"print_after must be None, 'all' or 'change', not {print_after!r}")
        self.print_after = print_after
        self.counters: dict[str, torch.Tensor] = {}
        self._cache = StepCache(cache_limit, on_guard_failure)
        self._steps = 0
        self._last_train: CompiledStep | None = None
        self._last_eval: CompiledStep | None = None
        self._last_shapes: list[torch.Size] = []
        self._last_batch: tuple[tuple, dict] | None = None  # under measure_memory: memory_stats() runs it eagerly
        self._optimizer_signature = OptimizerSignature()

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
        key = self.compile_cache.passes_key(program, self.config, self.disable_passes, self.recompute_policy,
                                            self.grad_clip)
        cached = self.compile_cache.load_passes(key)
        if cached is not None:
            if self.verify:
                verify(cached.program, after_pass="compile cache")
            return cached.result(program, capture_seconds, self.decisions, self.compile_cache.lines[-1])
        capture_report = PassReport("capture", changed=True, stats={"ops": program.num_ops()})
        history = History([PassRecord("capture", program, capture_report, capture_seconds, estimate_memory(program))])
        passes = ordered_passes(self.config, recompute_policy=self.recompute_policy, grad_clip=self.grad_clip)
        manager = PassManager(passes, self._instruments(), self.disable_passes, fingerprint_arguments=self.verify)
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
        report.repeated_blocks = [group.line() for group in find_repeated_blocks(program)]  # cached with the rest
        report.repeated_blocks += [f"{record.name}: {line}" for record in history[1:]
                                   for line in record.report.reused_blocks]
        self.compile_cache.store_passes(key, history, report)
        return final, history, report

    def _capture(self, kind: str, args: tuple, kwargs: dict, dynamic: DynamicDims) -> tuple[Program, Any]:
        if not dynamic:
            return self._trace(kind, args, kwargs, dynamic)
        try:
            return self._trace(kind, args, kwargs, dynamic)
        except CaptureError as exc:
            leaves = tree_flatten((args, kwargs))[0]
            tensors = [leaves[i] for i in tensor_positions(leaves)]
            ones = dynamic.size_one([tuple(t.shape) for t in tensors])
            if ones:  # a model that branches on a size being 1 (HF's `q_len > 1`) cannot trace it size-obliviously
                return self._capture(kind, args, kwargs, dynamic.pin(ones))
            if self.dynamic.dynamic is not None or self.dynamic.named:
                raise
            # dims marked automatically: a model that cannot be traced symbolically is compiled static
            self.dynamic.give_up(kind, str(exc).splitlines()[0])
        return self._trace(kind, args, kwargs, self.dynamic.marks[kind])

    def _trace(self, kind: str, args: tuple, kwargs: dict, dynamic: DynamicDims) -> tuple[Program, Any]:
        if kind == "train":
            if self.config.pipeline and self.optimizer is not None:  # the stages run one micro-batch at a time
                pipe = self.config.pipeline_configs
                args, kwargs = first_microbatch(args, kwargs, pipe.micro_batch_size, pipe.accumulate_steps)
            return capture_train_program(self.model, self.loss_fn, self.optimizer, args, kwargs, dynamic), None
        with _eval_mode(self.model):
            if self.config.pipeline:  # forward-only pipelining runs it one micro-batch at a time
                return capture_microbatched(lambda a, k: capture_eval_program(self.model, a, k, dynamic), args,
                                            kwargs, self.config.pipeline_configs.accumulate_steps)
            return capture_eval_program(self.model, args, kwargs, dynamic)

    def _cached_capture(self, kind: str, args: tuple, kwargs: dict, dynamic: DynamicDims) -> tuple[Program, Any]:
        """`_capture`'s result, from the compile cache when its mode is "capture" and an entry still fits."""
        optimizer = self.optimizer if kind == "train" else None
        key = self.compile_cache.capture_key(kind, self.model, self.loss_fn, optimizer, self.config, args, kwargs,
                                             dynamic)
        found = self.compile_cache.load_capture(key, kind, self.model, optimizer, args, kwargs)
        if found is not None:
            return found
        return self._capture_and_store(key, kind, args, kwargs, dynamic)

    def _capture_and_store(self, key: str | None, kind: str, args: tuple, kwargs: dict,
                           dynamic: DynamicDims) -> tuple[Program, Any]:
        program, out_spec = self._capture(kind, args, kwargs, dynamic)
        optimizer = self.optimizer if kind == "train" else None
        self.compile_cache.store_capture(key, kind, self.model, optimizer, args, kwargs, program, out_spec)
        return program, out_spec

    def _compile(self, kind: str, args: tuple, kwargs: dict, dynamic: DynamicDims) -> CompiledStep:
        start = time.perf_counter()
        progress_stage("capture")
        self.compile_cache.begin()
        program, out_spec = self._cached_capture(kind, args, kwargs, dynamic)
        try:
            final, history, report = self._optimize(program, time.perf_counter() - start)
        except CompileCacheError as exc:  # a capture hit whose ops do not decode (compile_cache/deferred.py)
            key = self.compile_cache.capture_again(program, exc)
            if key is None:
                raise
            program, out_spec = self._capture_and_store(key, kind, args, kwargs, dynamic)
            final, history, report = self._optimize(program, time.perf_counter() - start)
        self.compile_cache.rebuild_when_damaged(program, lambda: self._capture(kind, args, kwargs, dynamic)[0])
        progress_stage("codegen")
        executable = Executable(final, measure_memory=self.measure_memory, cpu_kernels=self.cpu_kernels,
                                num_threads=self.execution.threads)
        binding = StateBinding(final, self.model, self.optimizer, self.counters)
        # Observed after binding: amp use_pure_fp16 converts the parameters the guards record the dtype of.
        record = observe_guards(kind, self.model, self.optimizer, args, kwargs, program)
        final.metadata["guards"] = record.to_data()
        report.guards = record.summary()
        report.recompiles = self._cache.log
        report.execution = self.execution.lines()
        report.compile_seconds = time.perf_counter() - start
        report.cache = list(self.compile_cache.lines)
        report.kernels = executable.kernel_usage
        leaves = tree_flatten((args, kwargs))[0]
        accumulates = self.optimizer is None and kind == "train"  # into p.grad, across steps
        post_hooked = [(n, p) for n, p in self.model.named_parameters()
                       if accumulates and getattr(p, "_post_accumulate_grad_hooks", None)]
        pipeline = self._make_pipeline(final) if kind == "train" and "pipeline" in final.metadata else None
        if kind == "eval" and "pipeline" in final.metadata:
            pipeline = self._make_forward_pipeline(final)
        shapes = ShapeGuards(final) if "dynamic" in final.metadata else None
        if shapes is not None:
            report.guards += [f"shape: {line}" for line in shapes.summary()]
        return CompiledStep(final, history, executable, binding, report, GuardCheck(record, self.model, self.optimizer),
                            tensor_positions(leaves), out_spec,
                            HyperparameterFeeds(final, self.model, self.optimizer), post_hooked, shapes, pipeline)

    def _make_pipeline(self, program: Program) -> PipelineExecutor:
        """The executor of a Program the pipeline pass split: here every pipeline rank runs in this process (the
        data-parallel trainer runs this process's rank of its pipeline group instead)."""
        return make_pipeline(program, self.model, self.optimizer, self.counters, self.cpu_kernels)

    def _make_forward_pipeline(self, program: Program) -> ForwardPipeline:
        """The forward-only executor of an evaluation Program the pipeline pass split (every rank here)."""
        return forward_pipeline(program, self.cpu_kernels)

    def _key(self, kind: str, leaves: list, spec: TreeSpec, dynamic: DynamicDims | None = None) -> tuple:
        key: tuple = (("inputs", input_key(leaves, spec, dynamic)),)
        if kind == "train" and self.optimizer is not None:
            key += self._optimizer_signature(self.optimizer)
        return key

    def _feed_names(self, kind: str, args: tuple, kwargs: dict) -> Callable[[], list[str]]:
        return lambda: tensor_feed_names(self.model, args, kwargs, kind == "train" and self.loss_fn is not None)

    def _lookup(self, kind: str, args: tuple, kwargs: dict) -> tuple[CompiledStep, list]:
        leaves, spec = tree_flatten((args, kwargs))
        carried = self.dynamic.carry_ints(kind, leaves)  # the int arguments marked dynamic, as size carriers
        if carried is not leaves:
            leaves = carried
            args, kwargs = tree_unflatten(leaves, spec)
        tensors = [leaves[i] for i in tensor_positions(leaves)]
        dynamic = self.dynamic.dims(kind, tensors, self._feed_names(kind, args, kwargs))
        key = self._key(kind, leaves, spec, dynamic)
        compiled, reason = self._cache.lookup(kind, key, [t.shape for t in tensors])
        if compiled is None:
            self.dynamic.check_bounds(kind, [tuple(t.shape) for t in tensors])
            if reason is not None and reason.startswith("shape guard") and self._cache.on_guard_failure == "error":
                raise GuardError(f"{reason} (fleetc.compile(..., on_guard_failure='error') forbids recompiling; "
                                 "call with sizes the guard allows or compile with on_guard_failure='recompile')")
            # Dims whose size 1 a cached Program's guard rejects (the model branches on it) are traced at size 1.
            traced = dynamic.pin(self._cache.size_one_branches(kind, key, [t.shape for t in tensors]))
            with CompileProgress(f"fleetc: compiling the {kind} step"), _gc_paused():
                compiled = self._compile(kind, args, kwargs, traced)
            # The key holds the signs of the hyperparameters an update branches on, learned from the capture.
            self._optimizer_signature.learn(compiled.program)
            note = f"; traced symbolic in {_describe(dynamic, compiled)}" if dynamic or dynamic.gave_up else ""
            self._cache.add(kind, self._key(kind, leaves, spec, dynamic), compiled, reason, self._steps, note)
        return compiled, leaves

    # ----- running ---------------------------------------------------------------------------
    def _updates_this_step(self, compiled: CompiledStep) -> bool:
        """Whether this step runs the optimizer update (under gradient merge, every k-th step only)."""
        if compiled.pipeline is not None:  # which merges gradients itself under gradient merge
            return compiled.pipeline.updates_next_step
        merge = compiled.program.metadata.get("gradient_merge")
        if merge is None:
            return True
        return (int(self.counters[merge["step"]]) + 1) % merge["k_steps"] == 0

    @contextlib.contextmanager
    def _optimizer_step_hooks(self, compiled: CompiledStep) -> Iterator[None]:
        """The optimizer's step pre- and post-hooks around the compiled step, when it runs the update."""
        pre_hooks, post_hooks = optimizer_step_hooks(self.optimizer)
        hooked = bool(pre_hooks or post_hooks) and self._updates_this_step(compiled)
        if hooked:
            run_step_hooks(self.optimizer, pre_hooks)
        yield
        if hooked:
            run_step_hooks(self.optimizer, post_hooks)

    @staticmethod
    def _refuse_accumulating_post_hooks(compiled: CompiledStep) -> None:
        for name, param in compiled.post_hooked:
            if param.grad is not None:
                raise CaptureError(
                    f"{name} has post-accumulate-grad hooks and its .grad already holds a gradient: eager would run "
                    "them on the sum, fleetc runs them on each step's gradient. Clear gradients between steps "
                    "(model.zero_grad(set_to_none=True)) or use param.register_hook")

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One training step: forward, loss, backward and the optimizer update. Returns the loss.

        With `execution_strategy.num_iteration_per_run` N > 1, `step(batches)` takes a list or iterator of batches
        (each a tuple of positional arguments, a dict of keyword arguments, or one tensor), trains on N of them and
        returns their N losses as one tensor."""
        batches = self.execution.batches(args, kwargs)
        losses = [self._train_iteration(*batch) for batch in batches]
        return losses[0] if self.execution.iterations_per_run == 1 else torch.stack(losses)

    def _train_iteration(self, args: tuple, kwargs: dict) -> torch.Tensor:
        self._steps += 1
        compiled, leaves = self._lookup("train", args, kwargs)
        self._last_train = compiled
        if compiled.shapes is not None:
            self._last_shapes = [leaves[i].shape for i in compiled.tensor_positions]  # memory_stats() sizes
        self._refuse_accumulating_post_hooks(compiled)
        if self.measure_memory:
            self._last_batch = (args, kwargs)
        tensors = [leaves[i] for i in compiled.tensor_positions]
        feeds = _fed(compiled, tensors) + compiled.hyper_feeds.values()  # before resolve(), which creates missing optimizer state
        with self._optimizer_step_hooks(compiled):
            out = ({"loss": compiled.pipeline.step(*tensors)} if compiled.pipeline is not None
                   else compiled.executable.run(compiled.binding.resolve(), feeds))
        self._store_grads(compiled.program, out, tensors)
        if self.optimizer is not None:
            self.optimizer._opt_called = True  # what optimizer.step() tells LR schedulers (no call-order warning)
        self.execution.drop_scope(self._steps)
        return out["loss"]

    def _store_grads(self, program: Program, out: dict[str, Any], inputs: list[torch.Tensor]) -> None:
        """Accumulate into `p.grad` (without an optimizer) and into the `.grad` of inputs that require grad, as
        `loss.backward()` does."""
        feeds = dict(zip(program.feeds, inputs))
        params = dict(self.model.named_parameters()) if self.optimizer is None else {}
        for key, value in out.items():
            if key.startswith("grad:") and params:
                target = params[key[5:]]
            elif key.startswith(INPUT_GRAD_FETCH):
                target = feeds[key[len(INPUT_GRAD_FETCH):]]
                if not target.is_leaf:
                    continue  # eager keeps .grad only on leaves
            else:
                continue
            if target.grad is None:
                target.grad = value
            else:
                target.grad += value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, with eval semantics (dropout off, BatchNorm running stats) and no grad."""
        compiled, leaves = self._lookup("eval", args, kwargs)
        self._before_eval(compiled)
        self._last_eval = compiled
        run = compiled.executable.run if compiled.pipeline is None else compiled.pipeline.run  # forward-only
        out = run(compiled.binding.resolve(), _fed(compiled, [leaves[i] for i in compiled.tensor_positions]))
        outputs = [out[f"output.{i}"] for i in range(len(out))]
        return tree_unflatten(outputs, compiled.out_spec)

    def _before_eval(self, compiled: CompiledStep) -> None:
        """Whatever must hold before `compiled` evaluates (nothing in one process)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the whole, current parameters and buffers, keyed like `model.state_dict()`, on every rank
        (sharding stages 1 and 2 leave every parameter whole after each step, so this is the model's own state)."""
        return {name: value.detach().clone() for name, value in self.model.state_dict().items()}

    # ----- checkpointing ---------------------------------------------------------------------
    def _live_state(self) -> TrainerState:
        return TrainerState(self.model, self.optimizer, self.counters)

    def state_dict(self) -> dict[str, Any]:
        """fleetc's own state: copies of its counters and accumulators, the strategy state they belong to, and the
        RNG state; checkpoint it beside `model.state_dict()` and `optimizer.state_dict()` (or use save_checkpoint)."""
        return owned_state_dict(self.counters, self.config, [rng_state()])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict()` output, before or after the first step (a resumed run continues mid-cycle and
        the same random stream); CheckpointError, with nothing changed, when it does not fit this trainer."""
        check_owned_state(state_dict, self.counters, self.config, "the fleetc state_dict")
        live = self._live_state()
        live.restore_owned(state_dict[STATE_KEY], live.rng_of_this_rank(state_dict))

    def save_checkpoint(self, dirname: str) -> str:
        """Save model, optimizer and fleetc state (RNG included) as a new crash-safe version of the checkpoint
        directory `dirname` (docs/checkpoints.md); returns the version's directory."""
        return save_checkpoint(dirname, self._live_state(), self.config, [rng_state()])

    def load_checkpoint(self, dirname: str) -> str:
        """Restore what save_checkpoint (or fleet.save_persistables) wrote: every file is checked against this
        trainer first, so it is restored completely or not at all (CheckpointError). Returns the version read."""
        loaded = load_checkpoint(dirname, self._live_state(), self.config)
        if self._last_train is not None and self._last_train.pipeline is not None:
            self._last_train.pipeline.load_state(None)  # copies of tied parameters and merge sums predate the load
        return loaded

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
        report = self._require_train().report
        report.compiles = self._cache.compiles
        return report

    def generated_source(self) -> str:
        """The Python the runtime generated for the training Program."""
        return self._require_train().executable.source

    def memory_stats(self) -> dict[str, Any]:
        """The estimated peak (and under measure_memory=True the measured one, and eager PyTorch's for the last batch,
        measured on copies: `fleetc.runtime.memory.eager_peak_bytes`). For a dynamic Program the
        estimate is for the last step's sizes, with `estimated_peak_formula` in the dim names."""
        compiled = self._require_train()
        sizes = compiled.shapes.sizes(self._last_shapes) if compiled.shapes is not None else None
        stats = estimate_memory(compiled.program, sizes).as_dict()
        if compiled.executable.last_measured_peak_bytes is not None:
            stats["measured_peak_bytes"] = compiled.executable.last_measured_peak_bytes
            stats["eager_peak_bytes"] = eager_peak_bytes(self.model, self.optimizer, self.loss_fn, *self._last_batch)
        return stats


def _fed(compiled: CompiledStep, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a Program runs on: a dynamic one was traced on contiguous inputs (its views assume them)."""
    return tensors if compiled.shapes is None else [t.contiguous() for t in tensors]


def _describe(dynamic: DynamicDims, compiled: CompiledStep) -> str:
    """The dims a Program was traced symbolic in, in words (the recompile log's reason)."""
    info = compiled.program.metadata.get("dynamic")
    if info is None:
        return f"no dim: {dynamic.gave_up}" if dynamic.gave_up else "no dim"
    dims = [f"{name} ({feed} dim {dim})" for name, (feed, dim) in info["dims"].items()]
    pinned = [text.partition(" = ")[0] for text in info["specialised"] if text.endswith(SIZE_ONE)]
    return ", ".join(dims) or (f"no dim ({', '.join(pinned)} at size 1: {SIZE_ONE.strip(' ()')})" if pinned
                               else "no dim (the model fixes every size)")


def compile(model: nn.Module, strategy: Any = None, *, optimizer: torch.optim.Optimizer | None = None,
            loss_fn: Callable | None = None, measure_memory: bool = False, verify: bool = False,
            disable_passes: Iterable[str] = (), print_after: str | None = None,
            recompute_policy: RecomputePolicy | None = None, grad_clip: GradClip | None = None,
            cpu_kernels: str | None = None, on_guard_failure: str = "recompile",
            cache_limit: int = DEFAULT_CACHE_LIMIT, dynamic: bool | None = None,
            dynamic_dims: dict[str, dict[int, str]] | None = None, compile_cache: str | None = None) -> CompiledTrainer:
    """Compile `model`'s training step under `strategy` (any fleetc strategy object, or None for defaults).

    Compilation is lazy: the first `step(*inputs)` captures and compiles for that input signature.
    `verify=True` runs the IR verifier after every pass; `disable_passes` names passes to skip;
    `print_after` is None, "all" or "change"; `recompute_policy` replaces the default RecomputePolicy;
    `grad_clip` (fleetc.ClipGradByGlobalNorm / ClipGradByNorm / ClipGradByValue) clips the gradients inside the
    step, before the update; `cpu_kernels` ("off", "background", "sync"; default $FLEETC_CPU_KERNELS, else "off")
    runs fused ops on CPU tensors as generated C++ kernels, built in the background or before the first step
    (docs/cpu_backend.md). An
    optimizer from `fleet.distributed_optimizer` gives a data-parallel trainer (its strategy applies when
    `strategy` is None). When something a compiled step assumed changes (see docs/guards.md), the step recompiles
    (`on_guard_failure="recompile"`, logged in `report().recompiles`) or raises GuardError (`"error"`); at most
    `cache_limit` Programs per step kind are kept. `dynamic` (None: static first, then symbolic in the dims that
    changed, and int arguments that changed; True: batch and sequence dims symbolic from the start; False: never)
    and `dynamic_dims` (`{"input_ids": {0: "batch", 1: "seq"}}`; a name given twice is one symbol) say which input
    dims a Program is traced symbolic in, so that one Program serves many sizes (docs/dynamic_shapes.md); a `seq`
    dim is bounded by the model config's number of positions. `report().compiles` counts the Programs compiled.
    `compile_cache` ("off", "passes", "capture"; default $FLEETC_COMPILE_CACHE, else "off") keeps pass results, and
    with "capture" captures too, on disk across processes (docs/compile_cache.md); `report().cache` says hit or miss.
    """
    options = dict(loss_fn=loss_fn, measure_memory=measure_memory, verify=verify, disable_passes=disable_passes,
                   print_after=print_after, recompute_policy=recompute_policy, grad_clip=grad_clip,
                   cpu_kernels=cpu_kernels, on_guard_failure=on_guard_failure, cache_limit=cache_limit,
                   dynamic=dynamic, dynamic_dims=dynamic_dims, compile_cache=compile_cache)
    # An optimizer from fleet.distributed_optimizer builds its own (data-parallel) trainer: fleet sits above the
    # compiler and supplies it, so the compiler never imports the Fleet API.
    compile_trainer = getattr(optimizer, "compile_trainer", None)
    if compile_trainer is not None:
        return compile_trainer(model, strategy, **options)
    return CompiledTrainer(model, strategy, optimizer=optimizer, **options)
