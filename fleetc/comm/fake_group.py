"""Torch's fake process group: run the real trainer as one rank of a world this machine cannot run.

`fleetc shard-plan` measures a few ranks of, say, 64 by building the data-parallel trainer in this process under
torch's fake backend, one rank after another. Fake collectives move no data and return at once, so losses and
values are meaningless, but Programs, shapes, sharding plans and the bytes a rank holds are the real ones.

A check whose answer comes from a collective (the cross-rank plan and model checks) cannot run here: its result
would be whatever the output buffer held. Under the fake group such a check is skipped and recorded, never passed.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from fleetc.comm import groups
from fleetc.errors import CollectiveError

_skipped: list[str] | None = None  # while a fake group is active: the checks skipped under it


def under_fake_group() -> bool:
    """Whether the default process group is torch's fake one."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


def skipped_under_fake_group(check: str) -> bool:
    """True (and `check` recorded) when the default group is fake: the caller must not run `check`, whose result
    would come from a collective that moves no data."""
    if not under_fake_group():
        return False
    if _skipped is not None and check not in _skipped:
        _skipped.append(check)
    return True


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[list[str]]:
    """This process as `rank` of `world_size` under torch's fake backend; yields the list of checks skipped under
    it. Refuses when a process group is already initialized (a real job must never be replaced by a fake one); the
    fake group and fleetc's communicator groups are always destroyed on exit, error or not."""
    global _skipped
    if dist.is_initialized():
        raise CollectiveError(f"cannot measure rank {rank} of {world_size} under torch's fake process group: a "
                              f"process group ({dist.get_backend()}) is already initialized in this process; run "
                              "fleetc shard-plan outside a distributed job")
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,  # torch's own, only needed here
    )

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    skipped: list[str] = []
    _skipped = skipped
    try:
        yield skipped
    finally:
        _skipped = None
        dist.destroy_process_group()
        groups.reset()
