"""The lexical rules the Program printer and parser share: names, types, reserved words, note keys.

Kept in one place so that what the printer writes bare is exactly what the parser reads back as the same thing.
"""
from __future__ import annotations

import re

import sympy
import torch

DTYPE_SHORT = {
    "float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "b8",
}
DTYPE_LONG = {short: long for long, short in DTYPE_SHORT.items()}

# torch singletons written bare (dtypes, by their canonical name) or as `torch.<name>` (layouts, memory formats).
DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
TORCH_CONSTANTS = (torch.layout, torch.memory_format)

# A Var name, kwarg or attr key written bare; anything else is written quoted (`%'a b'` for a Var).
NAME = re.compile(r"[A-Za-z_][\w.@]*")
# A kwarg, attr, metadata or fetch key written bare (fetch keys look like `grad:fc1.weight`).
KEY = re.compile(r"[A-Za-z_][\w.@:]*")
# Bare words that mean a constant, so a Var of that name is written quoted.
RESERVED = frozenset({"True", "False", "None", "inf", "nan", "_", *DTYPES})

FLOAT = re.compile(r"-?(?:\d+\.\d*(?:e[+-]?\d+)?|\d+e[+-]?\d+|inf)|nan")
INT = re.compile(r"-?\d+")
STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
# A tensor type: `f32[8,16]`, `f64` (host scalar), `f32[4]@cuda:0` (a device other than the program's).
TYPE = re.compile(r"(\w+)(?:\[([^\]]*)\])?(?:@(\S+))?")

# Standard attributes shown in an op line's trailing notes (`# role  module  key=value  file:line`).
NOTE_KEYS = ("op_device", "forward_op", "provenance")
ABSENT = "-"  # the role or module-path note of an op that lacks the attribute altogether
# A note value written bare: no whitespace, no quotes; anything else is a quoted string.
BARE_NOTE = re.compile(r"[^\s'\"]+")
SOURCE_NOTE = re.compile(r"([^\s'\"=]+):(\d+)")
# Whitespace-separated note tokens, where a quoted string may hold spaces.
NOTE_TOKEN = re.compile(r"(?:[^\s'\"]|'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")+")


def is_bare_name(name: str) -> bool:
    return NAME.fullmatch(name) is not None and name not in RESERVED


def is_bare_module_path(path: str) -> bool:
    """Module paths are written bare unless they could be read as a source location, a key=value or `-`."""
    return BARE_NOTE.fullmatch(path) is not None and ":" not in path and "=" not in path and path != ABSENT


def shape_symbols(text: str) -> dict[str, sympy.Symbol]:
    """The shape symbols named in an expression, as torch makes them (positive integers)."""
    names = {word for word in re.findall(r"[A-Za-z_]\w*", text) if not hasattr(sympy, word)}
    return {name: sympy.Symbol(name, integer=True, positive=True) for name in names}
