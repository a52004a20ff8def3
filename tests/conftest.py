"""Shared test setup: the zoo on sys.path and helpers that run eager and compiled steps side by side."""
from __future__ import annotations

import copy
import pathlib
import sys
from dataclasses import dataclass

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from zoo import OPTIMIZERS, ZOO  # noqa: E402

import fleetc  # noqa: E402
import fleetc.ir.usedef  # noqa: E402

fleetc.ir.usedef.CHECK = True  # every use-def index is verified against its block when a pass writes it back


def eager_step(model, optimizer, loss_fn, args, kwargs) -> torch.Tensor:
    """One eager training step, exactly as a user writes it."""
    optimizer.zero_grad(set_to_none=True)
    if loss_fn is None:
        out = model(*args, **kwargs)
        loss = out["loss"] if isinstance(out, dict) else out
    else:
        loss = loss_fn(model(*args[:-1], **kwargs), args[-1])
    loss.backward()
    optimizer.step()
    return loss.detach()


@dataclass
class SideBySide:
    """The outcome of training the same model eagerly and compiled."""

    eager_losses: list
    compiled_losses: list
    eager_model: torch.nn.Module
    compiled_model: torch.nn.Module
    trainer: fleetc.CompiledTrainer
    initial_state: dict

    def assert_same(self, rtol: float = 1e-5, atol: float = 1e-6) -> None:
        """Losses, every parameter and every buffer agree to fp32 tolerance; and training moved the parameters."""
        for step, (a, b) in enumerate(zip(self.eager_losses, self.compiled_losses)):
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=lambda m: f"loss of step {step}: {m}")
        eager_state, compiled_state = self.eager_model.state_dict(), self.compiled_model.state_dict()
        assert eager_state.keys() == compiled_state.keys()
        for name in eager_state:
            torch.testing.assert_close(compiled_state[name], eager_state[name], rtol=rtol, atol=atol,
                                       msg=lambda m: f"{name}: {m}")
        assert any(not torch.equal(compiled_state[k], v) for k, v in self.initial_state.items()), "nothing trained"

    def assert_compiled_identical(self, other: "SideBySide") -> None:
        """The compiled runs gave the same losses and state bit for bit (for rewrites meant to be exact)."""
        for step, (x, y) in enumerate(zip(self.compiled_losses, other.compiled_losses)):
            assert torch.equal(x, y), f"loss of step {step}: {x} vs {y}"
        mine, theirs = self.compiled_model.state_dict(), other.compiled_model.state_dict()
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), f"{name} differs"


def run_side_by_side(zoo_name: str, optimizer_name, steps: int = 3, strategy=None,
                     **compile_kwargs) -> SideBySide:
    """Train a model eagerly and a copy compiled for `steps` steps on the same batches and RNG seeds.

    `optimizer_name` names one of the zoo's OPTIMIZERS, or is a factory `params -> optimizer`."""
    entry = ZOO[zoo_name]
    make_optimizer = optimizer_name if callable(optimizer_name) else OPTIMIZERS[optimizer_name]
    torch.manual_seed(0)
    eager_model = entry.make_model()
    compiled_model = copy.deepcopy(eager_model)
    initial_state = copy.deepcopy(eager_model.state_dict())
    eager_opt = make_optimizer(eager_model.parameters())
    compiled_opt = make_optimizer(compiled_model.parameters())
    trainer = fleetc.compile(compiled_model, strategy, optimizer=compiled_opt, loss_fn=entry.loss_fn, verify=True,
                             **compile_kwargs)
    g = torch.Generator().manual_seed(1)
    eager_losses, compiled_losses = [], []
    for i in range(steps):
        args, kwargs = entry.make_batch(g)
        torch.manual_seed(100 + i)
        eager_losses.append(eager_step(eager_model, eager_opt, entry.loss_fn, args, kwargs))
        torch.manual_seed(100 + i)
        compiled_losses.append(trainer.step(*args, **kwargs))
    return SideBySide(eager_losses, compiled_losses, eager_model, compiled_model, trainer, initial_state)


@pytest.fixture
def zoo():
    return ZOO


@pytest.fixture
def interpret(monkeypatch, tmp_path):
    """Triton kernels run under TRITON_INTERPRET=1 (on CPU tensors), with a kernel cache of their own."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="session")
def cpu_kernel_cache(tmp_path_factory):
    """One C++ kernel cache for the whole session: each distinct generated kernel compiles once."""
    path = tmp_path_factory.mktemp("fleetc_cpu_kernels")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLEETC_CACHE_DIR", str(path))
        yield path
