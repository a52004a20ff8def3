"""Eager and compiled training of copies of one model, with the same change made to both between steps."""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from conftest import eager_step
from torch import nn

import fleetc

Change = Callable[[nn.Module, torch.optim.Optimizer], None]


class Block(nn.Module):
    """Linear → BatchNorm → Dropout, scaled by a plain attribute the forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 4)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.bn(self.fc(x)))) / self.temperature


def batches(count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(count)]


@dataclass
class Pair:
    eager: nn.Module
    compiled: nn.Module
    eager_opt: torch.optim.Optimizer
    compiled_opt: torch.optim.Optimizer
    trainer: fleetc.CompiledTrainer
    eager_losses: list
    compiled_losses: list

    def assert_same(self) -> None:
        """Losses, parameters, buffers (BatchNorm's num_batches_tracked included) agree to fp32 tolerance."""
        torch.testing.assert_close(torch.stack(self.compiled_losses), torch.stack(self.eager_losses))
        eager, compiled = self.eager.state_dict(), self.compiled.state_dict()
        assert eager.keys() == compiled.keys()
        for name in eager:
            torch.testing.assert_close(compiled[name], eager[name], msg=lambda m: f"{name}: {m}")


def train_pair(make_model: Callable[[], nn.Module], steps: int, changes: dict[int, Change] | None = None,
               make_optimizer: Callable = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
               loss_fn: Callable | None = F.cross_entropy, make_batches: Callable = batches,
               **compile_options) -> Pair:
    """Train an eager model and a compiled copy for `steps` steps on the same batches and RNG seeds; before step
    i, `changes[i](model, optimizer)` is applied to both."""
    torch.manual_seed(0)
    eager = make_model()
    compiled = copy.deepcopy(eager)
    eager_opt, compiled_opt = make_optimizer(eager.parameters()), make_optimizer(compiled.parameters())
    trainer = fleetc.compile(compiled, optimizer=compiled_opt, loss_fn=loss_fn, verify=True, **compile_options)
    pair = Pair(eager, compiled, eager_opt, compiled_opt, trainer, [], [])
    for i, (x, y) in enumerate(make_batches(steps)):
        if changes and i in changes:
            changes[i](eager, eager_opt)
            changes[i](compiled, compiled_opt)
        torch.manual_seed(100 + i)
        pair.eager_losses.append(eager_step(eager, eager_opt, loss_fn, (x, y), {}))
        torch.manual_seed(100 + i)
        pair.compiled_losses.append(trainer.step(x, y))
    return pair
