"""Turns a failed or timed-out collective into an error naming the collective and the ranks that never came."""
from __future__ import annotations

import time

import torch.distributed as dist

from fleetc.errors import CollectiveError

REPORT_WINDOW_S = 3.0  # how long survivors wait for each other to report before naming the missing ranks
_failures = 0


def _missing_ranks(label: str) -> str:
    """Every surviving rank reports its failure in the job's store; ranks that never report are dead or hung."""
    global _failures
    _failures += 1
    me, world = dist.get_rank(), dist.get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"fleetc/failed/{_failures}/"
        store.set(prefix + str(me), label)
        deadline = time.monotonic() + REPORT_WINDOW_S
        pending = [r for r in range(world) if r != me]
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if not store.check([prefix + str(r)])]
            time.sleep(0.05)
    except Exception as exc:  # the store itself may have died with the rank that hosted it
        return f"could not ask the other ranks (job store unreachable: {type(exc).__name__}: {exc})"
    if not pending:
        return "every rank reported the failure (a transport error, not a missing rank)"
    return f"rank(s) {pending} did not reach it (dead or hung)"


def collective_failed(label: str, exc: BaseException, timeout_s: float) -> CollectiveError:
    """The error a rank raises when the collective `label` fails or does not finish within `timeout_s`."""
    cause = " ".join(str(exc).split())[:300]
    return CollectiveError(f"collective {label} failed on rank {dist.get_rank()} "
                           f"(timeout {timeout_s:g} s): {_missing_ranks(label)}; cause: {type(exc).__name__}: {cause}")
