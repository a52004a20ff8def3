"""Gradient-merge test helpers: strategies, compiled trainers, and eager accumulation over the zoo's batches."""
from __future__ import annotations

import torch
from zoo import OPTIMIZERS, ZOO

import fleetc


def merge_strategy(k_steps: int, avg: bool = True) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": k_steps, "avg": avg}
    return strategy


def _optimizer_factory(optimizer_name):
    """A zoo optimizer's name, or a factory `params -> optimizer`."""
    return optimizer_name if callable(optimizer_name) else OPTIMIZERS[optimizer_name]


def compiled(zoo_name: str, optimizer_name, strategy) -> tuple[torch.nn.Module, fleetc.CompiledTrainer]:
    entry = ZOO[zoo_name]
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, strategy, optimizer=_optimizer_factory(optimizer_name)(model.parameters()),
                             loss_fn=entry.loss_fn, verify=True)
    return model, trainer


def assert_same_state(actual: dict, expected: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def eager_accumulation(zoo_name: str, optimizer_name, k_steps: int, avg: bool, micro_steps: int):
    """The PyTorch idiom gradient merge replaces: backward every micro-batch, step and zero_grad every k."""
    entry = ZOO[zoo_name]
    torch.manual_seed(0)
    model = entry.make_model()
    optimizer = _optimizer_factory(optimizer_name)(model.parameters())
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(micro_steps):
        args, kwargs = entry.make_batch(g)
        torch.manual_seed(100 + i)
        if entry.loss_fn is None:
            loss = model(*args, **kwargs)["loss"]
        else:
            loss = entry.loss_fn(model(*args[:-1], **kwargs), args[-1])
        (loss / k_steps if avg else loss).backward()
        losses.append(loss.detach())
        if (i + 1) % k_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
    return model, losses


def run_merged(trainer: fleetc.CompiledTrainer, zoo_name: str, micro_steps: int, first: int = 0,
               g: torch.Generator | None = None) -> list:
    """Micro-steps `first`… on the zoo's batch stream (`g`, seeded 1 by default), RNG seeded per micro-step."""
    entry = ZOO[zoo_name]
    g = torch.Generator().manual_seed(1) if g is None else g
    losses = []
    for i in range(first, first + micro_steps):
        args, kwargs = entry.make_batch(g)
        torch.manual_seed(100 + i)
        losses.append(trainer.step(*args, **kwargs))
    return losses
