"""The per-step guard check: a record bound to the live model and optimizer, checked cheaply before every step.

The cheap check is generated code, one straight-line expression of dict subscripts and `is` comparisons against
the objects bound when it was armed (training flags, plain attribute values, the modules and tensors under each
name, requires_grad flags, param-group members), as torch.compile's guards are; for hooks it compares torch's
global hook-handle counter (`RemovableHandle.next_id` moves on every registration anywhere) and the sizes of the
dicts that held hooks (removal). Only when it fails does `failure()` compare values deeply and name what
changed; when nothing the Program depends on changed (an equal value in a new object, a hook on another model),
the check is re-armed on the current objects and passes.
"""
from __future__ import annotations

import copy
from itertools import chain
from operator import is_, itemgetter

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fleetc.capture.hooks import hook_dicts, registered_hooks
from fleetc.runtime.guards.record import GuardRecord

_PARAMS = itemgetter("params")


def _changed(what: str, expected: object, now: object) -> str:
    return f"{what} changed: {expected!r} when compiled, now {now!r}"


class _Submodules:
    """`model.get_submodule` from one walk of the model: a deep model's guards name thousands of paths, and
    `get_submodule` walks from the root for each (a path `named_modules` skips, such as a shared module's second
    name, is still looked up the slow way)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.by_path = dict(model.named_modules())

    def __call__(self, path: str) -> nn.Module:
        module = self.by_path.get(path)
        return module if module is not None else self.model.get_submodule(path)

    def owner(self, target: str) -> tuple[nn.Module, str]:
        """The module holding `target` ("a.b.c" → (a.b, "c"); a top-level name → (model, name))."""
        path, _, name = target.rpartition(".")
        return self(path), name


class GuardCheck:
    """A guard record bound to the live objects it is about (right after the compile that produced it)."""

    def __init__(self, record: GuardRecord, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.record, self.model = record, model
        self.optimizer = optimizer if record.step_kind == "train" else None
        training = record.of_kind("training")
        submodule = _Submodules(model)
        self._modules = [submodule("" if g.target == "model" else g.target) for g in training]
        self._training = [g.expected for g in training]
        attributes = record.of_kind("attribute")
        owners = [submodule.owner(g.target) for g in attributes]
        self._attr_dicts = [vars(module) for module, _ in owners]
        self._attr_names = [name for _, name in owners]
        self._attr_values = [g.expected for g in attributes]
        self._attr_types = [type(v) for v in self._attr_values]
        children = [g.target for g in record.of_kind("module")]
        self._child_dicts = [submodule.owner(path)[0]._modules for path in children]
        self._child_names = [path.rpartition(".")[2] for path in children]
        self._children = [submodule(path) for path in children]
        tensors = record.of_kind("tensor")
        tensor_owners = [submodule.owner(g.target) for g in tensors]
        self._tensor_dicts = [m._parameters if name in m._parameters else m._buffers for m, name in tensor_owners]
        self._tensor_names = [name for _, name in tensor_owners]
        self._tensors = list(map(dict.get, self._tensor_dicts, self._tensor_names))
        flags = record.of_kind("requires_grad")
        self._params = [getattr(*submodule.owner(g.target)) for g in flags]
        self._requires_grad = [g.expected for g in flags]
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        self._group_lists = [group["params"] for group in groups]
        self._group_lens = [len(params) for params in self._group_lists]  # the lists may grow in place later
        self._group_flat = list(chain.from_iterable(self._group_lists))
        self._arm()

    def _arm(self) -> None:
        """Bind the cheap check to the objects present now (which match the record) and generate it."""
        self._hook_epoch = RemovableHandle.next_id
        hooked = [(where, hooks) for where, hooks in hook_dicts(self.model, self.optimizer) if hooks]  # one walk
        self._hook_keys = {where: tuple(hooks) for where, hooks in hooked}
        names: dict[str, object] = {"RemovableHandle": RemovableHandle, "armed": self}
        clauses = ["RemovableHandle.next_id == armed._hook_epoch"]

        def bind(prefix: str, value: object) -> str:
            name = f"{prefix}{len(names)}"
            names[name] = value
            return name
        clauses += [f"len({bind('h', hooks)}) == {len(hooks)}" for _, hooks in hooked]
        # Instance dicts, not attributes: nn.Module defines __getattr__, which slows every attribute load.
        clauses += [f"{bind('d', vars(m))}['training'] is {flag}" for m, flag in zip(self._modules, self._training)]
        for attrs, name in zip(self._attr_dicts, self._attr_names):
            value = attrs.get(name)  # a list may change in place: compare a copy by value, the rest by identity
            clauses.append(f"{bind('d', attrs)}[{name!r}] == {bind('c', copy.deepcopy(value))}" if type(value) is list
                           else f"{bind('d', attrs)}[{name!r}] is {bind('c', value)}")
        clauses += [f"{bind('d', children)}[{name!r}] is {bind('m', child)}"
                    for children, name, child in zip(self._child_dicts, self._child_names, self._children)]
        clauses += [f"{bind('d', tensors)}[{name!r}] is {bind('t', tensor)}"
                    for tensors, name, tensor in zip(self._tensor_dicts, self._tensor_names, self._tensors)]
        clauses += [f"{bind('t', p)}.requires_grad is {flag}" for p, flag in zip(self._params, self._requires_grad)]
        if self.optimizer is not None:
            groups = bind("g", self.optimizer)
            clauses.append(f"len({groups}.param_groups) == {len(self._group_lists)}")
            for i, params in enumerate(self._group_lists):
                members = bind("l", params)
                clauses.append(f"{groups}.param_groups[{i}]['params'] is {members} and len({members}) == {len(params)}")
                clauses += [f"{members}[{j}] is {bind('t', p)}" for j, p in enumerate(params)]
        self.source = ("def unchanged():\n    try:\n        return (" + "\n                and ".join(clauses)
                       + ")\n    except (KeyError, IndexError):\n        return False\n")
        exec(compile(self.source, f"<fleetc guards of a {self.record.step_kind} step>", "exec"), names)  # noqa: S102
        self._unchanged = names["unchanged"]

    def _groups_as_compiled(self) -> bool:
        if self.optimizer is None:
            return True
        groups = self.optimizer.param_groups
        members = list(map(_PARAMS, groups))
        return (list(map(len, members)) == self._group_lens
                and all(map(is_, chain.from_iterable(members), self._group_flat)))

    def passes(self) -> bool:
        """Whether the compiled Program still fits the world; cheap when nothing changed."""
        if self._unchanged():
            return True
        if self.failure() is None:  # nothing the Program depends on changed: watch the objects there now
            self._arm()
            return True
        return False

    def failure(self) -> str | None:
        """What changed since the compile, in words (the first difference found), or None when nothing did."""
        for module, path, expected in zip(self._modules, self.record.of_kind("training"), self._training):
            if module.training != expected:
                return _changed(f"{path.target}.training", expected, module.training)
        for attrs, name, guard in zip(self._attr_dicts, self._attr_names, self.record.of_kind("attribute")):
            now = attrs.get(name)
            if type(now) is not type(guard.expected) or now != guard.expected:
                return _changed(f"attribute {guard.target}", guard.expected, now)
        for children, name, child, path in zip(self._child_dicts, self._child_names, self._children,
                                               self.record.of_kind("module")):
            if children.get(name) is not child:
                return f"module {path.target} was replaced or removed since the compile"
        for tensors, name, tensor, guard in zip(self._tensor_dicts, self._tensor_names, self._tensors,
                                                self.record.of_kind("tensor")):
            if tensors.get(name) is not tensor:
                return f"{guard.target} was replaced by another tensor (or removed) since the compile"
            now = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
            if now != guard.expected:
                return _changed(guard.target, guard.expected, now)
        for param, guard in zip(self._params, self.record.of_kind("requires_grad")):
            if param.requires_grad != guard.expected:
                return _changed(f"{guard.target}.requires_grad", guard.expected, param.requires_grad)
        if not self._groups_as_compiled():
            names = {id(p): n for n, p in self.model.named_parameters()}
            now = [[names.get(id(p), "<other tensor>") for p in group["params"]]
                   for group in self.optimizer.param_groups]
            return _changed("the optimizer's param groups", [g.expected for g in self.record.of_kind("param_group")],
                            now)
        return self._hooks_failure()

    def _hooks_failure(self) -> str | None:
        now = {where: tuple(hooks) for where, hooks in hook_dicts(self.model, self.optimizer) if hooks}
        if now == self._hook_keys:
            return None  # hooks were registered elsewhere: nothing this Program depends on changed
        (guard,) = self.record.of_kind("hooks")
        names = registered_hooks(self.model, self.optimizer)
        where = next(w for w in sorted(set(now) | set(self._hook_keys)) if now.get(w) != self._hook_keys.get(w))
        return _changed(f"hooks ({where})", guard.expected.get(where, []), names.get(where, []))
