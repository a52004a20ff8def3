"""AMP pass: runs white-listed ops (matmul, conv) in bf16/fp16, black-listed ones in float32, over forward AND backward.

The joint graph already holds the backward ops, so one dataflow sweep covers both directions: a
white op casts its float inputs to low precision, a black op to float32, and a gray op runs in low
precision only when all its float inputs already are (Paddle's promote rule). A mixed op (batch norm) is gray
for its activations (`input`, `grad_out`) and reads its parameters and statistics as they are (float32), as
Paddle's `_keep_fp32_input` and torch's CPU autocast do; its statistics outputs stay float32. Every value is cast
to a given dtype at most once and the cast reused. fleetc ops (optimizer updates, buffer assigns),
the aten ops of a traced optimizer update, and fetched values get back the dtype capture gave them, so gradients reach the optimizer in
float32 and parameters stay float32 (master weights). With `use_pure_fp16` the parameters themselves
become low precision and the updates go through float32 master copies (precision/master_weights.py);
with `use_fp16_guard` too (the default) only the ops inside `fleetc.fp16_guard` regions are cast, and only the
parameters nothing else reads become low precision, as in Paddle. Then dynamic loss scaling is added (precision/loss_scaling.py).
"""
from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fleetc.capture.fp16_guard import ATTR as FP16_GUARD
from fleetc.capture.to_program import grad_name
from fleetc.errors import PassError
from fleetc.ir.liveness import aliased_input
from fleetc.ir.meta_dtypes import real_results
from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind, map_refs
from fleetc.ir.registry import resolve_callable
from fleetc.ir.usedef import Names
from fleetc.ir.symbolic import concrete_shape, hints, traced_sizes
from fleetc.passes.base import PassReport
from fleetc.passes.precision.amp_lists import AmpLists
from fleetc.passes.precision.dtype_memo import DtypeMemo, Input
from fleetc.passes.precision.loss_scaling import insert_loss_scaling
from fleetc.passes.precision.master_weights import keep_master_weights

FLOAT32 = "float32"
_CAST_TYPE = "aten._to_copy.default"
_SUFFIX = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16"}
_SCALAR_STANDINS = {"bool": True, "int64": 1, "float64": 1.0}


def low_precision_dtype(requested: str | None, device: str) -> str:
    """amp_configs.dtype, or the default: float16 on CUDA, bfloat16 elsewhere (CPU kernels are fast in bf16)."""
    if requested is not None:
        return requested
    return "float16" if device.startswith("cuda") else "bfloat16"


