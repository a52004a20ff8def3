"""Reuse of repeated blocks (issue 25): named fusions match once per distinct block (fusion/reuse.py) and AMP infers
dtypes once per distinct op (precision/dtype_memo.py). A Program built with reuse prints exactly as one built
without it (`FLEETC_BLOCK_REUSE=0`), trains to the same bits, and the report says how many blocks reused a plan."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers.scaling import Encoder, all_passes_strategy
from torch import nn
from zoo import TinyGPT, _gpt_batch, _lm_loss

import fleetc
from fleetc.capture import capture_train_program
from fleetc.ir.block_copies import REUSE_ENV, find_block_copies, reuse_enabled
from fleetc.ir.program import OpRole

FUSION_PASSES = ("fuse_gemm_epilogue", "fuse_dropout_add", "fuse_elewise_add_act")


def _strategy() -> fleetc.DistributedStrategy:
    """Every fusion, recompute "auto" and AMP in bf16."""
    strategy = all_passes_strategy()
    strategy.amp = True
    strategy.amp_configs = {"dtype": "bfloat16"}
    return strategy


def _gpt():
    g = torch.Generator().manual_seed(3)
    return TinyGPT(layers=4), [_gpt_batch(g)[0] for _ in range(2)], _lm_loss


def _encoder():
    g = torch.Generator().manual_seed(3)
    return Encoder(4), [(torch.randn(4, 32, 64, generator=g),) for _ in range(2)], None


def _train(make, monkeypatch, reuse: bool, strategy=None) -> tuple[fleetc.CompiledTrainer, list[torch.Tensor]]:
    monkeypatch.setenv(REUSE_ENV, "1" if reuse else "0")
    torch.manual_seed(0)
    model, batches, loss_fn = make()
    trainer = fleetc.compile(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=loss_fn,
                             strategy=strategy or _strategy())
    torch.manual_seed(1)
    return trainer, [trainer.step(*batch).detach() for batch in batches]


def _reused(trainer, pass_name: str) -> list[tuple[int, int]]:
    """(blocks that reused, blocks) per group of identical blocks, from the report's lines for `pass_name`."""
    lines = [line for line in trainer.report().repeated_blocks if line.startswith(f"{pass_name}: ")]
    return [tuple(map(int, re.search(r"(\d+) of (\d+) blocks", line).groups())) for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize("make", [_gpt, _encoder], ids=["gpt_4_layers", "transformer_encoder_4_layers"])
def test_reuse_builds_the_same_program_and_says_so(make, monkeypatch):
    reused, reused_losses = _train(make, monkeypatch, reuse=True)
    plain, plain_losses = _train(make, monkeypatch, reuse=False)
    assert str(reused.program) == str(plain.program)
    for got, want in zip(reused_losses, plain_losses):
        assert torch.equal(got, want)
    for name in (*FUSION_PASSES, "amp"):
        counts = _reused(reused, name)
        assert counts and all(n >= 1 for n, _ in counts), (name, reused.report().repeated_blocks)
        assert not _reused(plain, name)  # reuse off: nothing reused, nothing claimed


class Stack(nn.Module):
    """Four identical blocks; a ReLU follows each block but the last, outside the blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x) if i == 3 else F.relu(block(x))
        return x.pow(2).mean()


def _stack():
    g = torch.Generator().manual_seed(3)
    return Stack(), [(torch.randn(4, 8, generator=g, requires_grad=False),) for _ in range(2)], None


def test_a_block_whose_surroundings_differ_is_matched_on_its_own(monkeypatch):
    """The gemm matcher fuses each block's last Linear with the ReLU after the block, except in the last block,
    which no ReLU follows: that block cannot take the others' answer there, gives its own, and follows it."""
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.fuse_gemm_epilogue = True
    reused, reused_losses = _train(_stack, monkeypatch, reuse=True, strategy=strategy)
    plain, plain_losses = _train(_stack, monkeypatch, reuse=False, strategy=strategy)
    assert str(reused.program) == str(plain.program)
    assert all(torch.equal(a, b) for a, b in zip(reused_losses, plain_losses))
    lines = [line for line in reused.report().repeated_blocks if line.startswith("fuse_gemm_epilogue: ")]
    assert len(lines) == 1 and "followed those: blocks.3)" in lines[0], lines
    assert _reused(reused, "fuse_gemm_epilogue")[0][0] >= 1
    activations = [op.args[4] for op in reused.program.global_block.ops if op.type == "fleetc.fused_gemm_epilogue"]
    assert activations.count("relu") == 3 and activations.count("tanh") == 4, activations


def _captured_stack():
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(4, 8, requires_grad=True)  # every block computes its input's gradient: all alike
    return capture_train_program(model, None, torch.optim.SGD(model.parameters(), 0.1), (x,), {})


def _second_block_op(program, op_type: str):
    return next(op for op in program.global_block.ops if op.module_path.startswith("blocks.2") and op.type == op_type)


@pytest.mark.parametrize("change", ["dtype", "shape", "constant", "role", "attribute"])
def test_copies_are_verified_op_by_op(change):
    program = _captured_stack()
    before = find_block_copies(program)
    assert before.reference["blocks.2"] == before.reference["blocks.1"]
    addmm = _second_block_op(program, "aten.addmm.default")
    if change == "dtype":
        program.var(addmm.outputs[0]).dtype = "bfloat16"
    elif change == "shape":
        program.var(addmm.outputs[0]).shape = (8, 16)
    elif change == "constant":
        addmm.kwargs = {"beta": 2}
    elif change == "role":
        addmm.attrs["op_role"] = int(OpRole.BACKWARD)
    else:
        addmm.attrs["source"] = "elsewhere.py:1"
    after = find_block_copies(program)
    assert after.reference.get("blocks.2") != after.reference["blocks.1"]
    assert after.reference["blocks.3"] == after.reference["blocks.1"]  # the others still share one plan


def test_the_switch_chooses_who_reuses(monkeypatch):
    monkeypatch.delenv(REUSE_ENV, raising=False)
    assert reuse_enabled("amp") and not reuse_enabled("fusion")  # fusion replay is opt-in (docs/ir.md says why)
    for value, amp, fusion in (("0", False, False), ("1", True, True), ("fusion", False, True),
                               ("fusion,amp", True, True)):
        monkeypatch.setenv(REUSE_ENV, value)
        assert (reuse_enabled("amp"), reuse_enabled("fusion")) == (amp, fusion), value
