"""The worker Program of a parameter-server job (`metadata["parameter_server"]`, stamped by fleet's PS trainer).

sync / async: each `aten.embedding` lookup of a table becomes `fleetc.ps_pull_sparse(ids, table)` (just the
batch's rows), and its `aten.embedding_dense_backward` disappears: the row gradients (ids, grad of the lookup)
go to the servers as they are. Dense parameters are refreshed by one `fleetc.ps_pull_dense` before the first op;
the optimize section is removed (servers run the update) and one `fleetc.ps_push` sends the dense gradients and
row gradients after backward. An `aten._embedding_bag` of a table (nn.EmbeddingBag) reduces the pulled rows
instead of the table (`ids` replaced by their positions 0..n-1), and its backward gives the n row gradients
pushed. Evaluation Programs get the pulls only.

geo: the worker trains locally with its own update; `fleetc.ps_geo_note_rows` records the rows each lookup
trains and `fleetc.ps_geo_sync` at the end sends the deltas every k steps and pulls the servers' values.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from fleetc.comm.ps import ops as _ps_ops  # noqa: F401  (registers the ps ops)
from fleetc.errors import PassError
from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind
from fleetc.passes.base import PassReport

EMBEDDING = "aten.embedding.default"
EMBEDDING_BACKWARD = "aten.embedding_dense_backward.default"
EMBEDDING_BAG = ("aten._embedding_bag.default", "aten._embedding_bag_forward_only.default")
EMBEDDING_BAG_BACKWARD = "aten._embedding_bag_backward.default"
SUM = "aten.add.Tensor"
GRAD_SUFFIX = "@GRAD"
# What other rewrites a PS Program cannot take: their metadata key → why. In geo mode the worker runs its own
# update, so only local SGD is refused there.
_INCOMPATIBLE = {"local_sgd": "local SGD: it averages parameters over collective data-parallel ranks, and a "
                              "parameter-server job has none (geo mode is PS's own form of local training)"}
_INCOMPATIBLE_SYNC_ASYNC = {
    "grad_clip": "gradient clipping: the servers run the update on the pushed gradients, and no server sees the "
                 "whole gradient whose norm the clip needs (each holds some parameters, and in sync mode the "
                 "workers' gradients are only averaged there); geo mode (a_sync_configs.k_steps > 0) clips locally",
}
AMP_REFUSED = ("AMP (strategy.amp): the servers run the update on the pushed gradients, and AMP's loss-scaled "
               "gradients, its skip of steps with inf/nan and its loss-scaling update belong to that update; not "
               "built for the servers. Geo mode (a_sync_configs.k_steps > 0) runs AMP's update locally")


def ps_metadata(program: Program) -> dict | None:
    """The parameter-server settings a Program was compiled with, or None outside a PS job."""
    return program.metadata.get("parameter_server")


def _attrs(op: Op | None, role: OpRole, module_path: str = "") -> dict:
    return {"op_role": int(role), "provenance": "parameter_server",
            "module_path": op.module_path if op is not None else module_path}


class ParameterServerRewrite:
    name = "parameter_server"
    enabled_by = None  # always in the order: does nothing outside a parameter-server job
    summary = "pull parameters from the servers (table rows by id), push gradients or geo deltas to them"
    reads = ("a_sync", "a_sync_configs.k_steps", "execution_strategy.use_thread_barrier")

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        settings = ps_metadata(program)
        if settings is None:  # collective or single-process training: a_sync is reported by resolve_conflicts
            return program, report
        refused = {**_INCOMPATIBLE, **(_INCOMPATIBLE_SYNC_ASYNC if settings["mode"] != "geo" else {})}
        for key, what in refused.items():
            if key in program.metadata:
                raise PassError(f"parameter-server {settings['mode']} mode cannot be combined with {what}; "
                                "switch it off")
        if settings["mode"] != "geo" and any(op.attrs.get("provenance") == "amp" for _, op in program.walk_ops()):
            raise PassError(f"parameter-server {settings['mode']} mode cannot be combined with {AMP_REFUSED}; "
                            "switch it off")
        tables = dict(settings["placement"]["tables"])
        dense = dict(settings["placement"]["dense"])
        lookups = self._lookups(program, tables)
        if settings["mode"] == "geo":
            if program.metadata.get("kind") == "train":
                self._geo(program, lookups, report)
            else:
                report.skipped_reason = "geo: evaluation reads the worker's local parameters"
            report.changed = program.metadata.get("kind") == "train"
            return program, report
        self._sparse_pulls(program, lookups, report)
        pulled = self._dense_pull(program, dense, report)
        if program.metadata.get("kind") == "train":
            self._push(program, lookups, dense, report)
        _drop_unused_state(program)
        report.changed = bool(lookups or pulled)
        report.notes.append(f"{settings['mode']} mode: {len(tables)} table(s) row-sharded over "
                            f"{settings['placement']['server_num']} server(s), {len(dense)} dense parameter(s)")
        return program, report

    # ----- analysis --------------------------------------------------------------------------
    @staticmethod
    def _lookups(program: Program, tables: dict) -> list[Op]:
        """The embedding lookups of tables; PassError when a table is read any other way."""
        lookups = []
        for _, op in program.walk_ops():
            read = [n for n in op.inputs if n in tables]
            if not read:
                continue
            if op.type == EMBEDDING and op.args[0] == Ref(read[0]) and len(read) == 1:
                if len(op.args) > 3 and op.args[3]:
                    raise PassError(f"{op.attrs.get('source', op.name)}: embedding {read[0]!r} uses "
                                    "scale_grad_by_freq, which parameter-server tables do not support")
                lookups.append(op)
            elif op.type in EMBEDDING_BAG and op.args[0] == Ref(read[0]) and len(read) == 1:
                _check_bag(op, read[0])
                lookups.append(op)
            elif OpRole.OPTIMIZE not in op.role:
                raise PassError(f"{op.attrs.get('source') or op.name}: op {op.name} ({op.type}) reads the embedding "
                                f"table {read[0]!r}; parameter-server tables are row-sharded on the servers and may "
                                "only be used through nn.Embedding lookups")
        return lookups

    # ----- sync / async ----------------------------------------------------------------------
    @staticmethod
    def _sparse_pulls(program: Program, lookups: list[Op], report: PassReport) -> None:
        for op in lookups:
            if op.type in EMBEDDING_BAG:
                _pull_bag_rows(program, op)
                report.count("sparse_pulls")
                continue
            table = op.args[0].name
            op.type, op.args, op.kwargs = "fleetc.ps_pull_sparse", (op.args[1], table), {}
            op.attrs["op_role"] = int(op.role | OpRole.COLLECTIVE)
            op.attrs["table"] = table
            report.count("sparse_pulls")

    @staticmethod
    def _dense_pull(program: Program, dense: dict, report: PassReport) -> list[str]:
        block = program.global_block
        read = {n for _, op in program.walk_ops() for n in op.inputs}
        names = [n for n in dense if n in block.vars and n in read]
        if names:
            pull = Op(program.unique_name("ps_pull_dense"), "fleetc.ps_pull_dense",
                      ([Ref(n) for n in names], names), {}, list(names), _attrs(None, OpRole.COLLECTIVE))
            block.ops.insert(0, pull)
            report.count("dense_pulled", len(names))
        return names

    @staticmethod
    def _push(program: Program, lookups: list[Op], dense: dict, report: PassReport) -> None:
        block = program.global_block
        kept, sparse, removed, dropped = _take_table_grads(program, lookups, lambda op: OpRole.OPTIMIZE in op.role)
        report.count("optimizer_ops_moved_to_servers", dropped)
        grads = [(n, n + GRAD_SUFFIX) for n in dense if n + GRAD_SUFFIX in block.vars
                 and block.vars[n + GRAD_SUFFIX].kind is VarKind.TEMP]
        lr = _learning_rate(program)
        settings = ps_metadata(program)
        merge = ({"merge_steps": settings["merge_steps"], "merge_avg": settings["merge_avg"]}
                 if settings.get("merge_steps", 1) > 1 else {})
        push = Op(program.unique_name("ps_push"), "fleetc.ps_push",
                  (lr, [Ref(g) for _, g in grads], [n for n, _ in grads], *_sparse_args(sparse)),
                  merge, [], _attrs(None, OpRole.COLLECTIVE))
        block.ops = [*kept, push]
        for name in removed:
            block.vars.pop(name, None)
        report.count("dense_grads_pushed", len(grads))
        report.count("sparse_grads_pushed", len(sparse))
        if merge:
            report.notes.append(f"gradient merge: ps_push sends the {'mean' if merge['merge_avg'] else 'sum'} of "
                                f"the gradients every {merge['merge_steps']} steps (the servers update then)")

    # ----- geo -------------------------------------------------------------------------------
    @staticmethod
    def _geo(program: Program, lookups: list[Op], report: PassReport) -> None:
        block = program.global_block
        _geo_lazy_tables(program, lookups, report)
        ops = []
        for op in block.ops:
            ops.append(op)
            if op in lookups:
                ops.append(Op(program.unique_name(f"{op.name}_note_rows"), "fleetc.ps_geo_note_rows",
                              (op.args[1], op.args[0].name), {}, [], _attrs(op, OpRole.COLLECTIVE)))
                report.count("rows_noted")
        params = [n for n, v in block.vars.items() if v.kind is VarKind.PARAM]
        ops.append(Op(program.unique_name("ps_geo_sync"), "fleetc.ps_geo_sync", ([Ref(n) for n in params], params),
                      {}, list(params), _attrs(None, OpRole.COLLECTIVE)))
        block.ops = ops
        report.count("geo_synced_params", len(params))
        report.notes.append(f"geo mode: local updates, deltas of {len(params)} parameter(s) sent every "
                            f"{ps_metadata(program)['k_steps']} step(s)")


def _take_table_grads(program: Program, lookups: list[Op], drop: Callable[[Op], bool]
                      ) -> tuple[list[Op], list[tuple[str, Ref, Ref, int]], set[str], int]:
    """Take the tables' gradients out of the global block: each lookup's dense backward goes (a bag's backward is
    rewritten to give the row gradients of its pulled rows), and so do the ops `drop` selects (optimizer updates).
    Returns the ops kept, the row gradients as (table, ids, grads, padding_idx), the Vars no op defines any more,
    and how many ops `drop` removed."""
    by_forward = {op.name: op for op in lookups}
    sparse: list[tuple[str, Ref, Ref, int]] = []
    removed: set[str] = set()
    kept: list[Op] = []
    dropped = 0
    for op in program.global_block.ops:
        if op.type == EMBEDDING_BACKWARD and op.attrs.get("forward_op") in by_forward:
            lookup = by_forward[op.attrs["forward_op"]]
            sparse.append((lookup.args[0].name if lookup.type == EMBEDDING else lookup.attrs["table"], op.args[1],
                           op.args[0], int(op.args[3])))
            removed.update(op.defined)
        elif op.type == EMBEDDING_BAG_BACKWARD and op.attrs.get("forward_op") in by_forward:
            lookup = by_forward[op.attrs["forward_op"]]
            removed.update(op.defined)
            sparse.append((lookup.attrs["table"], Ref(lookup.attrs["ids"]), _bag_row_grads(program, op, lookup), -1))
            kept.append(op)
        elif drop(op):
            dropped += 1
        elif removed & set(op.inputs):  # a table read twice: the sum of its lookups' gradients
            if op.type != SUM or not set(op.inputs) <= removed:
                raise PassError(f"op {op.name} ({op.type}) reads an embedding table's gradient; in parameter-server "
                                "mode only the table's row update may use it")
            removed.update(op.defined)
        else:
            kept.append(op)
    return kept, sparse, removed, dropped


def _sparse_args(sparse: list[tuple[str, Ref, Ref, int]]) -> tuple[list, list, list, list]:
    """The (ids, row grads, tables, padding_idx) lists of ps_push and ps_geo_update_rows."""
    return [s[1] for s in sparse], [s[2] for s in sparse], [s[0] for s in sparse], [s[3] for s in sparse]


def _geo_lazy_tables(program: Program, lookups: list[Op], report: PassReport) -> None:
    """Geo: update the rows an nn.Embedding lookup trained, lazily as the servers do (`ps_geo_update_rows`), instead
    of building a dense table gradient and updating every row each step. Not when gradient merge, clipping or AMP
    read the table's gradient (their local update stays dense) or a bag reads the table."""
    readers = [key for key in ("gradient_merge", "grad_clip") if key in program.metadata]
    if any(op.attrs.get("provenance") == "amp" for _, op in program.walk_ops()):
        readers.append("amp")
    if readers:
        report.notes.append(f"geo: the tables' local update stays dense ({', '.join(readers)} read their gradients)")
        return
    bagged = {op.args[0].name for op in lookups if op.type in EMBEDDING_BAG}
    embedded = [op for op in lookups if op.type == EMBEDDING and op.args[0].name not in bagged]
    tables = {op.args[0].name for op in embedded}
    if not tables:
        return
    kept, sparse, removed, dropped = _take_table_grads(
        program, embedded, lambda op: OpRole.OPTIMIZE in op.role and op.attrs.get("param") in tables)
    names = sorted(tables)
    update = Op(program.unique_name("ps_geo_update_rows"), "fleetc.ps_geo_update_rows",
                (_learning_rate(program), [Ref(n) for n in names], names, *_sparse_args(sparse)), {}, list(names),
                _attrs(None, OpRole.OPTIMIZE))
    block = program.global_block
    block.ops = [*kept, update]
    for name in removed:
        block.vars.pop(name, None)
    _drop_unused_state(program)
    report.count("tables_updated_lazily", len(names))
    report.count("table_optimizer_ops_replaced", dropped)