class _CastRewriter:
    """One sweep over the global block, rebuilding its op list with casts and updated output dtypes."""

    def __init__(self, program: Program, lists: AmpLists, low: str, black_vars: set[str], report: PassReport,
                 low_params: set[str], guarded_only: bool = False):
        self.program = program
        self.guarded_only = guarded_only  # use_fp16_guard: ops outside fp16_guard regions stay float32
        self.block = program.global_block
        self.lists = lists
        self.low = low
        self.black_vars = black_vars
        self.report = report
        self.captured = {name: var.dtype for name, var in self.block.vars.items()}
        for name in low_params:  # use_pure_fp16: the parameters themselves are low precision from now on
            program.var(name).dtype = low
        self.original = {name: var.dtype for name, var in self.block.vars.items()}
        self.casts: dict[tuple[str, str], str] = {}
        self.names = Names(program)  # fresh cast names without rescanning the Program per cast
        self.ops: list[Op] = []
        self.producer: dict[str, Op] = {}  # name → the first op of `ops` defining it
        self.after: dict[str, list[Op]] = {}  # op name → casts to place right after it, newest first
        self.readers: dict[str, list[Op]] = {}
        for op in self.block.ops:
            for name in op.inputs:
                self.readers.setdefault(name, []).append(op)
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)
        self.sizes, self.traced_sizes = hints(program), traced_sizes(program)  # a dynamic Program: at traced sizes
        self.memo = DtypeMemo()

    def castable(self, name: str) -> bool:
        var = self.program.var(name)
        return var.shape is not None and var.dtype in (FLOAT32, self.low)

    # ----- casts ------------------------------------------------------------------------------
    def cast(self, name: str, dtype: str, template: Op, after: Op | None = None) -> str:
        """The Var holding `name` in `dtype`; the first time, its cast is appended to the ops built so far, or placed
        right after op `after` (spliced in by `placed()`, so no list insertion shifts the ops that follow)."""
        key = (name, dtype)
        if key not in self.casts:
            source = self.program.var(name)
            out = self.names.fresh(f"{name}@{_SUFFIX[dtype]}")
            self.block.add_var(Var(out, source.shape, dtype, source.device, VarKind.TEMP))
            attrs = {k: template.attrs[k] for k in ("op_role", "module_path", "forward_op", "op_device", "source")
                     if k in template.attrs}
            attrs["provenance"] = "amp"
            op = Op(self.names.fresh(f"{name}.cast_{_SUFFIX[dtype].lower()}"), _CAST_TYPE, (Ref(name),),
                    {"dtype": getattr(torch, dtype)}, outputs=[out], attrs=attrs)
            if after is None:
                self.append(op)
            else:
                self.after.setdefault(after.name, []).insert(0, op)
            self.casts[key] = out
            self.report.count("casts")
            self.report.count(f"casts_to_{dtype}")
        return self.casts[key]

    def restore_dtype(self, name: str, consumer: Op) -> str:
        """`name` in its captured dtype, cast right after its producer so e.g. float32 gradients are ready
        at the end of backward, before any optimizer op."""
        dtype = self.original[name]
        if self.program.var(name).dtype == dtype:
            return name
        producer = self.producer.get(name)
        return self.cast(name, dtype, consumer if producer is None else producer, producer)

    def append(self, op: Op) -> None:
        """Add `op` to the ops built so far, indexing the names it defines."""
        self.ops.append(op)
        for name in op.defined:
            self.producer.setdefault(name, op)

    def placed(self) -> list[Op]:
        """The ops built, with each op's casts right after it: one splice, in time linear in the ops."""
        return [placed for op in self.ops for placed in (op, *self.after.get(op.name, ()))]

    # ----- dtype inference --------------------------------------------------------------------
    def fake(self, name: str, dtype: str) -> Any:
        var = self.program.var(name)
        if var.shape is None:  # a dynamic Program's sizes count at their traced values
            return self.traced_sizes.get(name, _SCALAR_STANDINS.get(var.dtype, 1))
        with self.mode:
            return torch.empty(concrete_shape(var.shape, self.sizes), dtype=getattr(torch, dtype), device=var.device)

    def describe(self, name: str, dtype: str) -> Input:
        """All that `fake(name, dtype)` depends on."""
        var = self.program.var(name)
        if var.shape is None:
            return Input(None, var.dtype, var.device, self.traced_sizes.get(name, _SCALAR_STANDINS.get(var.dtype, 1)))
        return Input(tuple(concrete_shape(var.shape, self.sizes)), dtype, var.device)

    def infer(self, op: Op, dtypes: dict[str, str], args: tuple, kwargs: dict) -> list | None:
        """Output dtypes of `op` (None for a non-tensor output) with its inputs in `dtypes` (run on fake tensors),
        or None if it rejects them; answered by an identical earlier op when there is one (dtype_memo.py)."""
        dtype_of = lambda name: dtypes.get(name, self.program.var(name).dtype)

        def run() -> list | None:
            to_fake = lambda r: self.fake(r.name, dtype_of(r.name))
            try:
                with self.mode:
                    fake_args = map_refs(args, to_fake)
                    result = resolve_callable(op.type)(*fake_args, **map_refs(kwargs, to_fake))
                    values = real_results(op.type, fake_args,
                                          list(result) if isinstance(result, (tuple, list)) else [result])
            except Exception:  # noqa: BLE001 (any rejection means: run this op in float32 instead)
                return None
            return [v.dtype if isinstance(v, torch.Tensor) else None for v in values]

        return self.memo.infer(op, args, kwargs, lambda name: self.describe(name, dtype_of(name)), run)

    # ----- the sweep --------------------------------------------------------------------------
    def outside_guard(self, op: Op) -> bool:
        return self.guarded_only and not op.attrs.get(FP16_GUARD)

    def target_dtype(self, op: Op) -> str:
        names = set(op.inputs) | set(op.defined)
        if names & self.black_vars or self.outside_guard(op):
            return FLOAT32
        kind = self.lists.classify(op.type)
        if kind == "white":
            return self.low
        if kind == "black":
            return FLOAT32
        if kind == "mixed":  # aten takes a low-precision activation only with all-float32 parameters and statistics
            acts = [n for n in _activation_inputs(op) if self.castable(n)]
            others = [n for n in op.inputs if self.castable(n) and n not in acts]
            return self.low if acts and all(self.program.var(n).dtype == self.low for n in acts) and all(
                self.program.var(n).dtype == FLOAT32 for n in others) else FLOAT32
        floats = [n for n in op.inputs if self.castable(n)]
        if floats and all(self.program.var(n).dtype == self.low for n in floats):
            return self.low
        # `t(w)` read only by matmuls: transpose the cast of `w`, so forward and backward share one cast.
        return self.low if floats and self.is_view(op) and self.runs_low(op) else FLOAT32

    @staticmethod
    def is_view(op: Op) -> bool:
        return any(aliased_input(op, i) is not None for i in range(len(op.outputs)))

    def runs_low(self, op: Op) -> bool:
        """Whether `op` runs in low precision whatever its inputs: a white op, or a view only such ops read."""
        if (not op.type.startswith("aten.") or (set(op.inputs) | set(op.defined)) & self.black_vars
                or self.outside_guard(op)):
            return False
        if self.lists.classify(op.type) == "white":
            return True
        fetched = set(self.program.fetches.values())
        return self.is_view(op) and all(
            name not in fetched and self.readers.get(name) and all(self.runs_low(r) for r in self.readers[name])
            for name in op.defined)

    def plan(self, op: Op) -> tuple[str, dict[str, str], tuple, dict, list]:
        """Target dtype, input casts, args, kwargs and output dtypes for an aten op; float32 when low precision fails."""
        for target in dict.fromkeys([self.target_dtype(op), FLOAT32]):
            casts = {n: target for n in op.inputs if self.castable(n) and self.program.var(n).dtype != target}
            if target == self.low and self.lists.classify(op.type) == "mixed":  # parameters and statistics as they are
                casts = {n: target for n in _activation_inputs(op) if n in casts}
            args, kwargs = self._with_input_dtype(op, target), dict(op.kwargs)
            if target == FLOAT32 and casts and self._accumulates_in(op, kwargs):
                # A reduction with a dtype argument reads low precision and accumulates in float32: no cast.
                kwargs["dtype"], casts = torch.float32, {}
            results = self.infer(op, casts, args, kwargs)
            if results is not None:
                return target, casts, args, kwargs, results
        raise PassError(f"op {op.name!r} ({op.type}) accepts neither low-precision nor float32 inputs")

    @staticmethod
    def _with_input_dtype(op: Op, target: str) -> tuple:
        """Backward ops such as `_softmax_backward_data` name their forward input's dtype: now `target`."""
        schema = resolve_callable(op.type)._schema
        return tuple(getattr(torch, target) if arg.name == "input_dtype" and isinstance(value, torch.dtype) else value
                     for arg, value in zip(schema.arguments, op.args))

    @staticmethod
    def _accumulates_in(op: Op, kwargs: dict) -> bool:
        schema = resolve_callable(op.type)._schema
        return op.type.split(".")[1] in ("sum", "mean") and kwargs.get("dtype") is None and any(
            a.name == "dtype" and a.kwarg_only for a in schema.arguments)

    def rewrite(self, op: Op) -> None:
        if not op.type.startswith("aten.") or OpRole.OPTIMIZE in op.role:  # updates run in their captured dtypes
            op.rename_inputs({n: self.restore_dtype(n, op) for n in op.inputs if self.castable(n)})
            self.append(op)
            return
        changed = any(self.program.var(n).dtype != self.captured.get(n) for n in op.inputs)
        target, casts, args, kwargs, results = self.plan(op)
        if casts or changed or kwargs != op.kwargs or args != op.args:
            if kwargs.get("dtype") is torch.float32 and op.kwargs.get("dtype") is None:
                self.report.count("reductions_accumulating_in_float32")
            op.args, op.kwargs = args, kwargs
            op.rename_inputs({n: self.cast(n, dtype, op) for n, dtype in casts.items()})
            for name, dtype in zip(op.outputs, results):
                if name is not None and dtype is not None:
                    self.program.var(name).dtype = str(dtype).removeprefix("torch.")
        if target == self.low:
            self.report.count(f"ops_in_{self.low}")
        self.append(op)
        self.track_black_views(op)

    def track_black_views(self, op: Op) -> None:
        """A view of a black-listed Var (`t(w)`, `w.view(...)`) is the same value, so it is black too."""
        for i, name in enumerate(op.outputs):
            if name is not None and aliased_input(op, i) in self.black_vars:
                self.black_vars.add(name)

    def run(self) -> None:
        for op in self.block.ops:
            if op.sub_block is not None:
                raise PassError(f"amp runs before passes that create sub-blocks, but op {op.name!r} owns one")
            self.rewrite(op)
        for key, name in self.program.fetches.items():
            if self.castable(name) and self.program.var(name).dtype != self.original[name]:
                self.program.fetches[key] = self.restore_dtype(name, self.last_op())
        self.block.ops = self.placed()

    def last_op(self) -> Op:
        """The last op of `placed()`: the last op built, or the oldest cast placed after it."""
        return (self.after.get(self.ops[-1].name) or self.ops)[-1]


