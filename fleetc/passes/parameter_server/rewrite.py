"""The worker Program of a parameter-server job (`metadata["parameter_server"]`, stamped by fleet's PS trainer).

sync / async: each `aten.embedding` lookup of a table becomes `fleetc.ps_pull_sparse(ids, table)` (just the
batch's rows), and its `aten.embedding_dense_backward` disappears: the row gradients (ids, grad of the lookup)
go to the servers as they are. Dense parameters are refreshed by one `fleetc.ps_pull_dense` before the first op;
the optimize section is removed (servers run the update) and one `fleetc.ps_push` sends the dense gradients and
row gradients after backward. Evaluation Programs get the pulls only.

geo: the worker trains locally with its own update; `fleetc.ps_geo_note_rows` records the rows each lookup
trains and `fleetc.ps_geo_sync` at the end sends the deltas every k steps and pulls the servers' values.
"""
from __future__ import annotations

from typing import Any

from fleetc.comm.ps import ops as _ps_ops  # noqa: F401  (registers the ps ops)
from fleetc.errors import PassError
from fleetc.ir.program import Op, OpRole, Program, Ref, VarKind
from fleetc.passes.base import PassReport

EMBEDDING = "aten.embedding.default"
EMBEDDING_BACKWARD = "aten.embedding_dense_backward.default"
SUM = "aten.add.Tensor"
GRAD_SUFFIX = "@GRAD"
# What other rewrites a PS Program cannot take: their metadata key → why.
_INCOMPATIBLE = {"gradient_merge": "gradient merge (servers update every step)",
                 "local_sgd": "local SGD (a collective-mode strategy)"}


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
        for key, what in _INCOMPATIBLE.items():
            if key in program.metadata:
                raise PassError(f"parameter-server mode cannot be combined with {what}; switch it off")
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
            elif OpRole.OPTIMIZE not in op.role:
                raise PassError(f"{op.attrs.get('source') or op.name}: op {op.name} ({op.type}) reads the embedding "
                                f"table {read[0]!r}; parameter-server tables are row-sharded on the servers and may "
                                "only be used through nn.Embedding lookups")
        return lookups

    # ----- sync / async ----------------------------------------------------------------------
    @staticmethod
    def _sparse_pulls(program: Program, lookups: list[Op], report: PassReport) -> None:
        for op in lookups:
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
        by_forward = {op.name: op for op in lookups}
        sparse: list[tuple[str, Ref, Ref, int]] = []  # (table, ids, grad of the lookup, padding_idx)
        removed: set[str] = set()
        kept = []
        for op in block.ops:
            if op.type == EMBEDDING_BACKWARD and op.attrs.get("forward_op") in by_forward:
                lookup = by_forward[op.attrs["forward_op"]]
                sparse.append((lookup.attrs["table"], op.args[1], op.args[0], int(op.args[3])))
                removed.update(op.defined)
            elif OpRole.OPTIMIZE in op.role:
                report.count("optimizer_ops_moved_to_servers")
            elif removed & set(op.inputs):  # a table read twice: the sum of its lookups' gradients
                if op.type != SUM or not set(op.inputs) <= removed:
                    raise PassError(f"op {op.name} ({op.type}) reads an embedding table's gradient; only the "
                                    "servers may use it in parameter-server mode")
                removed.update(op.defined)
            else:
                kept.append(op)
        grads = [(n, n + GRAD_SUFFIX) for n in dense if n + GRAD_SUFFIX in block.vars
                 and block.vars[n + GRAD_SUFFIX].kind is VarKind.TEMP]
        lr = _learning_rate(program)
        push = Op(program.unique_name("ps_push"), "fleetc.ps_push",
                  (lr, [Ref(g) for _, g in grads], [n for n, _ in grads], [s[1] for s in sparse],
                   [s[2] for s in sparse], [s[0] for s in sparse], [s[3] for s in sparse]),
                  {}, [], _attrs(None, OpRole.COLLECTIVE))
        block.ops = [*kept, push]
        for name in removed:
            block.vars.pop(name, None)
        report.count("dense_grads_pushed", len(grads))
        report.count("sparse_grads_pushed", len(sparse))

    # ----- geo -------------------------------------------------------------------------------
    @staticmethod
    def _geo(program: Program, lookups: list[Op], report: PassReport) -> None:
        block = program.global_block
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
