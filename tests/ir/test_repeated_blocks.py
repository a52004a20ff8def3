"""Repeated-block recognition (fleetc/ir/repeated_blocks.py): numbered sibling modules whose ops are the same up
to renaming, with the first difference named for the ones that are not."""
from __future__ import annotations

import torch
from helpers.scaling import encoder_and_batch
from torch import nn

import fleetc
from fleetc.capture import capture_eval_program, capture_train_program
from fleetc.ir.repeated_blocks import find_repeated_blocks


def test_encoder_layers_are_recognised_and_the_first_layer_differs_in_backward():
    model, optimizer, batch = encoder_and_batch(4)
    (group,) = find_repeated_blocks(capture_train_program(model, None, optimizer, batch, {}))
    assert group.prefix == "encoder.layers"
    assert group.members == ("encoder.layers.1", "encoder.layers.2", "encoder.layers.3")
    # the first layer reads the batch, which needs no gradient: its backward has no input-gradient ops
    assert group.others == ("encoder.layers.0",)
    assert group.line().startswith("encoder.layers: 3 of 4 blocks identical up to renaming (encoder.layers.0 "
                                   "differs: op ")
    with torch.no_grad():
        (forward_only,) = find_repeated_blocks(capture_eval_program(model.eval(), batch, {})[0])
    assert len(forward_only.members) == 4 and not forward_only.others


class Stack(nn.Module):
    """Four blocks; `odd` makes block 2 different (another activation, or another width)."""

    def __init__(self, odd: str = ""):
        super().__init__()
        widths = [8, 8, 16 if odd == "width" else 8, 8]
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, w), nn.GELU() if odd == "act" and i == 2 else
                                                  nn.ReLU(), nn.Linear(w, 8)) for i, w in enumerate(widths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


def _groups(odd: str) -> list:
    torch.manual_seed(0)
    model = Stack(odd)
    x = torch.randn(4, 8, requires_grad=True)  # every block computes its input's gradient: all alike
    return find_repeated_blocks(capture_train_program(model, None, torch.optim.SGD(model.parameters(), 0.1),
                                                      (x,), {}))


def test_a_block_with_another_op_or_shape_is_set_apart():
    (same,) = _groups("")
    assert len(same.members) == 4 and not same.others
    for odd in ("act", "width"):
        (group,) = _groups(odd)
        assert group.members == ("blocks.0", "blocks.1", "blocks.3") and group.others == ("blocks.2",), odd


def test_the_report_names_the_repeated_blocks():
    model, optimizer, batch = encoder_and_batch(2)
    trainer = fleetc.compile(model, optimizer=optimizer)
    trainer.step(*batch)
    assert trainer.report().repeated_blocks == [group.line() for group in
                                                find_repeated_blocks(trainer.history[0].program)]
    assert "repeated blocks: encoder.layers: 1 of 2 blocks identical" in str(trainer.report())
