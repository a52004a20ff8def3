"""The dependency graph of a block's ops, which the multi-threaded scheduler runs in any order consistent with it.

Two ops are ordered (in Program order) when they touch the same storage and at least one of them writes it:
read-after-write, write-after-read and write-after-write. Storage is tracked per alias root: a view (`aten.t`,
`aten.view`, an out= overload) shares its base's root, so writing a view orders against readers of the base. What an
op writes: the Vars it defines, the arguments an aten schema marks as written (`add_`, `out=`) and, for a
conditional block, everything its sub-block writes (the block runs as one node, so the ops inside it are ordered by
their control dependency on the condition). Two hidden resources are ordered like written Vars:

- the default random generator, for ops that draw from it (aten ops tagged `nondeterministic_seeded`, fleetc ops
  registered with `draws_random=True`), so every draw sees the same generator state as in Program order;
- the communication stream: collective and P2P ops (op role `collective`) form one total order, so every rank
  issues them in the same order (gloo aborts when ranks disagree); a collective op writes every Var it reads,
  as a bucket fill copies into its buffer.

A reader of a view reads both the view's name (waiting for its definition) and its root. Defining a view writes
only the view's name, not the storage (its base's readers need not wait for it); fleetc ops write only the Vars they
define (persistables are updated in place and named among the outputs: fleetc/ir/registry.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from fleetc.ir.liveness import aliased_input, block_reads, mutated_inputs
from fleetc.ir.program import Block, Op, OpRole, Program
from fleetc.ir.registry import op_def, resolve_callable

RNG = "<default generator>"
COMM = "<communication stream>"


@functools.cache
def draws_random(op_type: str) -> bool:
    """Whether ops of this type advance the default random generator."""
    try:
        if op_type.startswith("fleetc."):
            return op_def(op_type).draws_random
        return torch.Tag.nondeterministic_seeded in resolve_callable(op_type).tags
    except (KeyError, AttributeError):
        return True  # unknown: ordered, to be safe


def _nested_ops(program: Program, op: Op) -> list[Op]:
    """`op` and, for a conditional block, every op inside it (recursively)."""
    ops = [op]
    if op.sub_block is not None:
        for inner in program.blocks[op.sub_block].ops:
            ops += _nested_ops(program, inner)
    return ops


def is_collective(program: Program, op: Op) -> bool:
    """A collective / P2P op, or a conditional block containing one."""
    return any(OpRole.COLLECTIVE in inner.role for inner in _nested_ops(program, op))


@dataclass
class Node:
    """One schedulable op: what it reads and writes (alias roots), and its edges."""

    op: Op
    reads: frozenset[str]
    writes: frozenset[str]
    collective: bool
    successors: list[int] = field(default_factory=list)
    predecessors: int = 0


def _writes(op: Op, roots: dict[str, str]) -> set[str]:
    """What one op (not its sub-block) writes: the Vars it defines (a view: only its own name, which readers of the
    view wait for) and the storage of the arguments it mutates."""
    return set(op.defined) | {roots.get(n, n) for n in mutated_inputs(op)}


def alias_roots(program: Program, block: Block) -> dict[str, str]:
    """Var name → the Var whose storage it shares (itself when it owns its storage), across nested blocks."""
    root: dict[str, str] = {}
    for op in block.ops:
        for inner in _nested_ops(program, op):
            for j, name in enumerate(inner.outputs):
                base = aliased_input(inner, j) if name is not None else None
                if base is not None:
                    root[name] = root.get(base, base)
    return root


def build_graph(program: Program, block: Block) -> list[Node]:
    """One Node per op of `block`, with an edge wherever Program order must be kept (see the module docstring)."""
    roots = alias_roots(program, block)
    nodes: list[Node] = []
    for op in block.ops:
        inner_ops = _nested_ops(program, op)
        reads = {r for n in block_reads(program, op) for r in (n, roots.get(n, n))}
        writes = set().union(*(_writes(inner, roots) for inner in inner_ops))
        collective = is_collective(program, op)
        if collective:
            writes |= reads | {COMM}
        if any(draws_random(inner.type) for inner in inner_ops if inner.type != "fleetc.conditional_block"):
            writes.add(RNG)
        nodes.append(Node(op, frozenset(reads - writes), frozenset(writes), collective))
    last_writer: dict[str, int] = {}
    readers_since_write: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        preds: set[int] = set()
        for name in node.reads:
            if name in last_writer:
                preds.add(last_writer[name])
        for name in node.writes:
            if name in last_writer:
                preds.add(last_writer[name])
            preds.update(readers_since_write.get(name, ()))
        for name in node.reads:
            readers_since_write.setdefault(name, []).append(i)
        for name in node.writes:
            last_writer[name] = i
            readers_since_write[name] = []
        preds.discard(i)
        for p in sorted(preds):
            nodes[p].successors.append(i)
        node.predecessors = len(preds)
    return nodes
