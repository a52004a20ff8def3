"""Turns a Program of aten ops into a torch.export ExportedProgram: a module replaying it, exported with its state.

The module holds copies of the parameters and buffers the Program reads, under their model names, and its
`forward` takes the Program's feeds by name; it runs the runtime's generated step, so the exported graph holds
exactly the Program's ops. The batch dimension (dim 0 of every input as long as the first input's dim 0) is
exported dynamic when the Program allows it.
"""
from __future__ import annotations

import keyword
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_unflatten

from fleetc.errors import ExportError
from fleetc.ir.program import Program, VarKind
from fleetc.ir.symbolic import concrete_shape, hints
from fleetc.runtime.pycodegen import generate_step

BATCH_DIM = "batch"


@dataclass
class ExportedModel:
    """The exported program, which input dims stayed dynamic ({input: {dim: name}}), and what to tell the user."""

    exported: torch.export.ExportedProgram
    dynamic_dims: dict[str, dict[int, str]]
    notes: list[str] = field(default_factory=list)


class ProgramModule(nn.Module):
    """Replays a Program on its own copies of the parameters and buffers the Program reads."""

    def __init__(self, program: Program, state: Mapping[str, torch.Tensor], out_spec: TreeSpec | None):
        super().__init__()
        self._program = program
        self._out_spec = out_spec
        self._step = generate_step(program).fn
        self._params: list[str] = []
        for var in program.persistables():
            owner_path, _, leaf = var.name.rpartition(".")
            owner = self
            for part in owner_path.split(".") if owner_path else ():
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            tensor = state[var.name].detach().clone()
            if var.kind is VarKind.PARAM:
                owner.register_parameter(leaf, nn.Parameter(tensor, requires_grad=False))
                self._params.append(var.name)
            else:
                owner.register_buffer(leaf, tensor)

    def replay(self, feeds: list[torch.Tensor]) -> Any:
        state = {var.name: self.get_parameter(var.name) if var.name in self._params else self.get_buffer(var.name)
                 for var in self._program.persistables()}
        out = self._step(state, feeds, None)
        values = [out[key] for key in self._program.fetches]
        if self._out_spec is not None:
            return tree_unflatten(values, self._out_spec)
        return values[0] if len(values) == 1 else tuple(values)


def _module_class(feeds: list[str]) -> type[ProgramModule]:
    """A ProgramModule subclass whose `forward` takes the feeds by name, so the exported signature has them."""
    for name in feeds:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ExportError(f"input {name!r} is not a plain forward argument (nested inputs cannot be exported); "
                              "feed tensors by forward argument name")
    params = "".join(f", {name}" for name in feeds)
    source = f"def forward(self{params}):\n    return self.replay([{', '.join(feeds)}])\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, "<fleetc exported forward>", "exec"), namespace)  # names checked above: identifiers only
    return type("ExportedProgramModule", (ProgramModule,), {"forward": namespace["forward"]})


def example_inputs(program: Program, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Zeros shaped like each feed (or those named): values never matter to tracing, and zeros are valid token ids."""
    inputs = {}
    for name in program.feeds if names is None else names:
        var = program.var(name)
        if var.shape is None:
            raise ExportError(f"input {name!r} is a Python {var.dtype} value, not a tensor; export takes tensors")
        # A dynamic Program's symbolic dims: zeros at the sizes it was traced with.
        inputs[name] = torch.zeros(concrete_shape(var.shape, hints(program)), dtype=var.torch_dtype, device=var.device)
    return inputs


def _batch_dims(program: Program, batch: torch.export.Dim) -> dict[str, dict[int, Any] | None]:
    shapes = [program.var(name).shape for name in program.feeds]
    size = next((shape[0] for shape in shapes if shape), None)
    return {name: {0: batch} if shape and shape[0] == size else None for name, shape in zip(program.feeds, shapes)}


def _symbolic_dims(exported: torch.export.ExportedProgram, feeds: list[str]) -> dict[str, dict[int, str]]:
    placeholders = {node.name: node for node in exported.graph.nodes if node.op == "placeholder"}
    found: dict[str, dict[int, str]] = {}
    for feed, node_name in zip(feeds, exported.graph_signature.user_inputs):
        dims = {i: BATCH_DIM for i, d in enumerate(placeholders[node_name].meta["val"].shape)
                if isinstance(d, torch.SymInt)}
        if dims:
            found[feed] = dims
    return found


def _constraint_violation(exc: Exception) -> bool:
    from torch._dynamo.exc import UserError, UserErrorType

    return isinstance(exc, UserError) and exc.error_type is UserErrorType.CONSTRAINT_VIOLATION


def _first_lines(exc: Exception, count: int) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:count])[:400]


def export_program(program: Program, state: Mapping[str, torch.Tensor], *, out_spec: TreeSpec | None = None,
                   dynamic_batch: bool = True) -> ExportedModel:
    """Export `program` (aten ops only) with `state` (name → tensor for its persistables) via torch.export.

    `out_spec` rebuilds the model's output structure from the fetches; without it the module returns one
    tensor, or a tuple in fetch order. With `dynamic_batch`, a Program whose ops fix the batch size is
    exported static, and a note says so.
    """
    module = _module_class(program.feeds)(program, state, out_spec).eval()
    inputs = example_inputs(program)
    notes: list[str] = []
    dynamic = _batch_dims(program, torch.export.Dim(BATCH_DIM, min=1)) if dynamic_batch else None
    try:
        try:
            exported = torch.export.export(module, tuple(inputs.values()), dynamic_shapes=dynamic, strict=False)
        except Exception as exc:  # a batch fixed by the Program's static shapes: export it static, and say so
            if dynamic is None or not _constraint_violation(exc):
                raise
            exported = torch.export.export(module, tuple(inputs.values()), strict=False)
            sizes = sorted({program.var(name).shape[0] for name, spec in dynamic.items() if spec})
            notes.append(f"the batch dimension is exported static (size {sizes[0]}): an op of the eval Program uses "
                         "that size as a constant, because the Program was captured with static shapes")
    except ExportError:
        raise
    except Exception as exc:  # torch.export raises many types; all mean the Program could not be exported
        raise ExportError(f"torch.export could not export the eval Program: {type(exc).__name__}: "
                          f"{_first_lines(exc, 3)}") from exc
    return ExportedModel(exported, _symbolic_dims(exported, program.feeds), notes)
