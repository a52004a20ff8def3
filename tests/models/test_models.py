"""Tiny Hugging Face architectures (tests/models/factories.py) train compiled exactly like eager PyTorch.

CI runs every architecture under the default preset (first-step gradients, then parameters after SGD+momentum and
AdamW steps; fleetc/fleet/explain.py) and each other preset on one architecture, rotating by the day over those
README.md's support matrix records as passing it; `FLEETC_FULL=1` runs every architecture under every preset (what
scripts/support_matrix.py records in README.md), and a cell recorded as failing must still fail (else the matrix is
stale: regenerate it).
"""
from __future__ import annotations

import datetime
import os

import pytest
from factories import ARCHITECTURES
from helpers.support_matrix import recorded_cells

from fleetc.fleet.explain import PRESETS, STEPS, check_preset

FULL = bool(os.environ.get("FLEETC_FULL"))
_NAMES = sorted(ARCHITECTURES)
_DAY = datetime.date.today().toordinal()
RECORDED = recorded_cells()


def _rotating(i: int, preset: str) -> str:
    """Outside FLEETC_FULL, each non-default preset runs on one architecture that the matrix records as passing it,
    rotating daily."""
    passing = [name for name in _NAMES if RECORDED[name][preset] == "pass"]
    return passing[(_DAY + 5 * i) % len(passing)]


ROTATING = {preset: _rotating(i, preset) for i, preset in enumerate(PRESETS[1:])}


def _check(name: str, preset: str) -> None:
    case = ARCHITECTURES[name]()
    model, batches = case.build(STEPS)
    outcome = check_preset(model, batches, case.loss_fn, preset, verify=True)
    if RECORDED[name][preset] != "pass":
        assert not outcome.ok, (f"{name} under {preset} now passes but README.md's support matrix records "
                                f"{RECORDED[name][preset]!r}: regenerate it (scripts/support_matrix.py)")
        return
    assert outcome.ok, f"{name} under {preset}: {outcome.construct} at {outcome.location or '?'}"


@pytest.mark.slow
@pytest.mark.parametrize("name", _NAMES)
def test_architecture_trains_like_eager_under_the_default_preset(name):
    _check(name, "default")


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS[1:])
def test_rotating_architecture_under_each_other_preset(preset):
    _check(ROTATING[preset], preset)


@pytest.mark.skipif(not FULL, reason="the whole architecture x preset matrix runs with FLEETC_FULL=1")
@pytest.mark.parametrize("preset", PRESETS[1:])
@pytest.mark.parametrize("name", _NAMES)
def test_full_matrix(name, preset):
    _check(name, preset)
