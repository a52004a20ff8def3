"""What a recompute plan is, and the view of the forward region of a Program every planner works from."""
from __future__ import annotations

from dataclasses import dataclass, field

from fleetc.ir.liveness import block_reads
from fleetc.ir.program import Block, Op, OpRole, Program, VarKind
from fleetc.passes.recompute.policy import DROPOUT, Choice, RecomputePolicy


@dataclass
class RecomputePlan:
    """Which forward values backward reads from forward (`saved`); every other one it needs is re-run.

    `group_of` maps a forward op to its recompute group (a segment between checkpoints): the needed
    ops of a group are re-emitted together, before the first op after forward that needs one of them.
    Ops without a group are re-emitted one by one, just in time.
    """

    saved: frozenset[str]
    group_of: dict[str, int] = field(default_factory=dict)
    checkpoints: tuple[str, ...] = ()
    kept_across: dict[str, str] = field(default_factory=dict)  # value kept across a boundary → suggestion
    notes: list[str] = field(default_factory=list)
    label: str = ""
    reused_blocks: list[str] = field(default_factory=list)  # how many repeated blocks took a plan made once


@dataclass
class ForwardRegion:
    """The forward ops of the global block (everything before the first backward op) and their values."""

    program: Program
    block: Block
    ops: list[Op]
    end: int  # position in the block of the first op after forward
    index: dict[str, int]  # forward op name → position
    producer: dict[str, Op]  # forward temporary → the forward op defining it
    read_after: set[str]  # forward temporaries read after forward (by backward/optimize ops) or fetched
    choices: dict[str, Choice]  # forward op name → what the policy allows

    def recompute_inputs(self, op: Op) -> list[str]:
        """Forward temporaries a re-run of `op` reads (a replayed dropout reads its input and saved mask)."""
        names = [op.args[0].name, op.outputs[1]] if op.type == DROPOUT else op.inputs
        return [n for n in names if n in self.producer]

    def must_save(self, name: str) -> bool:
        """Values that are never re-run: results of MUST_SAVE ops, dropout masks, and fetched values."""
        op = self.producer[name]
        if op.type == DROPOUT:  # its output is replayed from the mask, unless capture dropped the mask
            return name != op.outputs[0] or op.outputs[1] is None
        return self.choices[op.name] is Choice.MUST_SAVE or name in self.program.fetches.values()

    def closure(self, names: set[str], saved: frozenset[str]) -> set[str]:
        """Names of the forward ops to re-run so that every value in `names` exists again, given `saved`."""
        needed_ops: set[str] = set()
        stack = [n for n in names if n not in saved]
        while stack:
            op = self.producer[stack.pop()]
            if op.name in needed_ops:
                continue
            needed_ops.add(op.name)
            stack += [n for n in self.recompute_inputs(op) if n not in saved]
        return needed_ops


def forward_region(program: Program, policy: RecomputePolicy) -> ForwardRegion:
    """Split the global block at its first backward op and classify the forward ops with `policy`."""
    block = program.global_block
    first_backward = next((i for i, op in enumerate(block.ops) if OpRole.BACKWARD in op.role), len(block.ops))
    ops = [op for op in block.ops[:first_backward] if OpRole.FORWARD in op.role]
    written = frozenset(n for op in block.ops if OpRole.OPTIMIZE not in op.role for n in op.defined
                        if program.var(n).kind is not VarKind.TEMP)
    producer = {n: op for op in ops for n in op.defined if program.var(n).kind is VarKind.TEMP}
    read_after = {n for op in block.ops[first_backward:] for n in block_reads(program, op) if n in producer}
    read_after |= {n for n in program.fetches.values() if n in producer}
    choices = {op.name: policy.choose(program, block, op, written) for op in ops}
    index = {op.name: i for i, op in enumerate(ops)}
    return ForwardRegion(program, block, ops, first_backward, index, producer, read_after, choices)


def recompute_cost(region: ForwardRegion, plan: RecomputePlan, policy: RecomputePolicy) -> float:
    """Estimated FLOPs of the forward ops `plan` re-runs (the rewrite emits exactly these)."""
    return sum(policy.cost(region.program, region.ops[region.index[name]])
               for name in region.closure(region.read_after, plan.saved))
