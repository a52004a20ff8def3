"""fleetc's persistent compile cache: pass results by captured Program, and (opt-in) captures by model code.

Modes (`fleetc.compile(..., compile_cache=...)`, default `$FLEETC_COMPILE_CACHE`, else "off"):
- "passes": the pass pipeline's result is stored under a hash of the captured Program's JSON, the strategy, the
  pass options (disabled passes, recompute policy, gradient clip) and fleetc's, torch's and Python's versions
  (fleetc's includes a hash of its source). Capture always runs, so this can never give a stale result.
- "capture": also skips capture. The key hashes the model's code (the methods its modules' classes define and the
  functions and constants they reach), every module's plain attributes, the loss function, hooks and optimizer
  (class and settings), the input signature and the strategy; a hit must also match the guard record observed
  now (module classes, parameter names, shapes, dtypes and requires_grad, param groups, hooks, inputs) and the
  live value of every module attribute the captured step read. Static captures only.
Codegen is not cached: the generated Python is rebuilt from the Program, since nothing read from disk may run.
A capture hit decodes the captured Program's metadata only; its ops are decoded when first used (deferred.py).
Entries are JSON read by restricted decoders (store.py); each compile's outcome is a line in `report().cache`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, treespec_dumps, treespec_loads

from fleetc.capture.dynamic import DynamicDims
from fleetc.capture.hooks import hook_dicts
from fleetc.compile_cache.deferred import CompileCacheError, DeferredProgram
from fleetc.compile_cache.fingerprint import (
    code_fingerprint,
    config_fingerprint,
    digest,
    environment_fingerprint,
)
from fleetc.compile_cache.store import CompileCacheWarning, EntryStore
from fleetc.ir.liveness import MemoryEstimate
from fleetc.ir.program import Program
from fleetc.ir.serialize import program_from_json, program_to_json
from fleetc.passes.base import PassReport
from fleetc.passes.manager import History, PassRecord
from fleetc.report import CompileReport
from fleetc.runtime.guards import GuardRecord, input_key, observe_guards

MODES = ("off", "passes", "capture")
ENV_MODE = "FLEETC_COMPILE_CACHE"
CACHE_RECORD = "compile_cache"  # the history record that stands for the passes a hit skipped
_REPORT_FIELDS = ("applied", "skipped", "stats", "notes", "memory", "ops_after", "repeated_blocks")

__all__ = ["MODES", "CompileCache", "CompileCacheError", "CompileCacheWarning", "resolve_cache_mode"]


def resolve_cache_mode(mode: str | None) -> str:
    """The mode asked for, else $FLEETC_COMPILE_CACHE, else "off"; ValueError for an unknown one."""
    chosen = mode if mode is not None else os.environ.get(ENV_MODE, "off")
    if chosen not in MODES:
        source = "compile_cache" if mode is not None else f"${ENV_MODE}"
        raise ValueError(f"{source} must be one of {', '.join(MODES)}, not {chosen!r}")
    return chosen


def _short(key: str) -> str:
    return key[:12]


def _pass_options_fingerprint(config: Any, disable_passes: Iterable[str], recompute_policy: Any,
                              grad_clip: Any) -> str:
    policy = "default" if recompute_policy is None else digest(
        code_fingerprint([recompute_policy]), repr(sorted((k, repr(v)) for k, v in vars(recompute_policy).items())))
    return digest(repr(sorted(config.to_dict().items())), repr(sorted(disable_passes)), policy, repr(grad_clip))


def _optimizer_fingerprint(optimizer: torch.optim.Optimizer | None) -> str:
    if optimizer is None:
        return "none"
    groups = [(len(g["params"]), sorted((k, repr(v)) for k, v in g.items() if k != "params"))
              for g in optimizer.param_groups]
    return digest(code_fingerprint([type(optimizer)]), repr(groups), str(len(optimizer.state)))


def _reads_failure(model: nn.Module, program: Program) -> str | None:
    """The first module attribute the captured step read whose live value differs now, in words."""
    modules = dict(model.named_modules())
    for path, name, value in program.metadata.get("attribute_reads", ()):
        module = modules.get(path)
        now = vars(module).get(name) if module is not None else None
        if module is None or type(now) is not type(value) or now != value:
            return f"attribute {path or 'model'}.{name} was {value!r} when captured, now {now!r}"
    return None


def _text(payload: dict[str, Any]) -> str:
    """The Program text of an entry: JSON text inside the JSON entry, so the key can hash that very text."""
    text = payload["program_json"]
    if not isinstance(text, str):
        raise TypeError(f"program_json is a {type(text).__name__}, not JSON text")
    return text


def _memory_data(estimate: MemoryEstimate) -> dict[str, Any]:
    return dataclasses.asdict(estimate)


def _memory(data: dict[str, Any]) -> MemoryEstimate:
    return MemoryEstimate(**{**data, "live_after_op": [tuple(pair) for pair in data["live_after_op"]]})


@dataclass
class CachedPasses:
    """A pass pipeline's result read from the cache: the final Program, what the report said about it, and the
    memory estimates of the captured and the final Program (each a sweep over the Program, so stored too)."""

    program: Program
    report: dict[str, Any]
    captured_memory: MemoryEstimate
    final_memory: MemoryEstimate

    def result(self, captured: Program, capture_seconds: float, decisions: list[str],
               line: str) -> tuple[Program, History, CompileReport]:
        """(final Program, history, report) as `_optimize` returns them; the history's second record stands for
        the passes the hit skipped."""
        history = History([PassRecord("capture", captured, PassReport("capture", changed=True,
                                                                      stats={"ops": captured.num_ops()}),
                                      capture_seconds, self.captured_memory)])
        loaded = PassReport(CACHE_RECORD, changed=True, stats={"ops": self.program.num_ops()}, notes=[line])
        history.append(PassRecord(CACHE_RECORD, self.program, loaded, 0.0, self.final_memory))
        report = CompileReport(decisions=list(decisions), ops_before=captured.num_ops(),
                               **{name: self.report[name] for name in _REPORT_FIELDS})
        return self.program, history, report


class CompileCache:
    """One trainer's view of the on-disk compile cache; `lines` says what the latest compile found."""

    def __init__(self, mode: str | None = None, store: EntryStore | None = None):
        self.mode = resolve_cache_mode(mode)
        self.store = store if store is not None or self.mode == "off" else EntryStore()
        self.lines: list[str] = []
        self._text: tuple[Program, str] | None = None  # the latest captured Program and its JSON text
        self._hit: tuple[str, Program] | None = None  # this compile's capture hit: (key, its DeferredProgram)

    def begin(self) -> None:
        """A new compile: forget what the previous one found."""
        self.lines = []
        self._text = None
        self._hit = None

    # ----- pass results ----------------------------------------------------------------------
    def passes_key(self, program: Program, config: Any, disable_passes: Iterable[str], recompute_policy: Any,
                   grad_clip: Any) -> str | None:
        """The key of the pass pipeline's result for `program`; None when off or the Program has no JSON form."""
        if self.mode == "off":
            return None
        try:
            program_text = self._program_text(program)
        except (TypeError, ValueError) as exc:
            self.lines.append(f"passes: not cacheable ({exc})")
            return None
        return digest("passes", environment_fingerprint(), program_text,
                      _pass_options_fingerprint(config, disable_passes, recompute_policy, grad_clip))

    def load_passes(self, key: str | None) -> CachedPasses | None:
        if key is None:
            return None
        payload = self.store.load("passes", key)
        cached = None
        if payload is not None:
            try:
                cached = CachedPasses(program_from_json(_text(payload)), payload["report"],
                                      _memory(payload["memory"]["captured"]), _memory(payload["memory"]["final"]))
                if set(_REPORT_FIELDS) - set(cached.report):
                    raise KeyError(f"report fields {sorted(set(_REPORT_FIELDS) - set(cached.report))}")
            except (KeyError, TypeError, ValueError) as exc:
                self._ignore("passes", key, f"does not decode ({type(exc).__name__}: {exc})")
                cached = None
        self.lines.append(f"passes: {'hit, passes skipped' if cached else 'miss'} (key {_short(key)})")
        return cached

    def store_passes(self, key: str | None, history: History, report: CompileReport) -> None:
        """Store the final Program of `history` with `report`'s pass fields and both memory estimates."""
        if key is None:
            return
        try:
            payload = {"program_json": program_to_json(history[-1].program),
                       "report": {name: getattr(report, name) for name in _REPORT_FIELDS},
                       "memory": {"captured": _memory_data(history[0].memory),
                                  "final": _memory_data(history[-1].memory)}}
            written = self.store.store("passes", key, json.loads(json.dumps(payload, allow_nan=False)))
        except (TypeError, ValueError) as exc:
            self.lines[-1] += f", not stored ({exc})"
            return
        self.lines[-1] += ", stored" if written else ", not stored (another process is writing it)"

    # ----- captures --------------------------------------------------------------------------
    def capture_key(self, kind: str, model: nn.Module, loss_fn: Any, optimizer: torch.optim.Optimizer | None,
                    config: Any, args: tuple, kwargs: dict, dynamic: DynamicDims) -> str | None:
        """The key of a capture (None unless mode "capture" and the capture is static)."""
        if self.mode != "capture":
            return None
        if dynamic:
            self.lines.append("capture: not cached (symbolic dims)")
            return None
        leaves, spec = tree_flatten((args, kwargs))
        hooks = [hook for _, hooks in hook_dicts(model, optimizer if kind == "train" else None) if hooks
                 for hook in hooks.values()]
        code = code_fingerprint([*(type(m) for m in model.modules()), *([loss_fn] if loss_fn else []), *hooks])
        return digest("capture", kind, environment_fingerprint(), code, config_fingerprint(model),
                      _optimizer_fingerprint(optimizer if kind == "train" else None),
                      repr(sorted(config.to_dict().items())), repr(input_key(leaves, spec)))

    def load_capture(self, key: str | None, kind: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     args: tuple, kwargs: dict) -> tuple[Program, TreeSpec | None] | None:
        """The stored capture for `key` when its guard record still describes the live model, else None."""
        if key is None:
            return None
        payload = self.store.load("capture", key)
        found, why = None, ""
        if payload is not None:
            try:
                program = DeferredProgram(_text(payload), payload["ops"], f"compile cache entry capture-{key}.json")
                self._text = (program, payload["program_json"])
                record = GuardRecord.from_data(payload["guards"])
                out_spec = None if payload["out_spec"] is None else treespec_loads(payload["out_spec"])
            except (KeyError, TypeError, ValueError) as exc:
                self._ignore("capture", key, f"does not decode ({type(exc).__name__}: {exc})")
            else:
                why = self._guard_mismatch(record, kind, model, optimizer, args, kwargs, program)
                found = None if why else (program, out_spec)
                self._hit = None if why else (key, program)
        outcome = "hit, capture skipped" if found else f"miss{f': {why}' if why else ''}"
        self.lines.append(f"capture: {outcome} (key {_short(key)})")
        return found

    def capture_again(self, program: Program, error: CompileCacheError) -> str | None:
        """After `error` from first using `program`: when `program` is this compile's capture hit (its entry's ops
        did not decode, or disagree with its stated op count or metadata), warn naming the entry file and forget the
        hit, and return its key: the compile captures again and stores a good entry there. None for any other
        Program (the error is not this compile's to answer)."""
        if self._hit is None or self._hit[1] is not program:
            return None
        key = self._hit[0]
        self._ignore("capture", key, error.reason)
        self.lines = [f"capture: miss: the entry's Program is damaged, captured again (key {_short(key)})"]
        self._text = self._hit = None
        return key

    def rebuild_when_damaged(self, program: Program, capture: Callable[[], Program]) -> None:
        """After a compile that used `program`, this compile's capture hit, without decoding its ops (a full hit):
        should their first use find them damaged, warn naming the entry file, delete it (the next compile captures
        and stores a good one) and use `capture()`'s Program, the model captured again on this compile's inputs.
        Nothing read from the entry runs either way."""
        if self._hit is None or self._hit[1] is not program or not isinstance(program, DeferredProgram):
            return
        key = self._hit[0]

        def rebuilt(error: CompileCacheError) -> Program:
            self._ignore("capture", key, f"{error.reason}; its Program is captured again")
            self.store.path("capture", key).unlink(missing_ok=True)
            return capture()

        program.rebuild = rebuilt

    @staticmethod
    def _guard_mismatch(record: GuardRecord, kind: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                        args: tuple, kwargs: dict, program: Program) -> str:
        now = observe_guards(kind, model, optimizer, args, kwargs, program)
        if now != record:
            changed = [g for g in record.guards if g not in now.guards] + [g for g in now.guards
                                                                           if g not in record.guards]
            return f"{changed[0].kind} guard on {changed[0].target} changed" if changed else "guard order changed"
        return _reads_failure(model, program) or ""

    def store_capture(self, key: str | None, kind: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                      args: tuple, kwargs: dict, program: Program, out_spec: TreeSpec | None) -> None:
        if key is None:
            return
        try:
            record = observe_guards(kind, model, optimizer, args, kwargs, program)
            payload = {"program_json": self._program_text(program), "ops": program.num_ops(),
                       "guards": record.to_data(),
                       "out_spec": None if out_spec is None else treespec_dumps(out_spec)}
            written = self.store.store("capture", key, json.loads(json.dumps(payload, allow_nan=False)))
        except (TypeError, ValueError) as exc:
            self.lines[-1] += f", not stored ({exc})"
            return
        self.lines[-1] += ", stored" if written else ", not stored (another process is writing it)"

    def _program_text(self, program: Program) -> str:
        """`program`'s JSON text: the one a capture hit decoded it from, or the one its capture stored, else new.
        Either way the text of exactly this Program, so keys hash what is used, at one encoding per compile."""
        if self._text is None or self._text[0] is not program:
            self._text = (program, program_to_json(program))
        return self._text[1]

    def _ignore(self, kind: str, key: str, reason: str) -> None:
        """Warn that the entry of (kind, key) is ignored because it `reason` ("does not decode (...)")."""
        warnings.warn(f"fleetc compile cache: ignoring entry {self.store.path(kind, key)}, which {reason}",
                      CompileCacheWarning, stacklevel=3)
