"""Removes ops that only re-expose a value: detach, clone/copy of a temporary, same-shape views, t(t(x))."""
from __future__ import annotations

from typing import Any

from fleetc.ir.program import Op, Program, Ref, VarKind
from fleetc.passes.base import PassReport
from fleetc.passes.cleanup.dce import drop_unused_temporaries

_IDENTITY = {"aten.detach.default", "aten.alias.default", "aten.clone.default", "aten.lift_fresh_copy.default",
             "aten._to_copy.default"}
# Fed values never change during a step, so a no-op of one can be replaced by the value itself.
_FORWARDABLE = {VarKind.TEMP, VarKind.DATA, VarKind.HYPER}
_RESHAPES = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.expand.default"}


def _same_value_source(program: Program, op: Op, transposed_from: dict[str, str]) -> str | None:
    """The Var that `op`'s single output always equals, when the op is a no-op."""
    if len(op.outputs) != 1 or op.outputs[0] is None or not op.args or not isinstance(op.args[0], Ref):
        return None
    src, out = program.var(op.args[0].name), program.var(op.outputs[0])
    same = (src.shape, src.dtype, src.device) == (out.shape, out.dtype, out.device)
    if op.type in _IDENTITY and same and op.kwargs.get("memory_format") is None:
        return src.name
    if op.type in _RESHAPES and same:
        return src.name
    if op.type == "aten.t.default" and src.name in transposed_from:
        return transposed_from[src.name]
    return None


class RemoveNoopViews:
    name = "remove_noop_views"
    enabled_by = None  # always in the order: it decides for itself whether there is work
    summary = "forward the input of value-preserving ops (detach, clone of temporaries, same-shape views, t∘t)"
    reads: tuple[str, ...] = ()

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        block = program.global_block
        fetched = set(program.fetches.values())
        parent: dict[str, str] = {}

        def root(name: str) -> str:
            while name in parent:
                name = parent[name]
            return name

        transposed_from: dict[str, str] = {}
        removed: set[int] = set()
        for i, op in enumerate(block.ops):
            src = _same_value_source(program, op, transposed_from)
            out = op.outputs[0] if op.outputs else None
            if src is not None and program.var(src).kind in _FORWARDABLE and program.var(out).kind is VarKind.TEMP:
                a, b = root(src), root(out)
                if not (a in fetched and b in fetched):
                    parent[b] = a
                    removed.add(i)
                    report.count(op.type.split(".")[1] + "_removed")
                    continue
            if op.type == "aten.t.default" and isinstance(op.args[0], Ref):
                transposed_from[op.outputs[0]] = root(op.args[0].name)
        if not removed:
            return program, report
        classes: dict[str, list[str]] = {}
        for name in list(parent):
            classes.setdefault(root(name), []).append(name)
        rename = {}
        for rep, members in classes.items():
            group = [rep, *members]
            # The surviving name: a fed Var's (it cannot be renamed), else fetched, else semantic (`w@GRAD`).
            if program.var(rep).kind is not VarKind.TEMP:
                best = rep
            else:
                best = next((n for n in group if n in fetched), None) or next((n for n in group if "@" in n), rep)
            rename.update({n: best for n in group if n != best})
        removed_ops = [op for i, op in enumerate(block.ops) if i in removed]
        block.ops = [op for i, op in enumerate(block.ops) if i not in removed]
        for op in block.ops:
            program.rename_reads(op, rename)  # and the reads inside its sub-block
            op.outputs = [rename.get(o, o) for o in op.outputs]
        definer = {name: op.name for op in block.ops for name in op.defined}
        program.repoint_forward_ops({op.name: definer.get(rename.get(op.outputs[0], op.outputs[0]))
                                     for op in removed_ops})
        program.fetches = {key: rename.get(name, name) for key, name in program.fetches.items()}
        drop_unused_temporaries(program)
        report.changed = True
        return program, report