def _check_bag(op: Op, table: str) -> None:
    """The EmbeddingBag options a row-sharded table supports: any mode, without per-sample weights, padding_idx,
    scale_grad_by_freq or sparse=True (PassError naming the option)."""
    defaults = (None, None, None, False, 0, False, None, False, -1)  # aten._embedding_bag's trailing arguments
    args = (*op.args, *defaults[len(op.args):])
    for position, option in ((3, "scale_grad_by_freq"), (5, "sparse"), (6, "per_sample_weights"), (8, "padding_idx")):
        if args[position] not in (defaults[position], None):
            raise PassError(f"{op.attrs.get('source') or op.name}: EmbeddingBag {table!r} uses {option}, which "
                            "parameter-server tables do not support yet")


def _pull_bag_rows(program: Program, op: Op) -> None:
    """`_embedding_bag(table, ids, offsets, ...)` → `rows = ps_pull_sparse(ids, table)`, `local = arange(n)`,
    `_embedding_bag(rows, local, offsets, ...)`: the bag reduces the batch's pulled rows (each id's row at its
    position), so its outputs, and its backward on `local`, are those of the lookup in the whole table."""
    block = program.global_block
    table, ids = op.args[0].name, op.args[1].name
    count = program.var(ids).shape[0]
    if not isinstance(count, int):
        raise PassError(f"{op.attrs.get('source') or op.name}: EmbeddingBag {table!r} looks up a symbolic number of "
                        "ids; parameter-server bags need static shapes (compile with dynamic=False)")
    dim = program.var(table).shape[1]
    rows = block.add_var(Var(program.unique_name(f"{table}@ROWS"), (count, dim), program.var(table).dtype,
                             program.var(table).device, VarKind.TEMP)).name
    local = block.add_var(Var(program.unique_name(f"{table}@LOCAL_IDS"), (count,), "int64", "cpu",
                              VarKind.TEMP)).name
    pull = Op(program.unique_name(f"{op.name}_pull"), "fleetc.ps_pull_sparse", (Ref(ids), table), {}, [rows],
              {**_attrs(op, op.role | OpRole.COLLECTIVE), "table": table})
    arange = Op(program.unique_name(f"{op.name}_local_ids"), "aten.arange.default", (count,),
                {"dtype": torch.int64, "device": torch.device("cpu")}, [local], _attrs(op, op.role))
    block.ops[block.ops.index(op):block.ops.index(op)] = [pull, arange]
    op.args = (Ref(rows), Ref(local), *op.args[2:])
    op.attrs.update(table=table, ids=ids, local_ids=local, rows=count)


