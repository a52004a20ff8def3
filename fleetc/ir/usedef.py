"""Use-def information of one block, kept up to date as a pass edits it (MLIR use lists, FX `node.users`).

`UseDef` knows, for every Var the block's ops touch, which ops read it and which write it, and for every op its
position. It is built once per block (one walk) and updated locally by each edit (`replace`, `rename`), so a pass
that matches and rewrites the whole block costs time linear in its size instead of rescanning the block per
rewrite. Removed ops leave an empty slot, so positions never shift; `compact` writes the surviving ops back.

`Names` hands out fresh Var/op names from one scan of the Program (`Program.unique_name` rescans per call).

`check_consistent` compares an index with one rebuilt from scratch; with `CHECK` on (tests/conftest.py turns it
on) every `compact()` runs it through the IR verifier, so a pass that edits the block behind the index's back,
or updates the index wrongly, fails the test that runs it.

Across passes: while the pass manager runs its one live Program (`keeping(program)`), a pass that edits the block
only through its index hands the index on (`hand_on`, after its last edit), and the next pass may start from it
(`handed_on`) instead of walking the block again. After each pass the manager calls `pass_done`: only the indexes that
pass handed on survive, so an index never outlives a pass that might have edited the block without it. Programs
with sub-blocks keep none: a rename in one block rewrites reads inside another's ops. With `CHECK` on, a kept index
is verified when a pass takes it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

from fleetc.ir.liveness import block_reads
from fleetc.ir.program import Block, Op, Program

CHECK = False  # verify the index against the block at every compact() (tests)


class Names:
    """Every Var and op name in a Program; `fresh(base)` returns `base`, `base_1`, … not yet taken, and takes it."""

    def __init__(self, program: Program):
        self.taken = {v.name for v in program.all_vars()} | {op.name for _, op in program.walk_ops()}

    def fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self.taken:
            i += 1
            name = f"{base}_{i}"
        self.taken.add(name)
        return name


class UseDef:
    """Readers, writers and position of every op of one block (a sub-block-owning op reads what its sub-block
    reads from outside, and writes what it writes)."""

    def __init__(self, program: Program, block: Block):
        self.program, self.block = program, block
        self.built_from = (block.ops, len(block.ops))  # the block's op list, which only compact() may replace
        self.slots: list[Op | None] = list(block.ops)
        self.position: dict[str, int] = {op.name: i for i, op in enumerate(block.ops)}
        self.readers: dict[str, list[Op]] = {}
        self.writers: dict[str, list[Op]] = {}
        for op in block.ops:
            self._add(op)

    @classmethod
    def sharing(cls, other: UseDef) -> UseDef:
        """A plain index over `other`'s state (the same tables, not copies)."""
        new = object.__new__(cls)
        new.share(other)
        return new

    def share(self, other: UseDef) -> None:
        """Take `other`'s tables (not copies) as this index's: edits through either show in both."""
        for name in ("program", "block", "built_from", "slots", "position", "readers", "writers"):
            setattr(self, name, getattr(other, name))

    def _add(self, op: Op) -> None:
        for name in block_reads(self.program, op):
            self.readers.setdefault(name, []).append(op)
        for name in op.defined:
            self.writers.setdefault(name, []).append(op)

    def _remove(self, op: Op) -> None:
        for name in block_reads(self.program, op):
            self.readers[name].remove(op)
            if not self.readers[name]:
                del self.readers[name]
        for name in op.defined:
            self.writers[name].remove(op)
            if not self.writers[name]:
                del self.writers[name]

    def definer(self, name: str) -> Op | None:
        """The first op of the block writing `name` (a temporary's one definer), or None."""
        writers = self.writers.get(name)
        return writers[0] if writers else None

    def live(self, op: Op) -> bool:
        """Whether `op` is (still) one of this block's ops."""
        at = self.position.get(op.name)
        return at is not None and self.slots[at] is op

    def ops(self) -> list[Op]:
        """The block's current ops, in order."""
        return [op for op in self.slots if op is not None]

    def replace(self, group: list[Op], new: Op, at: int) -> None:
        """Empty the slots of `group`'s ops and put `new` in slot `at` (which must be one of them, or empty)."""
        for op in group:
            self._remove(op)
            self.slots[self.position.pop(op.name)] = None
        if self.slots[at] is not None:
            raise ValueError(f"slot {at} holds {self.slots[at].name!r}, which the replaced group does not include")
        self.slots[at] = new
        self.position[new.name] = at
        self._add(new)

    def rename(self, old: str, new: str) -> None:
        """Point every reader of `old` at `new` (inside sub-blocks too)."""
        for reader in self.readers.pop(old, []):
            self.program.rename_reads(reader, {old: new})
            self.readers.setdefault(new, []).append(reader)

    def compact(self) -> None:
        """Write the surviving ops, in order, back to the block, and number them afresh (an index kept for the next
        pass is then the one a fresh walk would build)."""
        if CHECK:
            from fleetc.ir.verifier import verify_usedef

            verify_usedef(self)
        self.slots = self.ops()
        self.position = {op.name: i for i, op in enumerate(self.slots)}
        self.block.ops = list(self.slots)
        self.built_from = (self.block.ops, len(self.block.ops))


