"""The hooks a user registered on a model, its parameters and its optimizer: listed for the guards, traced into
the Program where their meaning can be, refused at compile time where it cannot.

- Module forward hooks and pre-hooks (and the global ones) run while the step is traced: they are in the Program.
- Gradient hooks of parameters (`register_hook`) and post-accumulate-grad hooks are traced here, on the gradient
  the backward computes, and spliced in after it, so the optimizer (and data-parallel allreduce) read the result.
- Optimizer step pre- and post-hooks are called by the trainer around each compiled step.
- Module backward hooks (`register_full_backward_hook`, `register_full_backward_pre_hook`, the global ones) see
  values inside autograd that a captured Program does not have: CaptureError.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks
from torch import nn

from fleetc.capture.to_program import grad_name, rename_temporaries, splice_graph
from fleetc.capture.trace import user_location
from fleetc.errors import CaptureError
from fleetc.ir.program import OpRole, Program, Ref
from fleetc.ir.usedef import Names

# (attribute on nn.Module, words); hooks with kwargs or always_call live in these dicts too.
MODULE_HOOKS = (("_forward_pre_hooks", "forward pre-hooks"), ("_forward_hooks", "forward hooks"),
                ("_backward_pre_hooks", "backward pre-hooks"), ("_backward_hooks", "backward hooks"))
TENSOR_HOOKS = (("_backward_hooks", "gradient hooks"), ("_post_accumulate_grad_hooks", "post-accumulate-grad hooks"))
OPTIMIZER_HOOKS = (("_optimizer_step_pre_hooks", "step pre-hooks"), ("_optimizer_step_post_hooks", "step post-hooks"))
_GLOBAL_HOOKS = (
    (module_hooks, "_global_forward_pre_hooks", "global module forward pre-hooks"),
    (module_hooks, "_global_forward_hooks", "global module forward hooks"),
    (module_hooks, "_global_backward_pre_hooks", "global module backward pre-hooks"),
    (module_hooks, "_global_backward_hooks", "global module backward hooks"),
    (optimizer_hooks, "_global_optimizer_pre_hooks", "global optimizer step pre-hooks"),
    (optimizer_hooks, "_global_optimizer_post_hooks", "global optimizer step post-hooks"),
)


def hook_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[tuple[str, Mapping | None]]:
    """Every place a hook that changes the training step can be registered: (where, in words; its dict or None)."""
    for module_path, module in model.named_modules():
        for attr, words in MODULE_HOOKS:
            yield f"{module_path or 'model'} {words}", getattr(module, attr, None)
    for name, param in model.named_parameters():
        for attr, words in TENSOR_HOOKS:
            yield f"{name} {words}", getattr(param, attr, None)
    if optimizer is not None:
        for attr, words in OPTIMIZER_HOOKS:
            yield f"optimizer {words}", getattr(optimizer, attr, None)
    for owner, attr, words in _GLOBAL_HOOKS:
        yield words, getattr(owner, attr, None)


def hook_name(hook: Any) -> str:
    """A readable name of a hook callable (its qualified name, or its type's)."""
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


def registered_hooks(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, list[str]]:
    """Where hooks are registered now → their names, in registration order (places without hooks left out)."""
    return {where: [hook_name(h) for h in hooks.values()] for where, hooks in hook_dicts(model, optimizer) if hooks}


def refuse_untraceable_hooks(model: nn.Module) -> None:
    """CaptureError when a module backward hook is registered: its arguments exist only inside eager autograd."""
    found = [(where, names) for where, names in registered_hooks(model, None).items() if "backward" in where]
    if found:
        where, names = found[0]
        raise CaptureError(
            f"{where} ({', '.join(names)}): fleetc cannot trace module backward hooks into the compiled step "
            "(they see autograd's per-module gradients, which the Program does not have). Use "
            "param.register_hook or register_post_accumulate_grad_hook on the parameters instead (traced into the "
            "step), or remove the hook before fleetc.compile")


def _apply_gradient_hooks(param: torch.Tensor, grad: torch.Tensor, hooks: list[Callable],
                          post_hooks: list[Callable]) -> torch.Tensor:
    """What eager autograd does to a parameter's gradient: each gradient hook may replace it; then the
    post-accumulate-grad hooks see the parameter with `.grad` set (a stand-in, so the real one is untouched)."""
    for hook in hooks:
        result = hook(grad)
        if result is not None:
            grad = result
    if post_hooks:
        stand_in = param.detach()
        stand_in.grad = grad
        for hook in post_hooks:
            hook(stand_in)
        grad = stand_in.grad
    return grad


def _untraceable(name: str, hooks: list[Callable], why: str) -> CaptureError:
    return CaptureError(f"cannot trace the gradient hooks of {name!r} ({', '.join(map(hook_name, hooks))}): {why}. "
                        "A traced hook may only compute with its arguments, without reading other tensors or "
                        "branching on values")


def _trace_hooks(name: str, param: torch.Tensor, hooks: list[Callable],
                 post_hooks: list[Callable]) -> torch.fx.GraphModule:
    # Imported here: make_fx pulls in torch._dynamo (seconds), which `import fleetc` need not pay.
    from torch.fx.experimental.proxy_tensor import make_fx

    def apply(value: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return _apply_gradient_hooks(value, grad, hooks, post_hooks)
    example = param.detach()
    try:
        with torch.no_grad():
            gm = make_fx(torch.func.functionalize(apply, remove="mutations_and_views"),
                         tracing_mode="fake")(example, torch.empty_like(example))
    except Exception as exc:  # torch raises many types while tracing; all mean "this hook cannot be traced"
        said = (str(exc).strip().splitlines() or [""])[0][:300]
        raise _untraceable(name, hooks + post_hooks, f"{type(exc).__name__} at {user_location(exc)}: {said}") from exc
    # An in-place hook (`grad.mul_(2)`) leaves a copy_ back into its input: the returned value already holds it.
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder":
            node.replace_all_uses_with(node.args[1])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    return gm


def trace_gradient_hooks(program: Program, model: nn.Module) -> None:
    """Splice every parameter's gradient and post-accumulate-grad hooks in after its gradient: the hooked value
    becomes `<param>@GRAD` (the raw one `<param>@GRAD@BEFORE_HOOKS`) so everything after reads the hooked value.

    The renames of all hooked gradients are applied together, before and after the splices (one pass over the
    ops each, not two per parameter)."""
    traced = []
    for name, param in model.named_parameters():
        hooks = list((getattr(param, "_backward_hooks", None) or {}).values())
        post_hooks = list((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values())
        if not (hooks or post_hooks) or f"grad:{name}" not in program.fetches:
            continue  # no gradient reaches the parameter: eager runs none of its hooks either
        traced.append((name, hooks + post_hooks, _trace_hooks(name, param, hooks, post_hooks)))
    if not traced:
        return
    raw = {name: f"{grad_name(name)}@BEFORE_HOOKS" for name, _, _ in traced}
    rename_temporaries(program, {program.fetches[f"grad:{name}"]: raw[name] for name, _, _ in traced})
    names = Names(program)
    hooked: dict[str, str] = {}
    for name, all_hooks, gm in traced:
        attrs = {"op_role": int(OpRole.BACKWARD), "module_path": name.rpartition(".")[0], "provenance": "hooks"}
        try:
            (result,) = splice_graph(program, gm, [Ref(name), Ref(raw[name])], prefix=f"{name}.grad_hook",
                                     attrs=attrs, names=names)
        except CaptureError as exc:
            raise _untraceable(name, all_hooks, str(exc)) from exc
        # Hooks that leave the gradient as it is (observers) give back the raw value: it keeps its name.
        hooked[result.name] = grad_name(name)
    rename_temporaries(program, hooked)
    for name, _, _ in traced:
        program.fetches[f"grad:{name}"] = grad_name(name)


def optimizer_step_hooks(optimizer: torch.optim.Optimizer | None) -> tuple[list[Callable], list[Callable]]:
    """(step pre-hooks, step post-hooks) of `optimizer`, global ones included, in the order `optimizer.step()`
    runs them. The compiled step runs them around its update (`run_step_hooks`)."""
    if optimizer is None:
        return [], []
    return ([*optimizer_hooks._global_optimizer_pre_hooks.values(), *optimizer._optimizer_step_pre_hooks.values()],
            [*optimizer._optimizer_step_post_hooks.values(), *optimizer_hooks._global_optimizer_post_hooks.values()])


def run_step_hooks(optimizer: torch.optim.Optimizer, hooks: list[Callable]) -> None:
    """Call step hooks as `optimizer.step()` with no arguments would; a pre-hook may not change the arguments."""
    for hook in hooks:
        if hook(optimizer, (), {}) not in (None, ((), {})):
            raise CaptureError(f"optimizer step pre-hook {hook_name(hook)} returned new arguments for "
                               "optimizer.step(); the compiled step's update takes none")
