"""The multi-threaded scheduler (`execution_strategy.num_threads` > 1): a ready queue over a Program's dependency graph.

Each run starts `num_threads - 1` compute threads beside the caller's (which computes too) and, when the Program has
collectives, one communication thread that issues them in Program order (fleetc/runtime/dependencies.py chains
them); every thread is joined before `run` returns or raises, so no thread outlives a step.

Intra-op threads (the rule, docs/execution.md): every op runs with aten's intra-op thread count as it is when the
step starts (`torch.get_num_threads()`), whatever `num_threads` is: each worker sets it for itself before its first
op. aten reductions, GEMMs and fleetc's generated CPU kernels split their work by that count, so a fixed count gives
the same bits whichever thread runs the op; accumulations into one buffer are ordered by the graph's write edges.
Together the results are bitwise identical for every `num_threads`. The cost: `num_threads` × intra-op threads may
exceed the cores (oversubscription; bench/README.md measures it).
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import torch

from fleetc.errors import ExecutionError, FleetcError
from fleetc.ir.liveness import block_reads, last_use_index
from fleetc.ir.program import CONDITIONAL_BLOCK, Block, Op, Program, Ref, VarKind
from fleetc.ir.registry import resolve_callable
from fleetc.runtime.dependencies import Node, build_graph
from fleetc.runtime.pycodegen import (
    profile_label,
    profiler_active,
    returned_outputs,
    returns_list,
    unpacks,
)


def _bind(value: Any, env: dict[str, Any]) -> Any:
    """An argument with every Ref replaced by the Var's current value."""
    if isinstance(value, Ref):
        return env[value.name]
    if isinstance(value, list):
        return [_bind(v, env) for v in value]
    if isinstance(value, tuple):
        return tuple(_bind(v, env) for v in value)
    if isinstance(value, dict):
        return {k: _bind(v, env) for k, v in value.items()}
    return value


class _Step:
    """One op prepared to run against an environment of Var values."""

    def __init__(self, program: Program, op: Op, block: Block, op_callables: dict[str, Callable]):
        self.op = op
        self.label = profile_label(op)
        self.kernel = op_callables.get(op.name) or resolve_callable(op.type)
        self.returned = returned_outputs(program, op, block)
        self.unpack = unpacks(op, self.returned, returns_list(self.kernel))

    def __call__(self, env: dict[str, Any]) -> None:
        result = self.kernel(*_bind(self.op.args, env), **_bind(self.op.kwargs, env))
        if not self.returned:
            return
        values = result if self.unpack else (result,)
        for name, value in zip(self.returned, values):
            if name is not None:
                env[name] = value


class _Sequence:
    """A sub-block run in Program order (a conditional block's body), freeing its temporaries after last use."""

    def __init__(self, program: Program, block: Block, op_callables: dict[str, Callable], keep: set[str]):
        self.steps = [_prepare(program, op, block, op_callables, keep) for op in block.ops]
        defined = {name for op in block.ops for name in op.defined}
        dead_after = last_use_index(program, block, keep)
        self.free = [[] for _ in block.ops]
        for name, i in dead_after.items():
            if name in defined:
                self.free[i].append(name)

    def __call__(self, env: dict[str, Any]) -> None:
        for step, free in zip(self.steps, self.free):
            step(env)
            for name in free:
                env.pop(name, None)


class _Conditional:
    def __init__(self, program: Program, op: Op, op_callables: dict[str, Callable], keep: set[str]):
        self.op = op
        self.label = profile_label(op)
        self.condition = op.args[0]
        self.body = _Sequence(program, program.blocks[op.sub_block], op_callables, keep)

    def __call__(self, env: dict[str, Any]) -> None:
        if _bind(self.condition, env):
            self.body(env)


def _prepare(program: Program, op: Op, block: Block, op_callables: dict[str, Callable], keep: set[str]):
    if op.type == CONDITIONAL_BLOCK:
        return _Conditional(program, op, op_callables, keep)
    return _Step(program, op, block, op_callables)


def worker_error(op: Op, exc: BaseException) -> ExecutionError:
    """The error a failed op raises in the caller: op, type, module path and the user's source line."""
    where = f" in module {op.module_path!r}" if op.module_path else ""
    source = f"\n  user source: {op.attrs['source']}" if op.attrs.get("source") else ""
    return ExecutionError(f"op {op.name!r} ({op.type}){where} failed: {type(exc).__name__}: {exc}{source}")


