"""Optimizer fusion (`fuse_all_optimizer_ops`): per-parameter fleetc.sgd / adam / lars_momentum / lamb ops →
one multi-tensor fleetc.fused_* op per (dtype, device, hyperparameters) group. Traced updates (other
torch.optim optimizers) are many aten ops per parameter and stay as they are (a note says so).

Every block is fused on its own (a group never spans blocks), so updates that AMP's skip-on-overflow or
gradient merge moved into a `fleetc.conditional_block` sub-block are fused there.
"""
from __future__ import annotations

from typing import Any

from fleetc.ir.liveness import block_reads, block_writes
from fleetc.ir.program import Block, Op, OpRole, Program
from fleetc.passes.base import PassReport

# op type → (fused op type, how many leading per-parameter arguments become lists)
_FUSABLE = {"fleetc.sgd": ("fleetc.fused_sgd", 4), "fleetc.adam": ("fleetc.fused_adam", 5),
            "fleetc.lars_momentum": ("fleetc.fused_lars_momentum", 4), "fleetc.lamb": ("fleetc.fused_lamb", 6)}


def _group_key(program: Program, block: Block, op: Op) -> tuple:
    n_lists = _FUSABLE[op.type][1]
    param = program.var(op.args[0].name, block.idx)
    has_buffer = op.args[2] is not None
    return (op.type, param.dtype, param.device, has_buffer, repr(op.args[n_lists:]), op.attrs.get("op_device", ""))


def fused_order(program: Program, ops: list[Op], members: list[Op], fused: Op) -> list[Op] | str:
    """`ops` with `members` replaced by `fused`, or why that would change what the block computes.

    The fused op stands where the last member stood, so every gradient it reads exists by then. The
    ops between the members that use what an earlier member writes (e.g. use_pure_fp16's rounding of
    an updated master weight into its parameter), and the ops that in turn depend on those, move right
    after the fused op, keeping their order.
    """
    position = {op.name: i for i, op in enumerate(ops)}
    member_names = {m.name for m in members}
    first, last = position[members[0].name], position[members[-1].name]
    later_reads: set[str] = set()  # what the members and moved ops seen so far read and write
    later_writes: set[str] = set()
    staying: list[Op] = []
    moved: list[tuple[Op, set[str], set[str]]] = []
    for op in ops[first:last + 1]:
        reads, writes = set(block_reads(program, op)), set(block_writes(program, op))
        if op.name in member_names:
            for other, other_reads, other_writes in moved:
                clash = (reads | writes) & other_writes or writes & other_reads
                if clash:
                    return (f"{other.name} ({other.type}) uses {sorted(clash)[0]!r} after the update of "
                            f"{members[0].args[0].name!r} and before that of {op.args[0].name!r}")
        elif (reads | writes) & later_writes or writes & later_reads:
            moved.append((op, reads, writes))
        else:
            staying.append(op)
            continue
        later_reads |= reads
        later_writes |= writes
    return [*ops[:first], *staying, fused, *(op for op, _, _ in moved), *ops[last + 1:]]


class FuseOptimizerOps:
    name = "fuse_all_optimizer_ops"
    enabled_by = 'build_strategy.fuse_all_optimizer_ops'
    summary = ("per-parameter sgd/adam/lars/lamb updates → one multi-tensor fused update per "
               "dtype/device/hyperparameter group")
    reads = ("build_strategy.fuse_all_optimizer_ops",)

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        for block in program.blocks:
            fused = self._fuse_block(program, block, report)
            if fused and block.idx != 0:
                owner = next(op.name for _, op in program.walk_ops() if op.sub_block == block.idx)
                report.notes.append(f"block {block.idx} (the sub-block of {owner}): {fused} fused update op(s)")
        report.changed = "fused_ops" in report.stats
        traced = program.metadata.get("optimizer", {}).get("traced", 0)
        if traced:
            report.notes.append(f"{traced} traced update(s) of {program.metadata['optimizer']['type']} (aten ops per "
                                "parameter) have no multi-tensor form and are not fused")
        if not report.changed and "groups_not_fused" not in report.stats:
            report.skipped_reason = ("flag on, but the Program has no fleetc.sgd / adam / lars_momentum / lamb update "
                                     "ops" + (f" (its {traced} updates are traced aten ops)" if traced else ""))
        return program, report

    def _fuse_block(self, program: Program, block: Block, report: PassReport) -> int:
        """Fuse each group of one block's update ops (groups in order of their first member); returns how many."""
        groups: dict[tuple, list[Op]] = {}
        for op in block.ops:
            if op.type in _FUSABLE:
                groups.setdefault(_group_key(program, block, op), []).append(op)
        fused_count = 0
        for members in groups.values():
            fused = self._fuse(program, members)
            ops = fused_order(program, block.ops, members, fused)
            if isinstance(ops, str):
                report.count("groups_not_fused")
                report.notes.append(f"block {block.idx}: {len(members)} {members[0].type} ops not fused: {ops}")
                continue
            block.ops = ops
            program.repoint_forward_ops(dict.fromkeys((m.name for m in members), fused.name))
            fused_count += 1
            report.count("fused_ops")
            report.count("params_fused", len(members))
            report.count("ops_removed", len(members) - 1)
        return fused_count

    @staticmethod
    def _fuse(program: Program, members: list[Op]) -> Op:
        first = members[0]
        fused_type, n_lists = _FUSABLE[first.type]
        lists = [[m.args[i] for m in members] for i in range(n_lists)]
        if first.type == "fleetc.sgd" and first.args[2] is None:
            lists[2] = None
        outputs = [name for m in members for name in m.outputs]
        role = int(OpRole.OPTIMIZE)
        name = program.unique_name(f"{fused_type.split('.')[1]}_{len(members)}_params")
        return Op(name, fused_type, (*lists, *first.args[n_lists:]), outputs=outputs,
                  attrs={"op_role": role, "module_path": "", "provenance": FuseOptimizerOps.name,
                         "fused_from": [m.name for m in members],
                         **({"op_device": first.attrs["op_device"]} if "op_device" in first.attrs else {})})
