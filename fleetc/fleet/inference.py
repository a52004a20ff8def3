"""Saving the trained model for deployment as a torch.export artifact, and loading it back.

`save_inference_model` exports the trainer's eval Program: fleetc's ops lowered to aten, pruned to the targets,
with the trained weights. The directory holds `model.pt2` (float32), under `use_pure_fp16` also
`model.<dtype>.pt2` (the training dtype), and `meta.json`; any PyTorch process loads the `.pt2` files with
`torch.export.load`, no fleetc needed.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import secrets
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec

from fleetc.compiler import CompiledTrainer
from fleetc.errors import ExportError
from fleetc.fleet.export_sources import (
    as_names,
    check_feed_names,
    eval_program,
    eval_trainer,
    example_inputs_like_training,
    full_weights,
    fusion_pass_names,
)
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Program, VarKind
from fleetc.passes.base import PassReport
from fleetc.passes.export import LowerToAten, PruneToTargets
from fleetc.passes.export.prune import WHOLE_OUTPUT, resolve_targets
from fleetc.passes.instruments import VerifyInstrument
from fleetc.passes.manager import History, PassManager, PassRecord
from fleetc.runtime.export import ExportedModel, export_program
from fleetc.strategy.names import closest

MODEL_FILE = "model.pt2"
META_FILE = "meta.json"
FORMAT = "fleetc-inference"
FORMAT_VERSION = 1
FLOAT32 = "float32"


@dataclass
class Artifact:
    """One exported precision: its file, the export passes' history (eval Program first) and the exported model."""

    dtype: str
    file: str
    history: History
    model: ExportedModel

    @property
    def program(self) -> Program:
        """The Program that was exported: lowered to aten and pruned."""
        return self.history[-1].program


@dataclass
class InferenceExport:
    """What `save_inference_model` wrote into `dirname`: one artifact per precision, and meta.json's content."""

    dirname: str
    artifacts: list[Artifact]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def target_names(self) -> list[str]:
        """The fetched names, in output order (what Paddle's save_inference_model returns)."""
        return list(self.artifacts[0].program.fetches)


def _training_dtype(program: Program) -> str | None:
    """The low-precision dtype of a pure-fp16 eval Program's parameters."""
    dtypes = [v.dtype for v in program.persistables() if v.kind is VarKind.PARAM and v.dtype != FLOAT32]
    return max(set(dtypes), key=dtypes.count) if dtypes else None


def export_passes(program: Program, config: Any, fetches: dict[str, str], feeds: list[str],
                  prune: bool) -> History:
    """The eval Program, then after lowering to aten and pruning to `fetches`, each verified."""
    history = History([PassRecord("eval", program, PassReport("eval", stats={"ops": program.num_ops()}), 0.0,
                                  estimate_memory(program))])
    manager = PassManager([LowerToAten(), PruneToTargets(fetches, feeds, prune)], [VerifyInstrument()])
    manager.run(program, config, history)
    return history


def _export_artifact(program: Program, state: Mapping[str, torch.Tensor], out_spec: TreeSpec | None, *,
                     config: Any, feeds: list[str], targets: list[str], prune: bool, dtype: str,
                     dynamic_batch: bool) -> Artifact:
    missing = [name for name in feeds if name not in program.feeds]
    if missing:
        hint = closest(missing[0], program.feeds)
        raise ExportError(f"feeded_var_names: {missing[0]!r} is not an input of the eval Program"
                          + (f"; did you mean {hint!r}?" if hint else "") + f" (inputs: {', '.join(program.feeds)})")
    fetches = resolve_targets(program, targets)
    history = export_passes(program, config, fetches, feeds, prune)
    final = history[-1].program
    if final.feeds != feeds:
        raise ExportError(f"target_vars {targets} need the input {final.feeds[len(feeds)]!r}, which is not in "
                          f"feeded_var_names {feeds}")
    whole = targets == [WHOLE_OUTPUT] and out_spec is not None
    exported = export_program(final, state, out_spec=out_spec if whole else None, dynamic_batch=dynamic_batch)
    file = MODEL_FILE if dtype == FLOAT32 else f"model.{dtype}.pt2"
    return Artifact(dtype, file, history, exported)