class ScheduledStep:
    """Runs a Program's global block on a ready queue with `num_threads` compute threads (see the module docstring)."""

    def __init__(self, program: Program, num_threads: int, op_callables: dict[str, Callable] | None = None):
        if num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, not {num_threads}")
        self.program = program
        self.num_threads = num_threads
        block = program.global_block
        self.keep = set(program.fetches.values())
        self.nodes: list[Node] = build_graph(program, block)
        self.steps = [_prepare(program, node.op, block, op_callables or {}, self.keep) for node in self.nodes]
        self.roots = [i for i, node in enumerate(self.nodes) if node.predecessors == 0]
        self.has_collectives = any(node.collective for node in self.nodes)
        # Temporaries are dropped from the environment once every op reading them has run.
        temps = {v.name for v in program.all_vars() if v.kind is VarKind.TEMP} - self.keep
        self.reads = [[n for n in block_reads(program, node.op) if n in temps] for node in self.nodes]
        self.readers = collections.Counter(n for names in self.reads for n in names)
        self.unread = [[n for n in node.op.defined if n in temps and not self.readers[n]] for node in self.nodes]

    def run(self, state: dict[str, torch.Tensor], feeds: list[Any]) -> dict[str, Any]:
        env: dict[str, Any] = {v.name: state[v.name] for v in self.program.persistables()}
        env.update(zip(self.program.feeds, feeds))
        _Run(self, env).execute()
        return {key: env[name] for key, name in self.program.fetches.items()}


class _Run:
    """The mutable state of one scheduled step: ready queues, counters, the first error."""

    def __init__(self, plan: ScheduledStep, env: dict[str, Any]):
        self.plan = plan
        self.env = env
        self.waiting = [node.predecessors for node in plan.nodes]
        self.readers = dict(plan.readers)
        self.ready: collections.deque[int] = collections.deque()
        self.comm_ready: collections.deque[int] = collections.deque()
        for i in plan.roots:
            self._queue(i).append(i)
        self.done = 0
        self.error: tuple[Op, BaseException] | None = None
        lock = threading.Lock()  # one lock, a condition per queue: a finished op wakes one thread per op it readied
        self.cv = threading.Condition(lock)
        self.comm_cv = threading.Condition(lock)
        self.intra_op_threads = torch.get_num_threads()
        self.caller = threading.current_thread()
        self.profiling = profiler_active()

    def _queue(self, i: int) -> collections.deque[int]:
        return self.comm_ready if self.plan.nodes[i].collective else self.ready

    def execute(self) -> None:
        threads = [threading.Thread(target=self.work, args=(False,), name=f"fleetc-worker-{k}", daemon=True)
                   for k in range(1, self.plan.num_threads)]
        if self.plan.has_collectives:
            threads.append(threading.Thread(target=self.work, args=(True,), name="fleetc-comm", daemon=True))
        for thread in threads:
            thread.start()
        try:
            self.work(False)
        finally:
            with self.cv:
                if self.done < len(self.plan.nodes) and self.error is None:
                    self.error = (self.plan.nodes[0].op, RuntimeError("the caller's thread was interrupted"))
                self._wake_all()
            for thread in threads:
                thread.join()
        if self.error is not None:
            op, exc = self.error
            if isinstance(exc, FleetcError):  # already names what failed (a CollectiveError names the collective)
                raise exc
            raise worker_error(op, exc) from exc

    def _wake_all(self) -> None:
        self.cv.notify_all()
        self.comm_cv.notify_all()

    def work(self, comm: bool) -> None:
        queue, cv = (self.comm_ready, self.comm_cv) if comm else (self.ready, self.cv)
        total = len(self.plan.nodes)
        if threading.current_thread() is not self.caller:
            torch.set_num_threads(self.intra_op_threads)  # this thread's OpenMP team size: the caller's count
        with torch.no_grad():  # grad mode is per thread
            while True:
                with cv:
                    while not queue and self.done < total and self.error is None:
                        cv.wait()
                    if self.error is not None or not queue:
                        return
                    i = queue.popleft()
                step = self.plan.steps[i]
                try:
                    if self.profiling:
                        with torch.profiler.record_function(step.label):
                            step(self.env)
                    else:
                        step(self.env)
                except BaseException as exc:  # noqa: BLE001 - surfaced in the caller's thread
                    with self.cv:
                        if self.error is None:
                            self.error = (step.op, exc)
                        self._wake_all()
                    return
                self._finish(i)

    def _finish(self, i: int) -> None:
        plan, env = self.plan, self.env
        with self.cv:
            self.done += 1
            for name in plan.reads[i]:
                self.readers[name] -= 1
                if not self.readers[name]:
                    env.pop(name, None)
            for name in plan.unread[i]:
                env.pop(name, None)
            for j in plan.nodes[i].successors:
                self.waiting[j] -= 1
                if not self.waiting[j]:
                    self._queue(j).append(j)
                    (self.comm_cv if plan.nodes[j].collective else self.cv).notify()
            if self.done == len(plan.nodes):
                self._wake_all()