def _bag_row_grads(program: Program, op: Op, lookup: Op) -> Ref:
    """The bag's backward on the pulled rows: `[n, dim]` row gradients, one per looked-up id, pushed as they are."""
    table = lookup.attrs["table"]
    grad = program.global_block.add_var(Var(program.unique_name(f"{table}@ROWS@GRAD"),
                                            (lookup.attrs["rows"], program.var(table).shape[1]),
                                            program.var(op.outputs[0]).dtype, program.var(op.outputs[0]).device,
                                            VarKind.TEMP)).name
    op.args = (op.args[0], Ref(lookup.attrs["local_ids"]), *op.args[2:6], lookup.attrs["rows"], *op.args[7:])
    op.outputs = [grad]
    return Ref(grad)


def _learning_rate(program: Program) -> Ref | float:
    """The fed learning rate of param group 0 (so set_lr and schedulers reach the servers), else its constant."""
    for feed in program.metadata.get("optimizer", {}).get("feeds", []):
        if feed.get("key") == "lr" and feed.get("group") == 0:
            return Ref(feed["var"])
    return float(ps_metadata(program).get("lr", 0.0))


def _drop_unused_state(program: Program) -> None:
    """Optimizer state lives on the servers: forget the worker's state Vars and gradients nobody uses now."""
    used = {n for _, op in program.walk_ops() for n in (*op.inputs, *op.defined)} | set(program.fetches.values())
    for block in program.blocks:
        for name in [n for n, v in block.vars.items()
                     if v.kind in (VarKind.OPTIMIZER_STATE, VarKind.TEMP) and n not in used]:
            del block.vars[name]