def _value_meta(program: Program, name: str, dynamic: Mapping[int, str]) -> dict[str, Any]:
    var = program.var(name)
    # A dynamic Program's symbolic dims the export did not make dynamic are written by name (`"batch"`).
    shape = [dynamic.get(i, d if isinstance(d, int) else str(d)) for i, d in enumerate(var.shape)] \
        if var.shape is not None else None
    return {"shape": shape, "dtype": var.dtype}


def _meta(trainer: CompiledTrainer, artifacts: list[Artifact], prune: bool, notes: list[str],
          fusion_skipped: list[str]) -> dict[str, Any]:
    main = artifacts[0]
    program, dynamic = main.program, main.model.dynamic_dims
    inputs = [{"name": name, **_value_meta(program, name, dynamic.get(name, {})),
               "dynamic_dims": {str(i): d for i, d in dynamic.get(name, {}).items()}} for name in program.feeds]
    outputs = [{"name": key, "value": var, **_value_meta(program, var, {})} for key, var in program.fetches.items()]
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "fleetc_version": importlib.metadata.version("fleetc"), "torch_version": torch.__version__,
        "files": {a.dtype: a.file for a in artifacts},
        "inputs": inputs, "outputs": outputs, "pruned": prune,
        "ops": {"eval_program": main.history[0].program.num_ops(), "exported": program.num_ops()},
        "fusion_passes_skipped": fusion_skipped,
        "strategy": trainer.config.to_dict(),
        "notes": notes + [note for a in artifacts for note in a.model.notes],
    }


def check_writable(dirname: str) -> None:
    """Fail before exporting when `dirname` cannot be created or replaced."""
    parent = os.path.dirname(os.path.abspath(dirname)) or "."
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"cannot write the inference model to {dirname!r}: {exc}") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write the inference model to {dirname!r}: {parent!r} is not writable")
    if os.path.exists(dirname) and not os.path.isdir(dirname):
        raise ExportError(f"cannot write the inference model to {dirname!r}: it exists and is not a directory")
    if os.path.isdir(dirname) and os.listdir(dirname) and not os.path.isfile(os.path.join(dirname, META_FILE)):
        # the write replaces the whole directory: never one holding someone else's files
        raise ExportError(f"will not replace {dirname!r}: it holds files and is not a fleetc inference model "
                          "(no meta.json); choose a new or empty directory")


