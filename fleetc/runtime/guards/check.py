"""The per-step guard check: a record bound to the live model and optimizer, checked cheaply before every step.

The cheap check compares flat lists built by C-level `map` calls (training flags, requires_grad flags, attribute
values and types, tensor identities and dtypes, param-group membership) and, for hooks, torch's global hook-handle
counter: no hook was registered anywhere since the compile when `RemovableHandle.next_id` is unchanged (removal
shows in the sizes of the dicts that held hooks). Only when that check fails does `failure()` compare deeply and
name what changed; hooks registered elsewhere (another model) pass and re-arm the counter.
"""
from __future__ import annotations

from itertools import chain
from operator import attrgetter, is_, itemgetter

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fleetc.capture.hooks import hook_dicts, registered_hooks
from fleetc.runtime.guards.record import GuardRecord

_TRAINING = attrgetter("training")
_REQUIRES_GRAD = attrgetter("requires_grad")
_DTYPE = attrgetter("dtype")
_PARAMS = itemgetter("params")


def _changed(what: str, expected: object, now: object) -> str:
    return f"{what} changed: {expected!r} when compiled, now {now!r}"


def _owner(model: nn.Module, target: str) -> tuple[nn.Module, str]:
    """The module holding `target` ("a.b.c" → (a.b, "c"); a top-level name → (model, name))."""
    path, _, name = target.rpartition(".")
    return model.get_submodule(path), name


class GuardCheck:
    """A guard record bound to the live objects it is about (right after the compile that produced it)."""

    def __init__(self, record: GuardRecord, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.record, self.model = record, model
        self.optimizer = optimizer if record.step_kind == "train" else None
        training = record.of_kind("training")
        self._modules = [model.get_submodule("" if g.target == "model" else g.target) for g in training]
        self._training = [g.expected for g in training]
        attributes = record.of_kind("attribute")
        owners = [_owner(model, g.target) for g in attributes]
        self._attr_dicts = [vars(module) for module, _ in owners]
        self._attr_names = [name for _, name in owners]
        self._attr_values = [g.expected for g in attributes]
        self._attr_types = [type(v) for v in self._attr_values]
        children = [g.target for g in record.of_kind("module")]
        self._child_dicts = [_owner(model, path)[0]._modules for path in children]
        self._child_names = [path.rpartition(".")[2] for path in children]
        self._children = [model.get_submodule(path) for path in children]
        tensors = record.of_kind("tensor")
        tensor_owners = [_owner(model, g.target) for g in tensors]
        self._tensor_dicts = [m._parameters if name in m._parameters else m._buffers for m, name in tensor_owners]
        self._tensor_names = [name for _, name in tensor_owners]
        self._tensors = list(map(dict.get, self._tensor_dicts, self._tensor_names))
        self._dtypes = [getattr(torch, g.expected) for g in tensors]
        flags = record.of_kind("requires_grad")
        self._params = [model.get_parameter(g.target) for g in flags]
        self._requires_grad = [g.expected for g in flags]
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        self._group_lists = [group["params"] for group in groups]
        self._group_lens = [len(params) for params in self._group_lists]
        self._group_flat = list(chain.from_iterable(self._group_lists))
        self._arm_hooks()

    def _arm_hooks(self) -> None:
        """Snapshot the hook dicts now (they match the record) and the global handle counter."""
        self._hook_epoch = RemovableHandle.next_id
        self._hook_keys = {where: tuple(hooks) for where, hooks in hook_dicts(self.model, self.optimizer) if hooks}
        self._hooked = [hooks for _, hooks in hook_dicts(self.model, self.optimizer) if hooks]
        self._hook_counts = [len(hooks) for hooks in self._hooked]

    def _groups_unchanged(self) -> bool:
        if self.optimizer is None:
            return True
        groups = self.optimizer.param_groups
        return (len(groups) == len(self._group_lists)
                and all(map(is_, map(_PARAMS, groups), self._group_lists))
                and list(map(len, self._group_lists)) == self._group_lens
                and all(map(is_, chain.from_iterable(self._group_lists), self._group_flat)))

    def _unchanged(self) -> bool:
        """The cheap check: True when nothing a guard watches has changed (False may still pass `failure()`)."""
        values = list(map(dict.get, self._attr_dicts, self._attr_names))
        return (RemovableHandle.next_id == self._hook_epoch
                and list(map(len, self._hooked)) == self._hook_counts
                and list(map(_TRAINING, self._modules)) == self._training
                and values == self._attr_values and list(map(type, values)) == self._attr_types
                and all(map(is_, map(dict.get, self._child_dicts, self._child_names), self._children))
                and all(map(is_, map(dict.get, self._tensor_dicts, self._tensor_names), self._tensors))
                and list(map(_DTYPE, self._tensors)) == self._dtypes
                and list(map(_REQUIRES_GRAD, self._params)) == self._requires_grad
                and self._groups_unchanged())

    def passes(self) -> bool:
        """Whether the compiled Program still fits the world; cheap when nothing changed."""
        return self._unchanged() or self.failure() is None

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
        for tensors, name, tensor, dtype, guard in zip(self._tensor_dicts, self._tensor_names, self._tensors,
                                                       self._dtypes, self.record.of_kind("tensor")):
            if tensors.get(name) is not tensor:
                return f"{guard.target} was replaced by another tensor (or removed) since the compile"
            if tensor.dtype != dtype:
                return _changed(f"{guard.target} dtype", guard.expected, str(tensor.dtype).removeprefix("torch."))
        for param, guard in zip(self._params, self.record.of_kind("requires_grad")):
            if param.requires_grad != guard.expected:
                return _changed(f"{guard.target}.requires_grad", guard.expected, param.requires_grad)
        if not self._groups_unchanged():
            names = {id(p): n for n, p in self.model.named_parameters()}
            now = [[names.get(id(p), "<other tensor>") for p in group["params"]] for group in self.optimizer.param_groups]
            return _changed("the optimizer's param groups", [g.expected for g in self.record.of_kind("param_group")],
                            now)
        return self._hooks_failure()

    def _hooks_failure(self) -> str | None:
        now = {where: tuple(hooks) for where, hooks in hook_dicts(self.model, self.optimizer) if hooks}
        if now == self._hook_keys:
            self._arm_hooks()  # hooks were registered elsewhere: nothing this Program depends on changed
            return None
        (guard,) = self.record.of_kind("hooks")
        names = registered_hooks(self.model, self.optimizer)
        where = next(w for w in sorted(set(now) | set(self._hook_keys)) if now.get(w) != self._hook_keys.get(w))
        return _changed(f"hooks ({where})", guard.expected.get(where, []), names.get(where, []))
