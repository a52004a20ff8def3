"""Capture: a model, loss function and optimizer become one static training Program (and an eval one)."""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, keystr, tree_flatten_with_path

from fleetc.capture.attribute_reads import recording_attribute_reads
from fleetc.capture.dynamic import SIZE_ONE, DynamicDims, SymbolTable
from fleetc.capture.hooks import refuse_untraceable_hooks, trace_gradient_hooks
from fleetc.capture.optimizer import OptimizerSignature, lower_optimizer
from fleetc.capture.step_module import EvalStep, StepInputs, TrainStep, split_step_args
from fleetc.capture.to_program import graph_to_program
from fleetc.capture.trace import trace_step
from fleetc.ir.program import Program


def _feed_names(model: nn.Module, args: tuple, kwargs: dict, has_target: bool) -> list[str]:
    """Readable names for every leaf of (args, kwargs): forward's parameter names where known."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = []
    for path, _ in tree_flatten_with_path((args, kwargs))[0]:
        top, rest = path[1], keystr(path[2:])
        if path[0].idx == 0:
            index = top.idx
            if has_target and index == len(args) - 1:
                base = "target"
            else:
                base = params[index] if index < len(params) else f"input{index}"
        else:
            base = str(top.key)
        names.append(base + rest)
    return names


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter tensor) → its (first) qualified name; tied weights share one name."""
    return {id(p): name for name, p in model.named_parameters()}


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every qualified name of a parameter or buffer → the first name it is reachable by (tied weights)."""
    first: dict[int, str] = {}
    aliases = {}
    for named in (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        for name, tensor in named:
            aliases[name] = first.setdefault(id(tensor), name)
    return aliases


def _traced(module: nn.Module, model: nn.Module, inputs: StepInputs, feed_names: list[str], *, train: bool,
            dynamic: DynamicDims | None) -> tuple[Any, TreeSpec, list, SymbolTable | None]:
    """Trace `module` on the tensor inputs, recording the model's plain attribute reads; train steps trace with
    grad enabled whatever the caller's mode (the step computes its own gradients, like a loss.backward()).
    With `dynamic` dims, the trace is symbolic in them and the SymbolTable says what it assumed."""
    grad_mode = contextlib.ExitStack()
    if train:
        grad_mode.enter_context(torch.inference_mode(False))
        grad_mode.enter_context(torch.enable_grad())
    with grad_mode, recording_attribute_reads(model) as reads:
        # Tensors made under inference_mode cannot be traced through autograd; a copy stands in for the example.
        examples = tuple(t.clone() if train and t.is_inference() else t for t in inputs.tensors)
        if dynamic:  # a view's strides would tie its symbolic sizes to its base's: trace on contiguous copies
            examples = tuple(t.contiguous() for t in examples)
            inputs.ties = dynamic.ties([tuple(t.shape) for t in examples])
        graph, out_spec, fakes = trace_step(module, examples, {}, train=train,
                                            dynamic_shapes=dynamic.export_shapes(examples) if dynamic else None)
    symbols = None
    if fakes is not None:
        symbols = SymbolTable(fakes, feed_names, dynamic)
    return graph, out_spec, reads, symbols


def _tensor_feed_names(model: nn.Module, args: tuple, kwargs: dict, inputs: StepInputs, has_target: bool) -> list[str]:
    names = _feed_names(model, args, kwargs, has_target)
    return [names[i] for i in inputs.tensor_positions]


def tensor_feed_names(model: nn.Module, args: tuple, kwargs: dict, has_target: bool) -> list[str]:
    """The Program's feed names of a step's tensor arguments, in order (`target` for a loss_fn's target)."""
    return _tensor_feed_names(model, args, kwargs, StepInputs(args, kwargs), has_target)


def _set_dynamic(program: Program, symbols: SymbolTable | None) -> None:
    if symbols is not None:
        program.metadata["dynamic"] = symbols.metadata()


def capture_train_program(model: nn.Module, loss_fn: Callable | None, optimizer: torch.optim.Optimizer | None,
                          args: tuple, kwargs: dict[str, Any], dynamic: DynamicDims | None = None) -> Program:
    """The whole training step: forward, loss, backward, the gradient hooks and (with an optimizer) the update.

    Non-tensor arguments are baked in; `metadata["attribute_reads"]` lists the plain module attributes read.
    `dynamic` names the input dims traced as symbols (`metadata["dynamic"]` then says what was assumed).
    """
    refuse_untraceable_hooks(model)
    inputs = StepInputs(args, kwargs)
    names = _tensor_feed_names(model, args, kwargs, inputs, loss_fn is not None)
    graph, _, reads, symbols = _traced(TrainStep(model, loss_fn, inputs), model, inputs, names, train=True,
                                       dynamic=dynamic)
    program = graph_to_program(graph, names, wrapped=True, loss_fn_given=loss_fn is not None,
                               canonical=canonical_names(model), symbols=symbols)
    _set_dynamic(program, symbols)
    program.metadata["kind"] = "train"
    program.metadata["attribute_reads"] = reads
    trace_gradient_hooks(program, model)
    if optimizer is not None:
        lower_optimizer(program, optimizer, param_names(model))
    return program


def capture_eval_program(model: nn.Module, args: tuple, kwargs: dict[str, Any],
                         dynamic: DynamicDims | None = None) -> tuple[Program, TreeSpec]:
    """Forward only, no grad, eval-mode semantics (the caller switches the model to eval); and the output spec."""
    inputs = StepInputs(args, kwargs)
    names = _tensor_feed_names(model, args, kwargs, inputs, False)
    graph, out_spec, reads, symbols = _traced(EvalStep(model, inputs), model, inputs, names, train=False,
                                              dynamic=dynamic)
    program = graph_to_program(graph, names, wrapped=True, loss_fn_given=False, canonical=canonical_names(model),
                               symbols=symbols)
    _set_dynamic(program, symbols)
    program.metadata["kind"] = "eval"
    program.metadata["attribute_reads"] = reads
    return program, out_spec


__all__ = ["SIZE_ONE", "DynamicDims", "OptimizerSignature", "StepInputs", "capture_train_program", "capture_eval_program", "split_step_args",
           "tensor_feed_names",
           "param_names"]
