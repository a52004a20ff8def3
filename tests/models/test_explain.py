"""`fleetc explain`: what works per preset, and for a failure the construct, the user's file:line and a workaround."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fleetc.cli import main
from fleetc.fleet.explain import PRESETS, explain, repeated_blocks


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent control flow: not capturable
            return h
        return -h


def branchy_step() -> dict:
    torch.manual_seed(0)
    return {"model": _Branchy(), "args": (torch.randn(2, 4), torch.randn(2, 4)), "loss_fn": F.mse_loss}


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)


def test_explain_prints_the_users_file_line_for_an_unsupported_model(capsys):
    status = main(["explain", "test_explain:branchy_step"])
    out = capsys.readouterr().out
    assert status == 1
    line = _Branchy.forward.__code__.co_firstlineno + 2
    assert f"test_explain.py:{line}" in out
    assert "data-dependent Python control flow" in out
    assert "workaround: compute both branches and pick with torch.where" in out
    assert f"\n{', '.join(PRESETS)}: data-dependent Python control flow" in out  # one paragraph for all
    assert "_tensor_constant" not in out and "Traceback" not in out


def test_explain_passes_a_supported_model_under_the_presets_it_tries():
    torch.manual_seed(0)
    model = _Blocks()
    batches = [((torch.randn(3, 4), torch.randn(3, 4)), {}) for _ in range(3)]
    outcomes = explain(model, batches, F.mse_loss, ("default", "recompute_blocks", "gradient_merge"), verify=True)
    assert [(o.preset, o.ok, o.construct) for o in outcomes] == [
        ("default", True, ""), ("recompute_blocks", True, ""), ("gradient_merge", True, "")]
    assert repeated_blocks(model) == ["layers.0", "layers.1"]
