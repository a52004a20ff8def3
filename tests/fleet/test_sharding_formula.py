"""`memory_stats()["sharding"]["formula_bytes"]` is the issue's ZeRO table, row by row (Ψ parameters, N ranks).

The multi-process tests compare each rank's measured bytes with `formula_bytes` within 10%; this pins the formula
itself to the table, so a wrong formula cannot make a wrong measurement look right.
"""
from __future__ import annotations

import pytest
import torch

from fleetc.fleet.sharding_memory import formula_bytes

PSI = 1200  # divisible by every N below: the table's fractions are whole bytes

# setting → (baseline, stage 1, stage 2, stage 3) as functions of N
TABLE = {
    "fp32 adam": (lambda n: 16 * PSI, lambda n: 8 * PSI + 8 * PSI / n, lambda n: 4 * PSI + 12 * PSI / n,
                  lambda n: 16 * PSI / n),
    "pure fp16 adam": (lambda n: 16 * PSI, lambda n: 4 * PSI + 12 * PSI / n, lambda n: 2 * PSI + 14 * PSI / n,
                       lambda n: 16 * PSI / n),
    "fp32 sgd momentum": (lambda n: 12 * PSI, lambda n: 8 * PSI + 4 * PSI / n, lambda n: 4 * PSI + 8 * PSI / n,
                          lambda n: 12 * PSI / n),
}


def optimizer(kind: str) -> torch.optim.Optimizer:
    params = [torch.zeros(1, requires_grad=True)]
    return {"adam": lambda: torch.optim.Adam(params), "adamw": lambda: torch.optim.AdamW(params),
            "momentum": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9)}[kind]()


@pytest.mark.parametrize("setting, kind, low", [("fp32 adam", "adam", False), ("fp32 adam", "adamw", False),
                                                ("pure fp16 adam", "adam", True),
                                                ("fp32 sgd momentum", "momentum", False)])
@pytest.mark.parametrize("degree", [2, 4, 8])
def test_the_formula_is_the_table(setting, kind, low, degree):
    for stage, row in enumerate(TABLE[setting]):
        want = row(1) if stage == 0 else row(degree)
        assert formula_bytes(optimizer(kind), PSI, 1 if stage == 0 else degree, stage, low) == want, (stage, want)


def test_plain_sgd_keeps_no_state():
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert formula_bytes(sgd, PSI, 2, 1, False) == 4 * PSI + 4 * PSI
