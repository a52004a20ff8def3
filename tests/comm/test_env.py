"""The collective timeout: a bad FLEETC_COLLECTIVE_TIMEOUT never breaks `import fleetc`, and is named when used."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fleetc.comm import env
from fleetc.errors import FleetcError


def test_a_bad_environment_value_does_not_break_import_or_help():
    environment = dict(os.environ, FLEETC_COLLECTIVE_TIMEOUT="abc")
    done = subprocess.run([sys.executable, "-m", "fleetc", "--help"], env=environment, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "dump-ir" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("value", ["abc", "-5", "0", "nan", "inf"])
def test_a_bad_environment_value_is_named_when_the_timeout_is_needed(monkeypatch, value):
    monkeypatch.setattr(env, "_timeout_s", None)
    monkeypatch.setenv(env.TIMEOUT_ENV, value)
    with pytest.raises(FleetcError, match=f"FLEETC_COLLECTIVE_TIMEOUT must be a .*{value!r}"):
        env.collective_timeout()


def test_the_environment_and_fleet_init_set_the_timeout(monkeypatch):
    monkeypatch.setattr(env, "_timeout_s", None)
    monkeypatch.setenv(env.TIMEOUT_ENV, "12.5")
    assert env.collective_timeout().total_seconds() == 12.5
    env.set_collective_timeout(3)
    assert env.collective_timeout().total_seconds() == 3
    for bad in (-1, 0, float("nan"), "soon"):
        with pytest.raises(FleetcError, match="collective timeout must be a"):
            env.set_collective_timeout(bad)
