"""torch.optim optimizers beyond the zoo's five (the traced update path), and every option of SGD / Adam / AdamW."""
from __future__ import annotations

from typing import Callable

import torch

# Captured by tracing torch's single-tensor update.
TRACED: dict[str, Callable] = {
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9, centered=True, weight_decay=1e-3),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=5e-2, lr_decay=1e-3, weight_decay=1e-3,
                                             initial_accumulator_value=0.1),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0, rho=0.8, weight_decay=1e-3),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2, weight_decay=1e-3),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2, weight_decay=1e-3, decoupled_weight_decay=True),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2, weight_decay=1e-3),
    "asgd": lambda p: torch.optim.ASGD(p, lr=1e-2, t0=1.0, weight_decay=1e-3),
    "rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "adam_amsgrad_maximize": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, maximize=True, weight_decay=1e-3),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
}

# SGD / Adam / AdamW options the hand-written updates cover.
HAND_WRITTEN: dict[str, Callable] = {
    "sgd_nesterov_maximize": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, maximize=True,
                                                       weight_decay=1e-3),
    "sgd_dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, dampening=0.3),
    "adam_maximize": lambda p: torch.optim.Adam(p, lr=1e-2, maximize=True, weight_decay=1e-3),
    "adamw_maximize": lambda p: torch.optim.AdamW(p, lr=1e-2, maximize=True),
}
