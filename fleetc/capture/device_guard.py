"""`fleetc.device_guard`: marks the ops traced inside it (and their backward ops) with an `op_device`."""
from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch.fx.traceback

_DEVICE = re.compile(r"^(cpu|gpu(:\d+)?|cuda(:\d+)?|stage:\d+)$")


@contextlib.contextmanager
def device_guard(device: str) -> Iterator[None]:
    """Use inside `forward`: `with fleetc.device_guard("stage:1"): ...`; outside capture it does nothing.

    Accepted values: "cpu", "gpu", "gpu:N", "cuda:N", "stage:N" (pipeline stages read the latter).
    """
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise ValueError(f"device_guard({device!r}): expected 'cpu', 'gpu', 'gpu:N', 'cuda:N' or 'stage:N'")
    with torch.fx.traceback.annotate({"op_device": device}):
        yield
