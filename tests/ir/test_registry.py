"""`register_op(..., draws_random=True)`: the flag is true exactly of the ops that advance the default generator,
and the scheduler's ordering of random draws (fleetc/runtime/dependencies.py) reads it from the registry."""
from __future__ import annotations

import pytest
import torch

from fleetc.ir.registry import op_def, registered_ops
from fleetc.runtime.dependencies import draws_random

X = torch.randn(4, 8)
MASK = torch.rand(4, 8) > 0.5
RNG_STATE = torch.tensor([7, 0])

# Every dropout-family fleetc op, with arguments for one training-mode call.
CALLS = {
    "fleetc.fused_dropout_add": (X, X, 0.5, True),
    "fleetc.fused_dropout_add_philox": (X, X, 0.5, True),
    "fleetc.dropout_replay": (X, MASK, 0.5, True),
    "fleetc.philox_dropout_mul": (X, RNG_STATE, 0.5, True, 2.0),
}


@pytest.mark.parametrize("op_type", sorted(CALLS))
def test_the_flag_says_whether_the_reference_advances_the_default_generator(op_type):
    before = torch.get_rng_state()
    op_def(op_type).reference(*CALLS[op_type])
    advanced = not torch.equal(before, torch.get_rng_state())
    assert op_def(op_type).draws_random == advanced
    assert draws_random(op_type) == advanced


def test_every_op_flagged_as_drawing_is_checked_above():
    flagged = {name for name, definition in registered_ops().items() if definition.draws_random}
    assert flagged and flagged <= set(CALLS)