class _Kept:
    """The indexes kept for one live Program during one pass-manager run: block index → UseDef, as the previous
    pass handed them on (`blocks`) and as the running pass hands them on (`handed`)."""

    def __init__(self, program: Program):
        self.program = program
        self.blocks: dict[int, UseDef] = {}
        self.handed: dict[int, UseDef] = {}


_state = threading.local()  # .kept: the current thread's _Kept (pipeline ranks may compile on threads)


def _current() -> _Kept | None:
    return getattr(_state, "kept", None)


@contextlib.contextmanager
def keeping(program: Program) -> Iterator[None]:
    """While open (the pass manager's run), indexes of `program`'s blocks may be handed from pass to pass."""
    outer, _state.kept = _current(), _Kept(program)
    try:
        yield
    finally:
        _state.kept = outer


def pass_done(program: Program) -> None:
    """A pass finished and returned `program` (the live Program from now on): the next pass may take only the
    indexes this one handed on for it."""
    kept = _current()
    if kept is not None:
        handed = kept.handed if program is kept.program else {}
        kept.program, kept.blocks, kept.handed = program, handed, {}


def handed_on(program: Program, block: Block) -> UseDef | None:
    """The index a previous pass kept for `block` of `program`, while it still stands for the block's op list."""
    kept = _current()
    if kept is None or kept.program is not program:
        return None
    usedef = kept.blocks.get(block.idx)
    if (usedef is None or usedef.block is not block or usedef.built_from[0] is not block.ops
            or usedef.built_from[1] != len(block.ops)):
        return None
    if CHECK:
        from fleetc.ir.verifier import verify_usedef

        verify_usedef(usedef)
    return usedef


def hand_on(usedef: UseDef) -> None:
    """Hand a compacted index on to the next pass, when the manager runs its Program and it has no sub-blocks."""
    kept = _current()
    if kept is not None and kept.program is usedef.program and len(usedef.program.blocks) == 1:
        kept.handed[usedef.block.idx] = UseDef.sharing(usedef)


def withdraw(program: Program) -> None:
    """`program` was edited after its pass handed an index on, not through that index: the next pass builds its own."""
    kept = _current()
    if kept is not None and kept.program is program:
        kept.handed = {}


def check_consistent(usedef: UseDef) -> str | None:
    """None when `usedef` matches its current ops exactly (positions in order, readers, writers) as an index
    rebuilt from scratch would; else what differs."""
    block_ops, length = usedef.built_from
    if usedef.block.ops is not block_ops or len(block_ops) != length:
        return "the block's op list was changed directly, not through the index (compact() would lose the change)"
    ops = usedef.ops()
    fresh = UseDef(usedef.program, dataclasses.replace(usedef.block, ops=ops))
    position = usedef.position
    if len(position) != len(ops) or any(op.name not in position or usedef.slots[position[op.name]] is not op
                                        for op in ops):
        return "positions do not match the slots the ops stand in"
    for what, got, expected in (("readers", usedef.readers, fresh.readers), ("writers", usedef.writers, fresh.writers)):
        got_names, expected_names = _names(got), _names(expected)
        if got_names != expected_names:
            wrong = sorted(n for n in set(got_names) | set(expected_names)
                           if got_names.get(n) != expected_names.get(n))
            return (f"{what} of {wrong[:5]} disagree with the ops: index has {got_names.get(wrong[0])}, "
                    f"the ops give {expected_names.get(wrong[0])}")
    return None


def _names(table: dict[str, list[Op]]) -> dict[str, list[str]]:
    return {name: sorted(op.name for op in ops) for name, ops in table.items() if ops}
