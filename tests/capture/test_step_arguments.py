"""What `step()` accepts: Python scalars (baked in, guarded), any grad mode, inputs that require grad."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import eager_step
from torch import nn
from zoo import MLP

import fleetc


class Scaled(nn.Module):
    """A forward with Python scalar arguments, as Hugging Face models have (`use_cache=False`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, times: int = 1, scale: float = 1.0, use_cache: bool = True) -> torch.Tensor:
        out = self.fc(x) * scale * times
        return out if use_cache else out.relu()


def _pair():
    torch.manual_seed(0)
    eager = Scaled()
    compiled = copy.deepcopy(eager)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    trainer = fleetc.compile(compiled, optimizer=torch.optim.SGD(compiled.parameters(), lr=0.1),
                             loss_fn=lambda out, target: F.mse_loss(out, target), verify=True)
    return eager, eager_opt, compiled, trainer


def test_python_scalar_arguments_specialize_the_program():
    eager, eager_opt, compiled, trainer = _pair()
    x, target = torch.randn(4, 8), torch.randn(4, 4)
    calls = [((x, 3, target), {}), ((x, target), {"scale": 2.0}), ((x, target), {"use_cache": False}),
             ((x, target), {"scale": 2.0})]
    for args, kwargs in calls:
        # the target is the last positional argument: move it there for the eager call too
        expected = eager_step(eager, eager_opt, lambda out, t: F.mse_loss(out, t), args, kwargs)
        torch.testing.assert_close(trainer.step(*args, **kwargs), expected)
    for name, p in compiled.named_parameters():
        torch.testing.assert_close(p, eager.get_parameter(name))
    lines = trainer.report().recompiles
    assert len(lines) == 2  # the last call reuses the scale=2.0 Program
    assert "argument kwargs['use_cache'] changed: not given when compiled, now False" in lines[1]
    assert {(g.target, g.expected) for g in trainer._last_train.guards.record.of_kind("constant_arg")} == \
        {("kwargs['scale']", 2.0)}


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_first_step_under_no_grad_or_inference_mode_trains(mode):
    torch.manual_seed(0)
    eager, compiled = MLP(), MLP()
    compiled.load_state_dict(eager.state_dict())
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    trainer = fleetc.compile(compiled, optimizer=torch.optim.SGD(compiled.parameters(), lr=0.1),
                             loss_fn=F.cross_entropy)
    for _ in range(2):
        with mode():
            x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
            loss = trainer.step(x, y)
        expected = eager_step(eager, eager_opt, F.cross_entropy, (x.clone(), y.clone()), {})
        torch.testing.assert_close(loss, expected)
    for name, p in compiled.named_parameters():
        torch.testing.assert_close(p, eager.get_parameter(name))


def test_an_input_that_requires_grad_gets_its_gradient():
    torch.manual_seed(0)
    eager, compiled = MLP(), MLP()
    compiled.load_state_dict(eager.state_dict())
    trainer = fleetc.compile(compiled, optimizer=torch.optim.SGD(compiled.parameters(), lr=0.1),
                             loss_fn=F.cross_entropy, verify=True)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = eager_step(eager, eager_opt, F.cross_entropy, (x_eager, y), {})
    torch.testing.assert_close(trainer.step(x_compiled, y), expected)
    torch.testing.assert_close(x_compiled.grad, x_eager.grad)
    for name, p in compiled.named_parameters():
        torch.testing.assert_close(p, eager.get_parameter(name))


def test_a_loss_fn_returning_a_tuple_is_named_as_the_culprit():
    trainer = fleetc.compile(MLP(), loss_fn=lambda out, target: (F.cross_entropy(out, target), out))
    with pytest.raises(fleetc.CaptureError) as error:
        trainer.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert "loss_fn returned tuple" in str(error.value) and "loss_fn=None" not in str(error.value)
