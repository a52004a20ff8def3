"""Records which plain Python attributes of the model's modules the traced step read, and their values.

A Program bakes such values in (`self.temperature`, a Dropout's `p` and `training` flag), so the step must be
recompiled when one changes. During capture every submodule's class is swapped for a subclass whose `__getattribute__`
notes each read of a plain value (None, bool, int, float, str, or tuples and lists of them) from the
instance's `__dict__`. A module whose class cannot be swapped has all its plain attributes recorded instead.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

from torch import nn

PLAIN_SCALARS = (type(None), bool, int, float, str)
# nn.Module's own bookkeeping (the hook and parameter dicts are not plain), except `training`: a module whose
# forward reads its training flag depends on it, the others (a Linear) do not.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}
_recording_classes: dict[type, type] = {}
_active_reads: dict[tuple[int, str], Any] = {}  # filled while a recording is active


def is_plain(value: Any) -> bool:
    """A value a guard can hold and compare exactly: a scalar, or a tuple or list of plain values."""
    if type(value) in PLAIN_SCALARS:
        return True
    return type(value) in (tuple, list) and all(is_plain(v) for v in value)


def plain_attributes(module: nn.Module) -> dict[str, Any]:
    """The module's own plain attributes (instance `__dict__`, nn.Module bookkeeping left out)."""
    return {k: v for k, v in vars(module).items() if k not in _MODULE_INTERNALS and is_plain(v)}


def _recording_class(cls: type) -> type:
    """`cls` with a `__getattribute__` that records plain instance-attribute reads into `_active_reads`."""
    if cls not in _recording_classes:
        def __getattribute__(self: nn.Module, name: str, _get=cls.__getattribute__) -> Any:
            value = _get(self, name)
            if name not in _MODULE_INTERNALS and is_plain(value) and name in object.__getattribute__(self, "__dict__"):
                # a list may be changed in place later: keep the value as read
                _active_reads.setdefault((id(self), name), copy.deepcopy(value) if type(value) is list else value)
            return value
        _recording_classes[cls] = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                                              "__module__": cls.__module__,
                                                              "__qualname__": cls.__qualname__})
    return _recording_classes[cls]


@contextlib.contextmanager
def recording_attribute_reads(model: nn.Module) -> Iterator[list[list]]:
    """Within the block, plain attribute reads of `model`'s modules are recorded; after it, the yielded list holds
    `[module path, attribute, value]` for each (first value read), sorted."""
    _active_reads.clear()
    paths: dict[int, str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), path)
    swapped: list[tuple[nn.Module, type]] = []
    unswappable: list[nn.Module] = []
    result: list[list] = []
    try:
        for module in {id(m): m for m in model.modules()}.values():
            original = type(module)
            try:
                module.__class__ = _recording_class(original)
                swapped.append((module, original))
            except TypeError:  # e.g. a class with a custom layout: guard all its plain attributes instead
                unswappable.append(module)
        yield result
    finally:
        for module, original in swapped:
            module.__class__ = original
    reads = dict(_active_reads)
    _active_reads.clear()
    for module in unswappable:
        reads.update({(id(module), k): v for k, v in plain_attributes(module).items()})
    result.extend(sorted(([paths[key[0]], key[1], value] for key, value in reads.items()), key=lambda r: r[:2]))
