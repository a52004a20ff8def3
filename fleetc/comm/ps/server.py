"""A parameter server: its shard of the parameters and optimizer state, and the rpc handlers workers call.

Handlers are module functions (rpc calls them by reference) acting on this process's one `Server`. Pushes per
mode: sync collects one push from every worker for a step, averages them (the gradient of the global batch) and
updates once, answering every worker then (the step's barrier); async applies each push as it arrives; geo adds
each worker's parameter delta divided by the worker count (Paddle's GEO-SGD). With use_thread_barrier, async and
geo pushes are answered only when every worker has pushed that step.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from fleetc.comm.ps.placement import Placement
from fleetc.comm.ps.role import PsRole
from fleetc.comm.ps.rpc import ParameterServerError
from fleetc.comm.ps.rules import dense_update, new_state, sparse_update

SYNC, ASYNC, GEO = "sync", "async", "geo"


@dataclass
class Pushes:
    """Pushes of one step collected so far (sync: summed; others: only counted, for the barrier); on a worker under
    gradient merge, its own gradients since the last push."""

    arrived: set = field(default_factory=set)
    futures: list = field(default_factory=list)
    dense: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)
    lr: float = 0.0


class Server:
    """One server's tables and state. `setup` (from worker 0) fills them, from worker 0's values or from the
    checkpoint `init_server(dirname)` loaded; `run_server` waits until every worker has stopped."""

    def __init__(self, role: PsRole, timeout_s: float):
        self.role, self.timeout_s = role, timeout_s
        self.loaded: dict | None = None
        self.initialized = threading.Event()  # init_server ran (and loaded its checkpoint, if any)
        self.lock = threading.Lock()
        self.ready = Future()
        self.placement: Placement | None = None
        self.spec: dict[str, Any] = {}
        self.mode, self.thread_barrier = SYNC, False
        self.dense: dict[str, torch.Tensor] = {}
        self.tables: dict[str, torch.Tensor] = {}
        self.state: dict[str, dict] = {}
        self.steps: dict[int, Pushes] = {}
        self.barriers: dict[int, Pushes] = {}
        self.stopped: set[int] = set()
        self.done = threading.Event()
        self.last_seen: dict[int, float] = {}

    # ----- setup -----------------------------------------------------------------------------
    def init(self, loaded: dict | None) -> None:
        """fleet.init_server: the checkpoint to start from (None: worker 0's initial values)."""
        self.loaded = loaded
        self.initialized.set()

    def setup(self, placement: Placement, spec: dict, mode: str, barrier: bool, values: dict) -> None:
        if not self.initialized.wait(self.timeout_s):
            raise ParameterServerError(f"server {self.role.index} did not call fleet.init_server() within "
                                       f"{self.timeout_s:g} s of worker 0's setup")
        s, count = self.role.index, placement.server_num
        source = self.loaded["params"] if self.loaded is not None else values
        with self.lock:
            self.placement, self.spec, self.mode, self.thread_barrier = placement, spec, mode, barrier
            for name in placement.dense_on(s):
                self.dense[name] = _checked(source, name, placement.shapes[name]).clone()
                self.state[name] = new_state(spec, self.dense[name], table=False)
            for name, shape in placement.tables.items():
                shard = _checked(source, name, shape)[s::count] if self.loaded is not None else values[name]
                self.tables[name] = shard.clone()
                self.state[name] = new_state(spec, self.tables[name], table=True)
            if self.loaded is not None:
                self._restore_state(self.loaded.get("optimizer", {}))
        self.ready.set_result(None)

    def _restore_state(self, saved: dict) -> None:
        s, count = self.role.index, self.placement.server_num
        for name, state in self.state.items():
            for key, tensor in state.items():
                value = saved.get(name, {}).get(key)
                if value is None:
                    raise ParameterServerError(f"the checkpoint has no optimizer state {key!r} of {name!r} "
                                               f"for the {self.spec['type']} rule")
                tensor.copy_(value[s::count] if name in self.tables and tensor.dim() > 0 else value)

    def check_layout(self, worker: int, placement: Placement) -> None:
        if placement != self.placement:
            raise ParameterServerError(f"worker {worker}'s model places its parameters differently from worker 0's "
                                       "(different parameters, shapes or server count): every worker must build the "
                                       "same model")

    # ----- serving ---------------------------------------------------------------------------
    def seen(self, worker: int) -> None:
        self.last_seen[worker] = time.monotonic()

    def pull_dense(self, worker: int, names: list[str]) -> list[torch.Tensor]:
        self.seen(worker)
        with self.lock:
            return [self.dense[n].clone() for n in names]

    def pull_rows(self, worker: int, table: str, rows: torch.Tensor) -> torch.Tensor:
        self.seen(worker)
        with self.lock:
            return self.tables[table][rows]

    def push(self, worker: int, step: int, dense: dict, rows: dict, lr: float) -> Future:
        """A worker's gradients (sync, async) or deltas (geo) of one step; the future completes when the worker may
        go on."""
        self.seen(worker)
        answer: Future = Future()
        with self.lock:
            if self.mode != SYNC:
                self._apply(dense, rows, lr, 1.0)
                if not self.thread_barrier:
                    answer.set_result(None)
                    return answer
            pending = self.steps.setdefault(step, Pushes())
            if worker in pending.arrived:
                raise ParameterServerError(f"worker {worker} pushed step {step} twice")
            pending.arrived.add(worker)
            pending.futures.append(answer)
            if self.mode == SYNC:
                accumulate(pending, dense, rows, lr)
            if len(pending.arrived) < self.role.worker_num:
                return answer
            del self.steps[step]
            if self.mode == SYNC:
                self._apply(pending.dense, pending.rows, pending.lr, 1.0 / self.role.worker_num)
        for future in pending.futures:
            future.set_result(None)
        return answer

    def _apply(self, dense: dict, rows: dict, lr: float, scale: float) -> None:
        """Update with `scale` × the pushed values (sync: the mean of every worker's gradient)."""
        if self.mode == GEO:
            for name, delta in dense.items():
                self.dense[name].add_(delta, alpha=1.0 / self.role.worker_num)
            for table, (index, delta) in rows.items():
                self.tables[table].index_add_(0, index, delta, alpha=1.0 / self.role.worker_num)
            return
        for name, grad in dense.items():
            dense_update(self.spec, self.dense[name], grad * scale, self.state[name], lr)
        for table in self.tables:
            index, grad = rows.get(table, (None, None))
            if index is None:
                index, grad = torch.zeros(0, dtype=torch.long), self.tables[table].new_zeros(0, self.tables[table].shape[1])
            index, grad = coalesce(index, grad)
            sparse_update(self.spec, self.tables[table], index, grad * scale, self.state[table], lr)

    def barrier(self, worker: int, count: int) -> Future:
        """fleet.barrier_worker (server 0 keeps it): answered when every worker has arrived at its `count`-th."""
        self.seen(worker)
        answer: Future = Future()
        with self.lock:
            pending = self.barriers.setdefault(count, Pushes())
            pending.arrived.add(worker)
            pending.futures.append(answer)
            if len(pending.arrived) < self.role.worker_num:
                return answer
            del self.barriers[count]
        for future in pending.futures:
            future.set_result(None)
        return answer

    def snapshot(self) -> dict:
        """This server's shard: parameters and optimizer state (for fleet.save_persistables)."""
        with self.lock:
            return {"dense": {n: t.clone() for n, t in self.dense.items()},
                    "tables": {n: t.clone() for n, t in self.tables.items()},
                    "state": {n: {k: v.clone() for k, v in s.items()} for n, s in self.state.items()}}

    def stop(self, worker: int) -> None:
        with self.lock:
            self.stopped.add(worker)
            if len(self.stopped) == self.role.worker_num:
                self.done.set()

    def serve(self) -> None:
        """Return when every worker has stopped; ParameterServerError when one was silent for the rpc timeout."""
        start = time.monotonic()
        while not self.done.wait(0.5):
            now = time.monotonic()
            for worker in range(self.role.worker_num):
                if worker not in self.stopped and now - self.last_seen.get(worker, start) > self.timeout_s:
                    raise ParameterServerError(
                        f"server {self.role.index}: worker {worker} sent nothing for {self.timeout_s:g} s (the rpc "
                        "timeout) and has not called fleet.stop_worker(): it died or hangs; shutting down")


def coalesce(index: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique row indices and the sum of the values pushed for each."""
    unique, inverse = torch.unique(index, return_inverse=True)
    return unique, values.new_zeros(len(unique), values.shape[1]).index_add_(0, inverse, values)


def accumulate(pending: Pushes, dense: dict, rows: dict, lr: float) -> None:
    """Add one push to `pending`: dense gradients summed, table row gradients (ids, grads) appended; the latest lr."""
    pending.lr = lr
    for name, grad in dense.items():
        pending.dense[name] = pending.dense[name] + grad if name in pending.dense else grad
    for table, (index, grad) in rows.items():
        if table in pending.rows:
            old_index, old_grad = pending.rows[table]
            index, grad = torch.cat([old_index, index]), torch.cat([old_grad, grad])
        pending.rows[table] = (index, grad)


def _checked(source: dict, name: str, shape: tuple) -> torch.Tensor:
    value = source.get(name)
    if value is None or tuple(value.shape) != tuple(shape):
        found = "missing" if value is None else f"of shape {list(value.shape)}"
        raise ParameterServerError(f"parameter {name!r} is {found}; the model has shape {list(shape)}")
    return value


# ----- rpc handlers: run on the server, against its one Server --------------------------------
_SERVER: Server | None = None


def start(server: Server) -> None:
    global _SERVER
    _SERVER = server


def current_server() -> Server:
    """This process's parameter server (the one `start` registered); ParameterServerError when there is none."""
    if _SERVER is None:
        raise ParameterServerError("this process is not a running parameter server (fleet.init_server() not called)")
    return _SERVER


def handle_setup(worker: int, placement: Placement, spec: dict, mode: str, barrier: bool, values: dict) -> None:
    current_server().seen(worker)
    current_server().setup(placement, spec, mode, barrier, values)


@rpc.functions.async_execution
def handle_wait_ready(worker: int, placement: Placement) -> Future:
    server = current_server()
    server.seen(worker)

    def check(ready: Future) -> None:
        server.check_layout(worker, placement)
    return server.ready.then(check)


def handle_pull_dense(worker: int, names: list[str]) -> list[torch.Tensor]:
    return current_server().pull_dense(worker, names)


def handle_pull_rows(worker: int, table: str, rows: torch.Tensor) -> torch.Tensor:
    return current_server().pull_rows(worker, table, rows)


@rpc.functions.async_execution
def handle_push(worker: int, step: int, dense: dict, rows: dict, lr: float) -> Future:
    return current_server().push(worker, step, dense, rows, lr)


@rpc.functions.async_execution
def handle_barrier(worker: int, count: int) -> Future:
    return current_server().barrier(worker, count)


def handle_snapshot(worker: int) -> dict:
    current_server().seen(worker)
    return current_server().snapshot()


def handle_heartbeat(worker: int) -> None:
    current_server().seen(worker)


def handle_stop(worker: int) -> None:
    current_server().stop(worker)