def _activation_inputs(op: Op) -> list[str]:
    """The Vars a mixed op (batch norm) reads as activations, `input` and `grad_out`: the ones that follow the
    low-precision dtype, and that aten requires to share one dtype."""
    schema = resolve_callable(op.type)._schema
    return [value.name for arg, value in zip(schema.arguments, op.args)
            if arg.name in ("input", "grad_out") and isinstance(value, Ref)]


class AutoMixedPrecision:
    name = "amp"
    enabled_by = 'amp'
    summary = "cast matmul/conv to bf16/fp16 and softmax/norms/losses/reductions to float32; dynamic loss scaling"
    reads = ("amp", "amp_configs")

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        cfg = config.amp_configs
        report = PassReport(self.name)
        lists = AmpLists.from_config(cfg.custom_white_list, cfg.custom_black_list)
        params = [v for v in program.all_vars() if v.kind is VarKind.PARAM]
        low = low_precision_dtype(cfg.dtype, params[0].device if params else "cpu")
        black_vars = set(cfg.custom_black_varnames)
        missing = sorted(n for n in black_vars if program.find_var(n) is None)
        if missing:
            report.notes.append(f"amp_configs.custom_black_varnames: no Var named {missing} in this Program")
        # A black Var's gradient is computed by its forward op's backward: that stays float32 too, as in Paddle.
        black_vars |= {grad_name(name) for name in black_vars if program.find_var(grad_name(name)) is not None}
        guarded_only = cfg.use_pure_fp16 and cfg.use_fp16_guard
        guarded = [op for op in program.global_block.ops if op.attrs.get(FP16_GUARD)]
        if not cfg.use_pure_fp16 and ("amp_configs.use_fp16_guard" in config.explicit_fields or guarded):
            report.notes.append("amp_configs.use_fp16_guard and fleetc.fp16_guard regions: not applicable without "
                                "use_pure_fp16; ops are cast by the white and black lists (O1)")
        if guarded_only and not guarded:
            report.skipped_reason = ("use_pure_fp16 with amp_configs.use_fp16_guard=True, but the model has no "
                                     "fleetc.fp16_guard region: nothing was cast, the step runs in float32 (set "
                                     "use_fp16_guard=False to cast the whole model)")
            return program, report
        low_params = {v.name for v in params if v.dtype == FLOAT32 and v.name not in black_vars} \
            if cfg.use_pure_fp16 else set()
        if guarded_only:
            low_params = _read_only_inside_guards(program, low_params)
            report.notes.append(f"use_fp16_guard: only the {len(guarded)} ops inside fleetc.fp16_guard regions run in "
                                f"{low}; {len(low_params)} parameters only they read are kept in {low}")
        rewriter = _CastRewriter(program, lists, low, black_vars, report, low_params, guarded_only)
        rewriter.run()
        report.reused_blocks += rewriter.memo.lines()
        report.notes.append(f"low precision: {low}")
        keep_master_weights(program, low_params, report)
        insert_loss_scaling(program, cfg, report)
        report.changed = bool(report.stats)
        if not report.changed:
            report.skipped_reason = "no op in the Program is on the white list or follows a white-listed op"
        return program, report


def _read_only_inside_guards(program: Program, params: set[str]) -> set[str]:
    """The parameters of `params` that only ops inside fp16_guard regions read (optimizer updates aside)."""
    inside: dict[str, bool] = {}
    for op in program.global_block.ops:
        if OpRole.OPTIMIZE in op.role:
            continue
        for name in params.intersection(op.inputs):
            inside[name] = inside.get(name, True) and bool(op.attrs.get(FP16_GUARD))
    return {name for name, only_inside in inside.items() if only_inside}
