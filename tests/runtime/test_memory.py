"""The allocation-peak measurement (fleetc/runtime/memory.py) that the bench compares eager and fleetc with."""
from __future__ import annotations

import torch

from fleetc.runtime.memory import allocation_peak_bytes

KIB = 1024


def _transient(kib: int) -> None:
    torch.empty(kib * KIB // 4).fill_(1.0)


def test_peak_is_what_the_function_allocated_above_what_was_live():
    assert allocation_peak_bytes(lambda: _transient(64)) == 64 * KIB


def test_tensors_kept_from_an_earlier_measurement_do_not_count():
    kept = []
    assert allocation_peak_bytes(lambda: kept.append(torch.empty(256 * KIB // 4))) == 256 * KIB
    assert allocation_peak_bytes(lambda: _transient(64)) == 64 * KIB  # the 256 KiB still alive are not counted
    assert kept
