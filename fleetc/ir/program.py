"""Program IR data structures: Program → Blocks → Ops and Vars, modelled on Paddle's ProgramDesc."""
from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from fleetc.ir.html import HtmlViewable
from fleetc.ir.symbolic import sym_value


class OpRole(enum.IntFlag):
    """What part of the training step an op belongs to (a flag set, like Paddle's op_role bitmask)."""

    FORWARD = 1
    BACKWARD = 2
    OPTIMIZE = 4
    LOSS = 8
    LR_SCHED = 16
    COLLECTIVE = 32

    def label(self) -> str:
        """`forward|loss`-style text, lowest bit first."""
        return "|".join(r.name.lower() for r in OpRole if r in self) or "none"

    @classmethod
    def parse(cls, text: str) -> "OpRole":
        role = cls(0)
        for part in text.split("|"):
            if part and part != "none":
                role |= cls[part.upper()]
        return role


class VarKind(str, enum.Enum):
    """Where a Var's value comes from; everything but TEMP outlives one step or is fed by the caller."""

    PARAM = "param"
    BUFFER = "buffer"
    OPTIMIZER_STATE = "optimizer_state"
    COUNTER = "counter"
    ACCUMULATOR = "accumulator"  # values summed across steps, e.g. a merged gradient `w@GRAD@MERGE`
    DATA = "data"
    HYPER = "hyper"  # host scalars fed every step, e.g. a param group's learning rate
    CONSTANT = "constant"  # a tensor the forward made from Python data; value in metadata (fleetc/ir/constants.py)
    TEMP = "temp"


PERSISTABLE_KINDS = frozenset({VarKind.PARAM, VarKind.BUFFER, VarKind.OPTIMIZER_STATE, VarKind.COUNTER,
                               VarKind.ACCUMULATOR})
# Persistables that neither the model nor the optimizer holds: the trainer creates and checkpoints them.
FLEETC_OWNED_KINDS = frozenset({VarKind.COUNTER, VarKind.ACCUMULATOR})
FED_KINDS = frozenset({VarKind.DATA, VarKind.HYPER})
# The control-flow op: runs its `sub_block` when its one argument, a bool, is true.
CONDITIONAL_BLOCK = "fleetc.conditional_block"


@dataclass(frozen=True)
class Ref:
    """A reference to a Var by name inside an op's arguments."""

    name: str


@dataclass
class Var:
    """A named value: shape (ints or sympy expressions), dtype, device and where it comes from."""

    name: str
    shape: tuple | None
    dtype: str
    device: str = "cpu"
    kind: VarKind = VarKind.TEMP

    @property
    def persistable(self) -> bool:
        return self.kind in PERSISTABLE_KINDS

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def nbytes(self, sizes: dict[str, int] | None = None) -> int:
        """Bytes of the value; a symbolic shape is evaluated at `sizes` (dim name → size, e.g. the Program's
        traced sizes, `fleetc.ir.symbolic.hints`). 0 when the shape is unknown or a symbol has no size."""
        if self.shape is None:
            return 0
        numel = 1
        for d in self.shape:
            if not isinstance(d, int) and (not sizes or any(s.name not in sizes for s in d.free_symbols)):
                return 0
            numel *= sym_value(d, sizes or {})
        return numel * torch.empty((), dtype=self.torch_dtype).element_size()


