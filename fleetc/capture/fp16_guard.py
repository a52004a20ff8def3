"""`fleetc.fp16_guard`: marks the ops traced inside it (and their backward ops) as a low-precision region.

Paddle's `paddle.static.amp.fp16_guard`: with `amp_configs.use_pure_fp16` and `use_fp16_guard` (the default),
the AMP pass casts only the ops inside such regions to low precision; the rest of the step stays float32.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.fx.traceback

ATTR = "fp16_guard"  # the op attribute (and fx node annotation) that marks a guarded op


@contextlib.contextmanager
def fp16_guard() -> Iterator[None]:
    """Use inside `forward`: `with fleetc.fp16_guard(): ...`; outside capture it does nothing."""
    with torch.fx.traceback.annotate({ATTR: True}):
        yield
