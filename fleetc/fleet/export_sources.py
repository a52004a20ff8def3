"""Where an inference export starts: checked input names, example inputs, the trainer whose eval Program is exported
(the trainer itself, or one compiling it without AMP or fusion), and the complete trained weights."""
from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten

from fleetc.comm.env import world_size
from fleetc.compiler import CompiledTrainer
from fleetc.errors import ExportError
from fleetc.ir.program import Program
from fleetc.passes.order import ordered_passes
from fleetc.runtime.export import example_inputs
from fleetc.strategy.names import closest


def as_names(value: str | Sequence[str] | None, what: str) -> list[str]:
    found = [value] if isinstance(value, str) else list(value or [])
    if not found or any(not isinstance(n, str) for n in found):
        raise ExportError(f"{what} must be a name or a list of names (strings), got {value!r}")
    return found


def check_feed_names(model: nn.Module, feeds: Sequence[str]) -> None:
    """Every feed names an argument of `model.forward`."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        return
    for name in feeds:
        if name not in params:
            hint = closest(name, params)
            raise ExportError(f"feeded_var_names: {name!r} is not an argument of {type(model).__name__}.forward"
                              + (f"; did you mean {hint!r}?" if hint else "") + f" (arguments: {', '.join(params)})")


def named_inputs(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`model(*args, **kwargs)`'s arguments by `forward` argument name."""
    params = [p.name for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(params):
        raise ExportError(f"{type(model).__name__}.forward takes {len(params)} named positional arguments, but "
                          f"{len(args)} example inputs were given; export feeds inputs by argument name")
    return {**dict(zip(params, args)), **kwargs}


def example_inputs_like_training(trainer: CompiledTrainer, feeds: list[str]) -> dict[str, torch.Tensor]:
    """Zero tensors for `feeds`, shaped like the inputs of the last eval (else training) step."""
    programs = []
    for latest in ("eval_program", "program"):
        try:
            programs.append(getattr(trainer, latest))
        except RuntimeError:  # nothing compiled of that kind yet
            pass
    if not programs:
        raise ExportError("nothing compiled yet: train a step (or call the trainer on inputs) before exporting, "
                          "so fleetc knows the inputs' shapes and dtypes")
    inputs = {}
    for name in feeds:
        program = next((p for p in programs if name in p.feeds), None)
        if program is None:
            known = list(dict.fromkeys(n for p in programs for n in p.feeds))
            raise ExportError(f"feeded_var_names: {name!r} was never fed to the model, so its shape is unknown "
                              f"(inputs seen: {', '.join(known)}); call the trainer with it once")
        inputs.update(example_inputs(program, [name]))
    return inputs


def eval_program(trainer: CompiledTrainer, inputs: Mapping[str, torch.Tensor]) -> tuple[Program, TreeSpec]:
    """The trainer's eval Program for exactly these inputs (compiled once, then cached), and its output spec."""
    out = trainer(**inputs)
    return trainer.eval_program, tree_flatten(out)[1]


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by the names the Program uses (the first name of a tied weight)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def full_weights(trainer: CompiledTrainer, notes: list[str]) -> dict[str, torch.Tensor]:
    """The complete trained weights. Under sharding stage 3 the caller has gathered them (fleet.save_inference_model
    does, on every rank); pipeline parallelism across processes is where gathering the stages' parts will go, and
    until then such an export is refused."""
    config = trainer.config
    if config.sharding and config.sharding_configs.stage >= 3:
        held = getattr(trainer, "_sharded_params", None)  # this rank's part of each parameter (a flat piece, say)
        shapes = held.shapes if held is not None else {}
        if any(p.numel() == 0 or p.shape != shapes.get(name, p.shape) for name, p in trainer.model.named_parameters()):
            raise ExportError("save_inference_model under sharding stage 3: this rank holds only its part of the "
                              "parameters; call fleet.save_inference_model on every rank (it gathers them), or export "
                              "inside `with trainer.whole_parameters():` entered on every rank")
        notes.append("sharding stage 3: the weights were whole for the export (gathered from their owners across "
                     "processes; in one process nothing is sharded)")
    if config.pipeline and world_size() > 1:  # a pipeline run in one process updates the whole model
        raise ExportError("save_inference_model under pipeline with one process per stage: each rank holds part of "
                          "the weights, and gathering them for export is not implemented yet")
    return model_state(trainer.model)


def float32_model(trainer: CompiledTrainer) -> nn.Module:
    """The trainer's model with float32 weights: itself, or (pure fp16) a copy holding the master weights."""
    model = trainer.model
    if all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point()):
        return model
    state = trainer.optimizer.state if trainer.optimizer is not None else {}
    masters = {name: state[p]["master_weight"] for name, p in model.named_parameters()
               if "master_weight" in state.get(p, {})}
    model = copy.deepcopy(model)
    for name, param in model.named_parameters():
        param.data = masters[name].detach().clone() if name in masters else param.data.float()
    return model


def fusion_pass_names(config: Any) -> list[str]:
    """The fusion passes `config` runs: a fused op's module path is its first op's, so it hides module outputs."""
    return [p.name for p in ordered_passes(config) if type(p).__module__.startswith("fleetc.passes.fusion.")]


def eval_trainer(trainer: CompiledTrainer, state: dict[str, torch.Tensor], *, float32: bool,
                  unfused: bool) -> tuple[CompiledTrainer, dict[str, torch.Tensor]]:
    """The trainer whose eval Program is exported, and its weights: `trainer` itself, or one compiling the same
    model without AMP (`float32`, on float32 weights) or without the fusion passes (`unfused`)."""
    without_amp = float32 and trainer.config.amp
    # A parameter-server worker's Programs pull from the servers: export from a plain trainer of the same model
    # (its weights pulled from the servers first, by fleet.save_inference_model).
    if not without_amp and not unfused and not getattr(trainer, "programs_read_servers", False):
        return trainer, state
    config = trainer.config.replace({"amp": False}) if without_amp else trainer.config
    model = float32_model(trainer) if without_amp else trainer.model
    disabled = [*trainer.disable_passes, *(fusion_pass_names(config) if unfused else [])]
    exporter = CompiledTrainer(model, config, verify=trainer.verify, disable_passes=disabled)
    return exporter, (model_state(model) if model is not trainer.model else state)
