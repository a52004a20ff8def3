"""Optimizer fusion (`fuse_all_optimizer_ops`): per-parameter fleetc.sgd / fleetc.adam ops → one
multi-tensor fleetc.fused_sgd / fleetc.fused_adam op per (dtype, device, hyperparameters) group."""
from __future__ import annotations

from typing import Any

from fleetc.ir.program import Op, OpRole, Program
from fleetc.passes.base import PassReport

# op type → (fused op type, how many leading per-parameter arguments become lists)
_FUSABLE = {"fleetc.sgd": ("fleetc.fused_sgd", 3), "fleetc.adam": ("fleetc.fused_adam", 5)}


def _group_key(program: Program, op: Op) -> tuple:
    n_lists = _FUSABLE[op.type][1]
    param = program.var(op.args[0].name)
    has_buffer = op.args[2] is not None
    return (op.type, param.dtype, param.device, has_buffer, repr(op.args[n_lists:]), op.attrs.get("op_device", ""))


class FuseOptimizerOps:
    name = "fuse_all_optimizer_ops"
    summary = "per-parameter sgd/adam updates → one multi-tensor fused update per dtype/device/hyperparameter group"
    reads = ("build_strategy.fuse_all_optimizer_ops",)

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        block = program.global_block
        groups: dict[tuple, list[Op]] = {}
        for op in block.ops:
            if op.type in _FUSABLE:
                groups.setdefault(_group_key(program, op), []).append(op)
        # The fused op stands where the group's last member stood: every gradient it reads exists by then.
        last_member = {members[-1].name: members for members in groups.values()}
        fused_names = {}
        ops = []
        for op in block.ops:
            if op.name in last_member:
                members = last_member[op.name]
                fused = self._fuse(program, members)
                fused_names.update(dict.fromkeys((m.name for m in members), fused.name))
                ops.append(fused)
                report.count("fused_ops")
                report.count("params_fused", len(members))
                report.count("ops_removed", len(members) - 1)
            elif op.type not in _FUSABLE:
                ops.append(op)
        block.ops = ops
        program.repoint_forward_ops(fused_names)
        report.changed = bool(groups)
        if not groups:
            report.skipped_reason = "flag on, but the Program has no fleetc.sgd / fleetc.adam update ops"
        return program, report

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
