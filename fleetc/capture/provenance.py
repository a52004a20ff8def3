"""Stamps module paths and user source lines on the nodes of a direct AOTAutograd trace.

torch.export records `nn_module_stack` and a stack trace on every node, but tracing the step through torch.export
and then again through AOTAutograd's joint export costs two traces. A direct joint trace costs one, yet records
neither. While `recording_provenance(root)` is active (inside `torch.fx.traceback.preserve_node_meta()`), module
forward hooks keep the current module path, and a torch-function mode the innermost user frame, in the FX
"current meta" that every new node copies: the same metadata torch.export gives, in the same form.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.overrides import TorchFunctionMode

from fleetc.capture.step_module import EvalStep, TrainStep
from fleetc.capture.trace import is_user_file

_ROOT_FORWARDS = (TrainStep.forward.__code__, EvalStep.forward.__code__)


class DataDependentBranch(RuntimeError):
    """Python control flow on a traced tensor's value (`if h.sum() > 0:`), which a static Program cannot hold."""


_user_code: dict[Any, bool] = {}  # code object → is_user_file(its file), cached: looked up for every torch call


def _innermost_user_frame(frame: Any) -> str:
    """The innermost user frame at or above `frame`, as one stack-trace line; "" when none is found before leaving the
    model (the root module's own forward, in fleetc, is not the user's)."""
    while frame is not None:
        code = frame.f_code
        user = _user_code.get(code)
        if user is None:
            user = _user_code[code] = is_user_file(code.co_filename)
        if user:
            return f'File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}'
        if code in _ROOT_FORWARDS:
            return ""
        frame = frame.f_back
    return ""


class _UserSourceMode(TorchFunctionMode):
    """Sets the current meta's `stack_trace` to the caller's user frame for each top-level torch call made inside
    the model's forward, so the aten nodes it becomes name the user's file:line (torch calls made inside it run with
    this mode off; calls outside any forward, such as the backward's, are left alone)."""

    def __init__(self, open_forwards: list[bool]):
        super().__init__()
        self.open_forwards = open_forwards

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Outside forward, or dynamo tracing a higher-order op's branch (it cannot read frames): nothing to stamp.
        if not self.open_forwards or torch.compiler.is_dynamo_compiling():
            return func(*args, **(kwargs or {}))
        meta = fx_traceback.current_meta
        before = meta.get("stack_trace")
        caller = sys._getframe(1)
        meta["stack_trace"] = _innermost_user_frame(caller)
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException as exc:
            # `if t.sum() > 0:` (a tensor's `__bool__`, which functional tensors implement with `.item()`), not a
            # `.item()` of the user's: say which it was
            if func is torch.Tensor.__bool__ or caller.f_code.co_name == "__bool__":
                raise DataDependentBranch(f"data-dependent branch on a tensor's truth value ({exc})") from exc
            raise
        finally:
            if before is None:
                meta.pop("stack_trace", None)
            else:
                meta["stack_trace"] = before


@contextlib.contextmanager
def recording_provenance(root: nn.Module) -> Iterator[None]:
    """Within the block, nodes traced from `root`'s forward carry `nn_module_stack` ({key: (path, class)}, outermost
    first, as torch.export writes it) and `stack_trace` (the innermost user frame)."""
    paths: dict[int, str] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), path)
    entered: list[bool] = []  # per open forward: whether it pushed a module (modules made in forward are not)

    def push(module: nn.Module, _args: Any) -> None:
        path = paths.get(id(module))
        entered.append(path is not None)
        if path is not None:
            stack = dict(fx_traceback.current_meta.get("nn_module_stack") or {})
            cls = type(module)
            stack[f"{path}@{len(entered)}"] = (path, f"{cls.__module__}.{cls.__qualname__}")
            fx_traceback.current_meta["nn_module_stack"] = stack

    def pop(module: nn.Module, _args: Any, _output: Any) -> None:
        if entered and entered.pop():
            stack = dict(fx_traceback.current_meta.get("nn_module_stack") or {})
            if stack:
                stack.popitem()
            fx_traceback.current_meta["nn_module_stack"] = stack

    hooks = [nn.modules.module.register_module_forward_pre_hook(push),
             nn.modules.module.register_module_forward_hook(pop, always_call=True)]
    try:
        with _UserSourceMode(entered):
            yield
    finally:
        for hook in hooks:
            hook.remove()
        fx_traceback.current_meta.pop("nn_module_stack", None)
        fx_traceback.current_meta.pop("stack_trace", None)


__all__ = ["recording_provenance"]
