"""Checkpoint test helpers: small trainers to save and load, and a snapshot of everything a load may change."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from helpers.gradient_merge import merge_strategy
from torch import nn

import fleetc

OPTIMIZERS = {"adam": lambda params: torch.optim.Adam(params, lr=1e-2),
              "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)}


def make_trainer(seed: int = 0, width: int = 16, optimizer: str = "adam", merge: int = 1,
                 dropout: float = 0.25) -> fleetc.CompiledTrainer:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(dropout), nn.Linear(width, 4))
    strategy = merge_strategy(merge) if merge > 1 else None
    return fleetc.compile(model, strategy, optimizer=OPTIMIZERS[optimizer](model.parameters()),
                          loss_fn=F.cross_entropy)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def train(trainer: fleetc.CompiledTrainer, steps: range) -> list[torch.Tensor]:
    return [trainer.step(*batch(i)) for i in steps]


def snapshot(trainer: fleetc.CompiledTrainer) -> dict[str, Any]:
    """Copies of the model, optimizer, fleetc-owned state and torch's RNG state."""
    return {"model": copy.deepcopy(trainer.model.state_dict()),
            "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
            "owned": {k: v.clone() for k, v in trainer.counters.items()},
            "rng": torch.get_rng_state()}


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Equal nested state (tensors exactly)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), f"{where}: {actual.keys()}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where
