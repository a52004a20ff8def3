"""Fingerprints for the compile cache's keys: fleetc's own source, the user code a capture runs, module config.

A fingerprint is a sha256 hex digest of a canonical text. fleetc's fingerprint hashes its source files, so an
edited checkout of the same version never reuses another checkout's entries. The code fingerprint follows the
bytecode a step runs: the methods of each module class (and its non-torch base classes), the loss function, hooks
and recompute policy, and, through each function's global names and closure cells, the functions, classes, plain
values and tensors (by content) they reach; other objects count by class and plain attributes. torch's own code is
covered by the torch version in the key, so the walk stops at torch and the standard library. Config is every
module's plain attributes (numbers, strings, flags, and one level into config objects).
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import pathlib
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

_PLAIN = (bool, int, float, str, type(None))
_STOP_PACKAGES = ("torch", "sympy", "numpy", "networkx", "typing_extensions", "fleetc")


def digest(*parts: str) -> str:
    """sha256 of the parts, each length-prefixed so that no two different part lists collide."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode()
        h.update(f"{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def fleetc_fingerprint() -> str:
    """fleetc's version and a hash of every source file of the installed package (computed once per process)."""
    import fleetc

    root = pathlib.Path(fleetc.__file__).parent
    h = hashlib.sha256(fleetc.__version__.encode())
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def environment_fingerprint() -> str:
    """fleetc's fingerprint with the torch and Python versions: the part of every key that is not the model's."""
    return digest(fleetc_fingerprint(), torch.__version__, sys.version)


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, (tuple, list, frozenset)) and all(_is_plain(v) for v in value)


def _not_walked(module_name: str | None) -> bool:
    """torch, the standard library and fleetc itself: covered by the versions in the key, not walked."""
    top = (module_name or "").partition(".")[0]
    return top in _STOP_PACKAGES or top in sys.stdlib_module_names or top == "builtins"


class _CodeWalk:
    """Collects canonical text for the code reachable from some roots (each object visited once)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._seen: set[int] = set()

    def visit(self, obj: Any) -> None:
        if id(obj) in self._seen:
            return
        self._seen.add(id(obj))
        if isinstance(obj, functools.partial):
            self.lines.append(f"partial {obj.args!r} {sorted(obj.keywords)!r}")
            self.visit(obj.func)
        elif isinstance(obj, types.MethodType):
            self.value("bound to", obj.__self__)
            self.visit(obj.__func__)
        elif isinstance(obj, type):
            self._class(obj)
        elif isinstance(obj, types.FunctionType):
            self._function(obj)
        elif callable(obj) and not isinstance(obj, types.BuiltinFunctionType):
            self.value("instance", obj)  # a callable instance (an nn.Module loss, a policy object)
        else:
            self.lines.append(f"object {type(obj).__module__}.{type(obj).__qualname__}")

    def value(self, name: str, value: Any) -> None:
        """A value code reads (a global, a closure cell, a bound method's object): plain values and tensors by
        content, functions and classes walked, other objects by class and plain attributes (one level)."""
        if _is_plain(value) or (isinstance(value, dict) and _is_plain(list(value.items()))):
            self.lines.append(f"{name}={value!r}")
        elif isinstance(value, torch.Tensor):
            self.lines.append(f"{name}: {_tensor_digest(value)}")
        elif isinstance(value, (type, types.FunctionType, types.MethodType, functools.partial)):
            self.visit(value)
        elif isinstance(value, types.ModuleType):
            self.lines.append(f"{name}: module {value.__name__}")
        else:
            self.lines.append(f"{name}: {type(value).__module__}.{type(value).__qualname__}")
            if hasattr(value, "__dict__"):
                self.lines.append(repr(_plain_attributes(value)))
            if callable(value) and not isinstance(value, types.BuiltinFunctionType):
                self._class(type(value))

    def _class(self, cls: type) -> None:
        self.lines.append(f"class {cls.__module__}.{cls.__qualname__}")
        for base in cls.__mro__:
            if base is object or _not_walked(base.__module__):
                continue
            for name, member in sorted(vars(base).items()):
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, property):
                    for accessor in (member.fget, member.fset):
                        if accessor is not None:
                            self.visit(accessor)
                elif isinstance(member, types.FunctionType):
                    self.visit(member)
                elif _is_plain(member) and not name.startswith("__"):
                    self.lines.append(f"attr {base.__qualname__}.{name}={member!r}")

    def _function(self, fn: types.FunctionType) -> None:
        self.lines.append(f"function {fn.__module__}.{fn.__qualname__} defaults={fn.__defaults__!r}")
        if _not_walked(fn.__module__):
            return
        self._code(fn.__code__, fn.__globals__)
        for cell in fn.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self.value("closure", value)

    def _code(self, code: types.CodeType, namespace: dict[str, Any]) -> None:
        self.lines.append(code.co_code.hex())
        self.lines.append(repr(code.co_names))
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self._code(const, namespace)
            else:
                self.lines.append(repr(const))
        names = set(code.co_names)
        for name in code.co_names:
            value = namespace.get(name)
            if isinstance(value, types.ModuleType):
                if _not_walked(value.__name__):
                    continue
                for attribute in sorted(names & set(vars(value))):  # `helpers.scale(...)`: the names it reaches
                    self.value(f"global {name}.{attribute}", vars(value)[attribute])
            elif name in namespace:
                self.value(f"global {name}", value)


def code_fingerprint(roots: Iterable[Any]) -> str:
    """Hash of the user code reachable from `roots` (module classes, functions, callable objects)."""
    walk = _CodeWalk()
    for root in roots:
        walk.visit(root)
    return digest(*walk.lines)


def _tensor_digest(tensor: torch.Tensor) -> str:
    """dtype, shape and a hash of the values: a tensor the step reads as a constant (lifted into the Program)."""
    try:
        data = tensor.detach().cpu().contiguous()
        values = hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    except (RuntimeError, TypeError):  # no readable values (a meta or fake tensor): never equal to another
        values = f"unreadable {id(tensor)}"
    return f"tensor {tensor.dtype} {tuple(tensor.shape)} {values}"


def _plain_attributes(obj: Any) -> list[tuple[str, str]]:
    return sorted((k, repr(v)) for k, v in vars(obj).items() if _is_plain(v))


def config_fingerprint(model: nn.Module) -> str:
    """Hash of every module's plain attributes (sizes, flags, eps, `training`) and of the plain attributes of the
    config objects it holds (`self.config.hidden_size`), by module path."""
    lines = []
    for path, module in model.named_modules():
        lines.append(f"{path}: {type(module).__qualname__} {_plain_attributes(module)}")
        for name, value in sorted(vars(module).items()):
            if name.startswith("_") or _is_plain(value) or isinstance(value, (nn.Module, torch.Tensor)):
                continue
            if hasattr(value, "__dict__") and not inspect.isroutine(value) and not isinstance(value, type):
                lines.append(f"{path}.{name}: {type(value).__qualname__} {_plain_attributes(value)}")
    return digest(*lines)
