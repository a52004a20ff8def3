"""The worker's side of a parameter-server job: pulls, pushes and geo syncs, with the bytes each moved."""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import torch
import torch.distributed.rpc as rpc

from fleetc.comm.ps import server as handlers
from fleetc.comm.ps.placement import Placement
from fleetc.comm.ps.role import PsRole
from fleetc.comm.ps.rpc import ParameterServerError, call_all
from fleetc.comm.ps.rules import new_state, sparse_update
from fleetc.comm.ps.server import Pushes, accumulate, coalesce


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Client:
    """One per worker process (made by fleet.init_worker). `stats` counts what moved, in bytes and rows."""

    def __init__(self, role: PsRole, timeout_s: float):
        self.role, self.timeout_s = role, timeout_s
        self.placement: Placement | None = None
        self.mode = ""
        self.k_steps = 0
        self.steps = 0
        self.barriers = 0
        self.stats: Counter = Counter()
        self.snapshot: dict[str, torch.Tensor] = {}  # geo: the values at the last sync
        self.touched: dict[str, set] = {}  # geo: table rows trained locally since the last sync
        self.merged = Pushes()  # gradient merge: the gradients of the steps since the last push
        self.spec: dict[str, Any] = {}  # the update rule (geo: the worker's lazy table rows use it too)
        self.row_state: dict[str, dict[str, torch.Tensor]] = {}  # geo: the optimizer state of local table rows
        self.merge_calls = 0

    def _servers(self) -> list[str]:
        return [f"server{s}" for s in range(self.role.server_num)]

    def _call(self, fn: Any, per_server: list[tuple], what: str, servers: list[int] | None = None) -> list[Any]:
        chosen = range(self.role.server_num) if servers is None else servers
        return call_all([(f"server{s}", fn, args) for s, args in zip(chosen, per_server)], what, self.timeout_s)

    # ----- joining ---------------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        """Tell every server this worker is alive every quarter of the rpc timeout (compiling, evaluating or
        loading data between steps is not dying), until stop()."""
        self._stopped = threading.Event()

        def beat() -> None:
            while not self._stopped.wait(self.timeout_s / 4):
                for server in self._servers():
                    try:
                        rpc.rpc_async(server, handlers.handle_heartbeat, (self.role.index,), timeout=self.timeout_s)
                    except RuntimeError:
                        return  # the job is going down; the next pull or push reports it
        threading.Thread(target=beat, name="fleetc-ps-heartbeat", daemon=True).start()

    def register(self, placement: Placement, spec: dict, mode: str, k_steps: int, barrier: bool,
                 values: dict[str, torch.Tensor]) -> None:
        """Worker 0 sets the servers up (with its values, unless a server loaded a checkpoint); every worker then
        waits until they are ready and checks its model places parameters as worker 0's does."""
        if self.placement is not None:
            raise ParameterServerError("this worker already registered a model with the servers; a parameter-server "
                                       "job trains one model (build one trainer per job)")
        self.placement, self.mode, self.k_steps, self.spec = placement, mode, k_steps, spec
        me = self.role.index
        if me == 0:
            shards = [{**{n: values[n].detach() for n in placement.dense_on(s)},
                       **{n: values[n].detach()[s::placement.server_num] for n in placement.tables}}
                      for s in range(placement.server_num)]
            self._call(handlers.handle_setup, [(me, placement, spec, mode, barrier, v) for v in shards],
                       "setup (worker 0 sending the initial parameters)")
        self._call(handlers.handle_wait_ready, [(me, placement)] * self.role.server_num, "waiting for the servers")

    # ----- sync and async --------------------------------------------------------------------
    def pull_dense(self, params: list[torch.Tensor], names: list[str]) -> None:
        """Copy the servers' current values of dense parameters into `params`, in place."""
        by_server: dict[int, list[int]] = {}
        for i, name in enumerate(names):
            by_server.setdefault(self.placement.dense[name], []).append(i)
        servers = sorted(by_server)
        results = self._call(handlers.handle_pull_dense,
                             [(self.role.index, [names[i] for i in by_server[s]]) for s in servers],
                             "a dense pull", servers)
        for s, values in zip(servers, results):
            for i, value in zip(by_server[s], values):
                params[i].copy_(value)
                self.stats["pull_dense_bytes"] += _nbytes(value)

    def pull_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `table` for `ids` (shape ids.shape + [dim]): each distinct id is fetched once, from the
        server holding it."""
        count = self.placement.server_num
        rows, dim = self.placement.tables[table]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            raise ParameterServerError(f"table {table!r} has {rows} rows; the batch looks up ids "
                                       f"{int(ids.min())}..{int(ids.max())}")
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        owner = unique % count
        servers = [s for s in range(count) if bool((owner == s).any())]
        results = self._call(handlers.handle_pull_rows,
                             [(self.role.index, table, unique[owner == s] // count) for s in servers],
                             f"a sparse pull of {table!r}", servers)
        gathered = torch.empty(len(unique), dim)
        for s, values in zip(servers, results):
            gathered[owner == s] = values
            self.stats["pull_sparse_bytes"] += _nbytes(values)
            self.stats["pull_sparse_rows"] += len(values)
        return gathered[inverse].reshape(*ids.shape, dim)

    def push(self, dense: dict[str, torch.Tensor], sparse: dict[str, tuple[torch.Tensor, torch.Tensor]],
             lr: float, merge_steps: int = 1, merge_avg: bool = True) -> None:
        """Send one step's gradients: dense ones to their server, table row gradients (ids, grads) to the servers
        holding the rows. Returns when the servers let this worker go on (sync: all workers pushed and the update
        is applied). With gradient merge (`merge_steps` k > 1) only every k-th call sends: the sum of the k steps'
        gradients (divided by k with `merge_avg`), with that call's learning rate; the others only add to it."""
        if merge_steps > 1:
            self.merge_calls += 1
            accumulate(self.merged, dense, sparse, lr)
            if self.merge_calls % merge_steps:
                return
            scale = 1.0 / merge_steps if merge_avg else 1.0
            dense = {name: grad * scale for name, grad in self.merged.dense.items()}
            sparse = {table: (ids, grads * scale) for table, (ids, grads) in self.merged.rows.items()}
            self.merged = Pushes()
        self.steps += 1
        count = self.placement.server_num
        per_server: list[tuple[dict, dict]] = [({}, {}) for _ in range(count)]
        for name, grad in dense.items():
            per_server[self.placement.dense[name]][0][name] = grad
            self.stats["push_dense_bytes"] += _nbytes(grad)
        for table, (ids, grads) in sparse.items():
            ids, grads = coalesce(ids, grads)
            for s in range(count):
                mine = ids % count == s
                per_server[s][1][table] = (ids[mine] // count, grads[mine])
                self.stats["push_sparse_bytes"] += _nbytes(grads[mine])
        self._call(handlers.handle_push, [(self.role.index, self.steps, d, r, float(lr)) for d, r in per_server],
                   f"the push of step {self.steps}")

    # ----- geo -------------------------------------------------------------------------------
    def geo_start(self, params: dict[str, torch.Tensor]) -> None:
        """Geo: take the servers' values as the local starting point."""
        self.geo_pull(params, None)

    def geo_note_rows(self, table: str, ids: torch.Tensor) -> None:
        self.touched.setdefault(table, set()).update(torch.unique(ids).tolist())

    def geo_update_rows(self, tables: dict[str, torch.Tensor], sparse: dict[str, tuple[torch.Tensor, torch.Tensor]],
                        lr: float) -> None:
        """Geo: the worker's own lazy update of the rows its lookups trained (the servers' row rule), in place."""
        with torch.no_grad():
            for table, (ids, grads) in sparse.items():
                rows, grads = coalesce(ids, grads)
                state = self.row_state.get(table)
                if state is None:
                    state = self.row_state[table] = new_state(self.spec, tables[table], table=True)
                sparse_update(self.spec, tables[table], rows, grads, state, float(lr))

    def geo_step(self, params: dict[str, torch.Tensor]) -> bool:
        """Count a local step; every k-th, push the deltas since the last sync and pull the servers' values."""
        self.steps += 1
        if self.steps % self.k_steps:
            return False
        count = self.placement.server_num
        per_server: list[tuple[dict, dict]] = [({}, {}) for _ in range(count)]
        for name, server in self.placement.dense.items():
            delta = params[name] - self.snapshot[name]
            per_server[server][0][name] = delta
            self.stats["push_dense_bytes"] += _nbytes(delta)
        rows = {table: self._geo_rows(table, params[table]) for table in self.placement.tables}
        for table, ids in rows.items():
            delta = params[table][ids] - self.snapshot[table][ids]
            for s in range(count):
                mine = ids % count == s
                per_server[s][1][table] = (ids[mine] // count, delta[mine])
                self.stats["push_sparse_bytes"] += _nbytes(delta[mine])
        self._call(handlers.handle_push, [(self.role.index, self.steps, d, r, 0.0) for d, r in per_server],
                   f"the geo push of step {self.steps}")
        self.geo_pull(params, rows)
        return True

    def _geo_rows(self, table: str, local: torch.Tensor) -> torch.Tensor:
        """The rows of a table a geo sync pushes and pulls: those the batches since the last sync looked up, and
        those the local update changed. A table updated lazily (geo_update_rows) changed only the rows looked up;
        a dense local update can change others (gradient merge applies earlier batches' gradients, momentum keeps
        moving rows), found by comparing the whole table with the last sync's values."""
        noted = torch.tensor(sorted(self.touched.get(table, ())), dtype=torch.long)
        if table in self.row_state:
            return noted
        changed = (local != self.snapshot[table]).any(dim=1).nonzero().flatten()
        return torch.unique(torch.cat([noted, changed]))

    def geo_pull(self, params: dict[str, torch.Tensor], rows: dict[str, torch.Tensor] | None) -> None:
        """Take the servers' dense values and the table `rows` (every row when None), and remember them as the
        next sync's starting point (the other table rows did not change since the last one)."""
        dense = list(self.placement.dense)
        self.pull_dense([params[n] for n in dense], dense)
        for name in dense:
            self.snapshot[name] = params[name].detach().clone()
        for table, (count, _) in self.placement.tables.items():
            ids = torch.arange(count) if rows is None else rows[table]
            if len(ids):
                params[table][ids] = self.pull_rows(table, ids)
            if rows is None:
                self.snapshot[table] = params[table].detach().clone()
            else:
                self.snapshot[table][ids] = params[table][ids]
        self.touched = {}

    # ----- checkpoints and leaving ----------------------------------------------------------
    def gather(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """Every server's shard assembled into full parameters and optimizer state (tables' rows interleaved back)."""
        shards = self._call(handlers.handle_snapshot, [(self.role.index,)] * self.role.server_num,
                            "gathering the servers' state")
        count = self.placement.server_num
        params: dict[str, torch.Tensor] = {}
        state: dict[str, dict[str, torch.Tensor]] = {}
        for shard in shards:
            params.update(shard["dense"])
            state.update({n: s for n, s in shard["state"].items() if n in shard["dense"]})
        for table, (rows, dim) in self.placement.tables.items():
            params[table] = torch.empty(rows, dim)
            state[table] = {}
            for s, shard in enumerate(shards):
                params[table][s::count] = shard["tables"][table]
                for key, value in shard["state"][table].items():
                    if value.dim() == 0:
                        state[table][key] = value
                        continue
                    full = state[table].setdefault(key, value.new_empty(rows, *value.shape[1:]))
                    full[s::count] = value
        return params, state

    def barrier(self) -> None:
        """Every worker waits here for the others (server 0 counts them), at most the rpc timeout."""
        self.barriers += 1
        self._call(handlers.handle_barrier, [(self.role.index, self.barriers)], "barrier_worker", [0])

    def stop(self) -> None:
        if getattr(self, "_stopped", None) is not None:
            self._stopped.set()
        self._call(handlers.handle_stop, [(self.role.index,)] * self.role.server_num, "stop_worker")


_CLIENT: Client | None = None


def set_client(client: Client | None) -> None:
    global _CLIENT
    _CLIENT = client


def active_client() -> Client | None:
    """The client fleet.init_worker installed (None before, and after stop_worker)."""
    return _CLIENT


def client() -> Client:
    if _CLIENT is None or _CLIENT.placement is None:
        raise ParameterServerError("a parameter-server op ran without a registered worker: call fleet.init_worker() "
                                   "and build the trainer with fleet.distributed_model(model)")
    return _CLIENT
