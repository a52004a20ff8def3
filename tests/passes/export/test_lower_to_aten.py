"""lower_to_aten: every fused op of an eval Program becomes the aten ops of its reference, with the same results."""
from __future__ import annotations

import pytest
import torch
from helpers.export import fusion_strategy, trained
from torch import nn
from zoo import ZOO

import fleetc
from fleetc.errors import PassError
from fleetc.fleet.export_sources import model_state
from fleetc.ir.verifier import verify
from fleetc.passes.export import LowerToAten
from fleetc.runtime.executor import Executable


class Pointwise(nn.Module):
    """relu(a + b) for the add+act fusion, then a pointwise chain with a reduction for auto fusion."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x) + self.b(x))
        return torch.tanh(h * 0.5 + 1.0).sum(dim=-1)


def _pointwise_case(flag: str):
    torch.manual_seed(0)
    model = Pointwise()
    strategy = fleetc.DistributedStrategy()
    setattr(strategy.build_strategy, flag, True)
    trainer = fleetc.compile(model, strategy, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=nn.functional.mse_loss, verify=True)
    x = torch.randn(4, 8)
    trainer.step(x, torch.randn(4))
    return trainer, (x,)


CASES = {
    "cnn": lambda: trained(ZOO["cnn"], fusion_strategy(), steps=1)[:2],  # bn+act, bn+add+act, gemm
    "gpt": lambda: trained(ZOO["gpt"], fusion_strategy(), steps=1)[:2],  # gemm with gelu, with a reshape
    "add_act": lambda: _pointwise_case("fuse_elewise_add_act_ops"),
    "auto_fusion": lambda: _pointwise_case("enable_auto_fusion"),
}
FUSED = {"cnn": {"fleetc.fused_bn_act", "fleetc.fused_bn_add_act", "fleetc.fused_gemm_epilogue"},
         "gpt": {"fleetc.fused_gemm_epilogue"}, "add_act": {"fleetc.fused_elemwise_add_act"},
         "auto_fusion": {"fleetc.fused_elementwise"}}


@pytest.mark.parametrize("case", list(CASES))
def test_lowered_program_is_aten_only_and_computes_the_same(case):
    trainer, args = CASES[case]()
    trainer(*args)
    program = trainer.eval_program
    assert {op.type for op in program.global_block.ops if op.type.startswith("fleetc.")} == FUSED[case]
    lowered, report = LowerToAten().run(program.clone(), trainer.config)
    verify(lowered, after_pass="lower_to_aten")
    assert all(op.type.startswith("aten.") for _, op in lowered.walk_ops())
    assert report.stats["ops_lowered"] == sum(op.type.startswith("fleetc.") for op in program.global_block.ops)
    assert lowered.num_ops() == program.num_ops() - report.stats["ops_lowered"] + report.stats["aten_ops_emitted"]
    for fused in [op for op in program.global_block.ops if op.type.startswith("fleetc.")]:
        made = [op for op in lowered.global_block.ops if op.name.startswith(fused.name + ".")]
        assert made and all(op.attrs.get("provenance") == "lower_to_aten" for op in made)
        assert all((op.module_path, op.attrs.get("source")) == (fused.module_path, fused.attrs.get("source"))
                   for op in made)
    state = model_state(trainer.model)
    feeds = list(args)
    want = Executable(program).run(state, feeds)
    got = Executable(lowered).run(state, feeds)
    assert want.keys() == got.keys()
    for key in want:  # the reference is the fused op's semantics: bit for bit
        assert torch.equal(got[key], want[key]), key


def test_an_op_writing_state_is_refused():
    trainer, _ = CASES["cnn"]()
    with pytest.raises(PassError, match="writes the persistable 'bn.num_batches_tracked'"):
        LowerToAten().run(trainer.program.clone(), trainer.config)  # the training Program updates BatchNorm stats


def test_a_program_without_fleetc_ops_is_left_alone():
    trainer, args, _ = trained(ZOO["mlp"], steps=1)
    trainer(*args)
    lowered, report = LowerToAten().run(trainer.eval_program.clone(), trainer.config)
    assert not report.changed and report.skipped_reason == "the Program has no fleetc ops"
    assert str(lowered) == str(trainer.eval_program)
