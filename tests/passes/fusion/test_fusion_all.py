"""Every fusion flag on at once: the groups fused per zoo model, and the differential harness against eager."""
from __future__ import annotations

import pytest
from conftest import run_side_by_side
from fusion_helpers import FUSION_FLAGS, fusion_strategy
from zoo import ZOO

from fleetc.ops import registered_ops

# zoo model → pass → (forward groups, backward groups) fused with every flag on; passes absent here must
# report why they did nothing. Optimizer fusion: (fused ops, parameters they update).
EXPECTED = {
    "mlp": {"fuse_gemm_epilogue": (3, 3), "fuse_all_optimizer_ops": (1, 6)},
    "cnn": {"fuse_bn_add_act": (2, 2), "fuse_bn_act": (3, 3), "fuse_gemm_epilogue": (1, 1),
            "fuse_all_optimizer_ops": (1, 17)},
    "gpt": {"fuse_gemm_epilogue": (8, 8), "fuse_dropout_add": (4, 4), "fuse_all_optimizer_ops": (1, 28)},
    "unused_param": {"fuse_gemm_epilogue": (1, 1), "fuse_all_optimizer_ops": (1, 2)},
    "loss_dict": {"fuse_gemm_epilogue": (3, 3), "fuse_all_optimizer_ops": (1, 6)},
}
FUSION_PASSES = ("fuse_bn_add_act", "fuse_bn_act", "fuse_gemm_epilogue", "fuse_dropout_add", "fuse_elewise_add_act",
                 "fuse_all_optimizer_ops")


def _check_counts(zoo_name: str, trainer) -> None:
    report = trainer.report()
    for name in FUSION_PASSES:
        stats = report.stats[name]
        if name not in EXPECTED[zoo_name]:
            assert not stats and name in report.skipped, f"{zoo_name}: {name} should report why it did nothing"
        elif name == "fuse_all_optimizer_ops":
            assert (stats["fused_ops"], stats["params_fused"]) == EXPECTED[zoo_name][name]
        else:
            assert (stats["forward_groups"], stats["backward_groups"]) == EXPECTED[zoo_name][name], name
            assert "backward_not_fused" not in stats
    for op in trainer.program.global_block.ops:
        if op.type.startswith("fleetc.fused_"):
            assert op.attrs["provenance"] in FUSION_PASSES and op.attrs["op_role"] and "module_path" in op.attrs


def test_every_fused_op_documents_its_aten_decomposition():
    fused = {name: d for name, d in registered_ops().items() if name.startswith("fleetc.fused_")}
    # 12 from the named fusion passes (dropout+add in two RNG forms), fused_elementwise, fused LARS and LAMB
    assert len(fused) == 15
    for name, op in fused.items():
        assert "aten" in (op.reference.__doc__ or ""), f"{name} has no aten decomposition in its docstring"


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_name", ["sgd", "momentum", "adamw"])
@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_every_flag_on_matches_eager(zoo_name, optimizer_name):
    run = run_side_by_side(zoo_name, optimizer_name, strategy=fusion_strategy(*FUSION_FLAGS))
    run.assert_same()
    _check_counts(zoo_name, run.trainer)
    assert not any(k.startswith("build_strategy.fuse") for k in run.trainer.report().skipped)