def iter_refs(value: Any) -> Iterator[str]:
    """Names of every Var referenced in an argument value (nested lists and dicts included)."""
    if isinstance(value, Ref):
        yield value.name
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_refs(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_refs(v)


def map_refs(value: Any, fn) -> Any:
    """`value` with every Ref replaced by `fn(ref)`."""
    if isinstance(value, Ref):
        return fn(value)
    if isinstance(value, list):
        return [map_refs(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(map_refs(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_refs(v, fn) for k, v in value.items()}
    return value


@dataclass
class Op:
    """One operation: `outputs = type(*args, **kwargs)` plus standard attributes.

    `type` is an overload name (`aten.addmm.default`) or a fleetc op (`fleetc.sgd`). Args hold
    constants and `Ref`s to Vars. `outputs` lists one Var name per result (None for results
    nobody reads). Standard attrs: op_role, module_path, forward_op, op_device, source, provenance.
    """

    name: str
    type: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)
    attrs: dict = field(default_factory=dict)

    @property
    def inputs(self) -> list[str]:
        """Names of the Vars this op reads, in argument order, without repeats."""
        return list(dict.fromkeys([*iter_refs(self.args), *iter_refs(self.kwargs)]))

    @property
    def defined(self) -> list[str]:
        return [o for o in self.outputs if o is not None]

    @property
    def role(self) -> OpRole:
        return OpRole(self.attrs.get("op_role", 0))

    @property
    def module_path(self) -> str:
        return self.attrs.get("module_path", "")

    @property
    def sub_block(self) -> int | None:
        return self.attrs.get("sub_block")

    def rename_inputs(self, mapping: dict[str, str]) -> None:
        """Point the op's Refs at other Vars (names not in `mapping` stay)."""
        fn = lambda r: Ref(mapping.get(r.name, r.name))  # noqa: E731
        self.args = map_refs(self.args, fn)
        self.kwargs = map_refs(self.kwargs, fn)


@dataclass
class Block:
    """Ordered ops and the Vars they define; sub-blocks see their parent's Vars."""

    idx: int
    parent_idx: int = -1
    ops: list[Op] = field(default_factory=list)
    vars: dict[str, Var] = field(default_factory=dict)

    def add_var(self, var: Var) -> Var:
        self.vars[var.name] = var
        return var


_IMMUTABLE = (str, int, float, bool, type(None), Ref, torch.dtype)


def _copy_value(value: Any) -> Any:
    """`value` with every list, tuple, dict, set and IR object inside it copied; other leaves are immutable and
    shared (numbers, strings, Refs, dtypes, sympy expressions)."""
    if isinstance(value, _IMMUTABLE):
        return value
    kind = type(value)
    if kind is list:
        return [_copy_value(v) for v in value]
    if kind is tuple:
        return tuple([_copy_value(v) for v in value])
    if kind is dict:
        return {k: _copy_value(v) for k, v in value.items()}
    if kind is set:
        return set(value)
    if kind is Op or kind is Var or kind is Block:
        return _copy_dataclass(value)
    if isinstance(value, torch.Tensor):
        return value.clone()
    return value


def _copy_dataclass(obj: Any) -> Any:
    new = object.__new__(type(obj))
    new.__dict__ = {name: _copy_value(value) for name, value in obj.__dict__.items()}
    return new


@dataclass
class Program(HtmlViewable):
    """A whole training (or evaluation) step: blocks, feeds in call order, named fetches, metadata.

    `feeds` are DATA and HYPER vars in the order the runtime passes them; `fetches` maps an output
    key (`loss`, `output`, `grad:<param>`) to the Var holding it.
    """

    blocks: list[Block] = field(default_factory=lambda: [Block(0)])
    feeds: list[str] = field(default_factory=list)
    fetches: dict[str, str] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    @property
    def global_block(self) -> Block:
        return self.blocks[0]

    def find_var(self, name: str, block_idx: int = 0) -> Var | None:
        """Look a Var up in a block, then in its ancestors."""
        while block_idx >= 0:
            block = self.blocks[block_idx]
            if name in block.vars:
                return block.vars[name]
            block_idx = block.parent_idx
        return None

    def var(self, name: str, block_idx: int = 0) -> Var:
        found = self.find_var(name, block_idx)
        if found is None:
            raise KeyError(f"no Var named {name!r} in block {block_idx} or its ancestors")
        return found

    def all_vars(self) -> Iterator[Var]:
        for block in self.blocks:
            yield from block.vars.values()

    def persistables(self) -> list[Var]:
        return [v for v in self.all_vars() if v.persistable]

    def new_block(self, parent_idx: int) -> Block:
        block = Block(len(self.blocks), parent_idx)
        self.blocks.append(block)
        return block

    def walk_ops(self) -> Iterator[tuple[Block, Op]]:
        """Every op of every block, block by block in program order."""
        for block in self.blocks:
            for op in block.ops:
                yield block, op

    def num_ops(self) -> int:
        return sum(len(b.ops) for b in self.blocks)

    def repoint_forward_ops(self, replacements: dict[str, str | None]) -> None:
        """After removing ops: backward ops that named a removed forward op name its replacement (or none)."""
        for _, op in self.walk_ops():
            target = op.attrs.get("forward_op")
            if target in replacements:
                if replacements[target] is None:
                    del op.attrs["forward_op"]
                else:
                    op.attrs["forward_op"] = replacements[target]

    def rename_reads(self, op: Op, mapping: dict[str, str]) -> None:
        """Point `op`'s Refs, and those of every op in its sub-block (recursively), at other Vars."""
        op.rename_inputs(mapping)
        if op.sub_block is not None:
            for inner in self.blocks[op.sub_block].ops:
                self.rename_reads(inner, mapping)

    def clone(self) -> "Program":
        """An independent copy (every pass works on one, so history snapshots stay intact).

        Structural rather than `copy.deepcopy`: op arguments hold lists, dicts, tuples and immutable leaves (numbers,
        strings, Refs, dtypes, sympy expressions), so copying the containers is enough, at a fraction of the cost.
        """
        clone = copy.copy(self)
        clone.blocks = [_copy_dataclass(block) for block in self.blocks]
        clone.feeds, clone.fetches, clone.metadata = list(self.feeds), dict(self.fetches), copy.deepcopy(self.metadata)
        return clone

    def unique_name(self, base: str) -> str:
        """A Var/op name not used anywhere in the program: `base`, `base_1`, `base_2`, …"""
        taken = {v.name for v in self.all_vars()} | {op.name for _, op in self.walk_ops()}
        if base not in taken:
            return base
        i = 1
        while f"{base}_{i}" in taken:
            i += 1
        return f"{base}_{i}"

    def __str__(self) -> str:
        from fleetc.ir.printer import format_program

        return format_program(self)

    @staticmethod
    def parse(text: str) -> "Program":
        """The Program `str(program)` printed (the text form; docs/ir.md). Raises ProgramParseError."""
        from fleetc.ir.parser import parse_program

        return parse_program(text)
