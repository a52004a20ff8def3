"""Traces one training (or evaluation) step into an aten-level FX graph with descriptors.

torch.export (non-strict) turns the step into a graph module, then AOTAutograd's joint export
adds the backward and functionalizes it; both keep module paths, stack traces, sequence numbers
and `device_guard` annotations on the nodes.
"""
from __future__ import annotations

import contextlib
import os
import traceback
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec

from fleetc.errors import CaptureError

_TORCH_DIR = os.path.dirname(torch.__file__)
_FLEETC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB_DIR = os.path.dirname(contextlib.__file__)


def is_user_file(filename: str) -> bool:
    """True for files that are neither torch's, fleetc's nor the standard library's."""
    path = os.path.abspath(filename)
    return not (path.startswith(_TORCH_DIR) or path.startswith(_FLEETC_DIR) or path.startswith(_STDLIB_DIR)
                or "site-packages" in path and os.sep + "torch" in path or filename.startswith("<"))


def user_frame_from_stack_trace(stack_trace: str | None) -> str:
    """`file:line` of the innermost user frame in an FX node's recorded stack trace ("" if none)."""
    if not stack_trace:
        return ""
    found = ""
    for line in stack_trace.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            filename, _, rest = line[6:].partition('", line ')
            lineno = rest.split(",", 1)[0]
            if is_user_file(filename):
                found = f"{filename}:{lineno}"
    return found


_HINTS = (
    (("data-dependent", "GuardOnDataDependent", "data dependent"),
     "data-dependent Python control flow (an `if`/loop on a tensor's value)",
     "compute both branches and pick with torch.where, use torch.cond, or move the decision out of forward"),
    (("item()", ".item", "_local_scalar_dense"),
     "a tensor converted to a Python number (.item(), float(t), int(t))",
     "keep the value as a tensor inside forward"),
    (("nonzero", "unbacked"),
     "an op whose output shape depends on tensor values",
     "use a fixed-size formulation (masks instead of boolean indexing)"),
    (("in output, which is not a known type",),
     "an output object torch cannot flatten into tensors (for example a transformers KV cache)",
     ("return tensors, lists, dicts or dataclasses of them; for Hugging Face models set model.config.use_cache = "
      "False on every config (T5's decoder keeps its own copy: model.decoder.config), or pass use_cache=False to the "
      "call")),
)


def user_location(exc: BaseException) -> str:
    """`file:line  (code)` of the innermost user frame in an exception's traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    if not frames:
        return "an unknown location in the model"
    frame = frames[-1]
    code = f"  ({frame.line.strip()})" if frame.line else ""
    return f"{frame.filename}:{frame.lineno}{code}"


def capture_error(exc: BaseException, step: str) -> CaptureError:
    """A CaptureError naming the step, the construct, the user's file:line and a hint."""
    text = f"{type(exc).__name__}: {exc}"
    construct, hint = f"an unsupported construct ({type(exc).__name__})", "see the chained error below"
    for needles, what, how in _HINTS:
        if any(n in text for n in needles):
            construct, hint = what, how
            break
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CaptureError(
        f"cannot capture the {step}: {construct} at {user_location(exc)}\n"
        f"  torch said: {first_line[:300]}\n  hint: {hint}"
    )


def _direct_trace(module: nn.Module, args: tuple, kwargs: dict[str, Any],
                  grad_mode: contextlib.ExitStack) -> tuple[torch.fx.GraphModule, TreeSpec, None]:
    """One AOTAutograd joint trace of the module itself, with module paths and source lines stamped on the nodes
    (fleetc/capture/provenance.py): about 40% less capture time than torch.export followed by the joint export."""
    from torch._export.utils import _compiling_state_context
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fleetc.capture.provenance import recording_provenance

    # The trace's fake mode, given through the inputs: it lets a real tensor that is no input, parameter or buffer
    # (a plain tensor attribute, a loss module's buffer, a closed-over tensor) into the trace, where it becomes a
    # lifted constant (a `get_attr` node), as under torch.export.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = tuple(fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    with torch.fx.traceback.preserve_node_meta(), grad_mode, contextlib.ExitStack() as stack:
        # As under torch.export, model code sees `torch.compiler.is_compiling()` / `is_exporting()` and takes its
        # traceable paths (transformers' mask helpers otherwise read tensor values).
        with _compiling_state_context(), recording_provenance(module):
            joint = aot_export_joint_with_descriptors(stack, module, args, kwargs)
        return joint.graph_module, joint.out_spec, None


def trace_step(module: nn.Module, args: tuple, kwargs: dict[str, Any], *, train: bool,
               dynamic_shapes: tuple | None = None) -> tuple[torch.fx.GraphModule, TreeSpec, tuple | None]:
    """The joint (train) or forward-only (eval) aten graph of `module(*args, **kwargs)`, its output spec, and (with
    `dynamic_shapes`, torch.export's argument) the symbolic fake inputs it was traced on (None when static).

    Placeholders and the output node carry AOTAutograd descriptors in `meta["desc"]`.
    """
    # Imported here: it pulls in torch._dynamo (seconds), which `import fleetc` and the CLI's --help need not pay.
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._guards import detect_fake_mode

    grad_mode = contextlib.ExitStack()
    if not train:
        grad_mode.enter_context(torch.no_grad())
    if dynamic_shapes is not None:
        # Size-oblivious reasoning: a size-1 batch need not be its own Program unless the model branches on it
        # (then a guard `Ne(seq, 1)` says so and size 1 recompiles once).
        from torch.fx.experimental import _config as fx_config

        grad_mode.enter_context(fx_config.patch(backed_size_oblivious=True))
    try:
        if dynamic_shapes is None:
            return _direct_trace(module, args, kwargs, grad_mode)
        with torch.fx.traceback.preserve_node_meta(), grad_mode:
            exported = torch.export.export(module, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
            fakes = None
            if dynamic_shapes is not None:
                # The joint export traces again: on the export's symbolic fake inputs, so the dims stay symbols.
                user_inputs = set(exported.graph_signature.user_inputs)
                fakes = tuple(node.meta["val"] for node in exported.graph.nodes
                              if node.op == "placeholder" and node.name in user_inputs)
                args = fakes
            with contextlib.ExitStack() as stack:
                if fakes is not None:
                    stack.enter_context(detect_fake_mode(fakes))
                joint = aot_export_joint_with_descriptors(stack, exported.module(check_guards=False), args, kwargs)
                return joint.graph_module, exported.call_spec.out_spec, fakes
    except CaptureError:
        raise
    except Exception as exc:  # torch raises many unrelated types here; all mean "could not capture"
        raise capture_error(exc, "training step" if train else "forward pass (eval mode)") from exc
