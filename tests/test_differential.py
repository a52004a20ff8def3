"""The differential harness: every zoo model × optimizer, compiled steps match eager steps."""
from __future__ import annotations

import pytest
from conftest import run_side_by_side
from zoo import OPTIMIZERS, ZOO


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_compiled_training_matches_eager(zoo_name, optimizer_name):
    run = run_side_by_side(zoo_name, optimizer_name)
    run.assert_same()
    assert [r.name for r in run.trainer.history][0] == "capture"


@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_optimizer_state_lives_in_the_users_optimizer(zoo_name):
    run = run_side_by_side(zoo_name, "adamw", steps=2)
    state = run.trainer.optimizer.state_dict()["state"]
    assert state, "AdamW state must be visible through optimizer.state_dict()"
    for entry in state.values():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(entry["step"]) == 2.0