def write_directory(dirname: str, writers: Mapping[str, Callable[[str], None]]) -> None:
    """Write every file into a temporary directory beside `dirname`, then rename it into place, so readers see the
    old directory or the complete new one. (Not the checkpoints' versioned commit: an export is a plain directory
    that readers without fleetc open directly.)"""
    target = os.path.abspath(dirname)
    parent = os.path.dirname(target)
    temporary = os.path.join(parent, f".{os.path.basename(target)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(temporary)
        for name, write in writers.items():
            write(os.path.join(temporary, name))
        previous = None
        if os.path.exists(target):
            previous = temporary + ".old"
            os.replace(target, previous)
        os.replace(temporary, target)
        if previous is not None:
            shutil.rmtree(previous)
    except OSError as exc:
        shutil.rmtree(temporary, ignore_errors=True)
        raise ExportError(f"cannot write the inference model to {dirname!r}: {exc}") from None
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _trained_artifacts(trainer: CompiledTrainer, state: dict[str, torch.Tensor], example: dict[str, torch.Tensor],
                       targets: list[str], options: dict[str, Any]) -> tuple[list[Artifact], list[str]]:
    """The float32 artifact (and under pure fp16 the training-dtype one) from the trainer's eval Program; and the
    fusion passes left out of it."""
    # A fused op carries its first op's module path, so it would hide a module's own output (a Linear's, before
    # the activation fused into it): with a module target the exported Program is compiled without fusion.
    unfused = any(target in dict(trainer.model.named_modules()) for target in targets if target)
    exporter, exporter_state = eval_trainer(trainer, state, float32=True, unfused=unfused)
    program, spec = eval_program(exporter, example)
    artifacts = [_export_artifact(program, exporter_state, spec, dtype=FLOAT32, **options)]
    if trainer.config.amp and trainer.config.amp_configs.use_pure_fp16:
        exporter, exporter_state = eval_trainer(trainer, state, float32=False, unfused=unfused)
        program, spec = eval_program(exporter, example)
        dtype = _training_dtype(program) or FLOAT32
        artifacts.append(_export_artifact(program, exporter_state, spec, dtype=dtype, **options))
    return artifacts, fusion_pass_names(trainer.config) if unfused else []


def save_inference_model(trainer: CompiledTrainer, dirname: str, feeded_var_names: str | Sequence[str],
                         target_vars: str | Sequence[str] | None = None, main_program: Program | None = None,
                         export_for_deployment: bool = True, *, inputs: Mapping[str, torch.Tensor] | None = None,
                         dynamic_batch: bool = True) -> InferenceExport:
    """Export `trainer`'s model for inference into `dirname` (one process; `fleet.save_inference_model` picks the
    rank). `inputs` gives example inputs by name (default: zeros shaped like the last step's)."""
    feeds = as_names(feeded_var_names, "feeded_var_names")
    targets = as_names(target_vars if target_vars is not None else WHOLE_OUTPUT, "target_vars")
    check_feed_names(trainer.model, feeds)
    check_writable(dirname)
    notes: list[str] = []
    state = full_weights(trainer, notes)
    options = dict(config=trainer.config, feeds=feeds, targets=targets, prune=export_for_deployment,
                   dynamic_batch=dynamic_batch)
    if main_program is not None:
        if main_program.metadata.get("kind") != "eval":
            raise ExportError("main_program must be an eval Program (trainer.eval_program), not a "
                              f"{main_program.metadata.get('kind', 'unknown')} Program")
        artifacts, skipped = [_export_artifact(main_program, state, None, dtype=FLOAT32, **options)], []
    else:
        example = dict(inputs) if inputs is not None else example_inputs_like_training(trainer, feeds)
        artifacts, skipped = _trained_artifacts(trainer, state, example, targets, options)
    meta = _meta(trainer, artifacts, export_for_deployment, notes, skipped)
    for note in meta["notes"]:
        warnings.warn(f"save_inference_model: {note}", stacklevel=3)
    meta_text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
    writers: dict[str, Callable[[str], None]] = {
        a.file: (lambda path, a=a: torch.export.save(a.model.exported, path)) for a in artifacts}
    writers[META_FILE] = lambda path: _write_text(path, meta_text)
    write_directory(dirname, writers)
    return InferenceExport(dirname, artifacts, meta)


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def read_meta(dirname: str) -> dict[str, Any]:
    """meta.json of an inference directory, checked to be one fleetc wrote."""
    path = os.path.join(dirname, META_FILE)
    try:
        with open(path, encoding="utf-8") as handle:
            meta = json.load(handle)
    except FileNotFoundError:
        raise ExportError(f"{dirname!r} is not a fleetc inference model: it has no {META_FILE}") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read {path!r}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ExportError(f"{path!r} was not written by fleetc.save_inference_model")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{path!r} has format version {meta.get('format_version')!r}; this fleetc reads "
                          f"version {FORMAT_VERSION}")
    return meta


def load_inference_model(dirname: str, dtype: str = FLOAT32) -> nn.Module:
    """The exported model in `dirname` as a callable module (`torch.export.load(...).module()`), in `dtype`."""
    files = read_meta(dirname)["files"]
    if dtype not in files:
        raise ExportError(f"{dirname!r} holds no {dtype} model (precisions: {', '.join(files)})")
    return torch.export.load(os.path.join(dirname, files[dtype])).module()
