"""Flat-bucket stages 2 and 3 composed with AMP, global-norm clipping and gradient merge, as the Program of one rank of
two (no processes; tests/fleet/test_sharding.py trains these against unsharded data parallel on 2 gloo ranks)."""
from __future__ import annotations

import pytest
import torch
from helpers.data_parallel import captured_program, run_data_parallel_passes

import fleetc
from fleetc.comm.mesh import ProcessMesh
from fleetc.fleet.trainer import sharding_metadata
from fleetc.ir.program import VarKind
from fleetc.passes.data_parallel.common import START, var_numel
from fleetc.passes.data_parallel.merged import update_block
from fleetc.passes.sharding.clip_sharding import NORM_SUM
from fleetc.passes.sharding.estimate import rank_plans
from fleetc.passes.sharding.optimizer_sharding import FOUND_INF_MAX, RS_START, RS_WAIT
from fleetc.passes.sharding.param_sharding import GATHER_START

STAGE_2 = {"sharding": True, "sharding_configs": {"stage": 2, "sharding_degree": 2}}
MERGE = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}


@pytest.fixture(scope="module")
def mlp():
    return captured_program("mlp")


def rank_0(program, grad_clip=None, sharding=STAGE_2, **fields):
    stamped = program.clone()
    stamped.metadata["sharding"] = sharding_metadata(ProcessMesh(sharding=2), 0)
    final, history = run_data_parallel_passes(stamped, 2, grad_clip=grad_clip, **sharding, **fields)
    return final, history["sharding"].report


def test_amp_and_clipping_read_pieces_and_agree_over_the_ranks(mlp):
    """mlp's one bucket (6922 elements) split in two: rank 0's range ends inside fc2.weight (4096 elements, first in
    the bucket after out.*: 650 + 2811 = 3461). AMP's unscaled and the clipped gradient of that piece are pieces too;
    found_inf is max-allreduced and the squared norm of the pieces summed over the ranks."""
    final, report = rank_0(mlp, grad_clip=fleetc.ClipGradByGlobalNorm(0.05), amp=True)
    assert report.stats["params_split"] >= 1 and "flat buckets split evenly" in " ".join(report.notes)
    assert final.metadata["state_pieces"] == {"fc2.weight@momentum_buffer": [0, 2811]}  # SGD with momentum
    update = next(op for _, op in final.walk_ops() if op.attrs.get("param") == "fc2.weight")
    gradient = final.find_var(update.args[1].name, 1)
    assert update.args[1].name.endswith("@CLIP") and tuple(gradient.shape) == (2811,)
    types = [op.type for _, op in final.walk_ops()]
    assert types.count(FOUND_INF_MAX) == 1 and types.count(NORM_SUM) == 1


def test_gradient_merge_reduce_scatters_the_accumulators_once_per_k_steps(mlp):
    final, report = rank_0(mlp, **MERGE)
    block = update_block(final)
    assert [op.type for op in block.ops].count(RS_START) == 1 and START not in [op.type for op in block.ops]
    assert not [op for op in final.global_block.ops if op.type == RS_START]  # nothing in the per-step ops
    update = next(op for op in block.ops if op.attrs.get("param") == "fc2.weight")
    assert tuple(final.var(update.args[1].name).shape) == (2811,)
    zeroed = {op.args[0].name for op in block.ops if op.type == "fleetc.zero"}
    accumulators = set(final.metadata["gradient_merge"]["accumulators"].values())
    assert accumulators <= zeroed  # every one, whole
    assert all(final.var(a).shape == final.var(a.removesuffix("@GRAD@MERGE")).shape for a in accumulators)
    assert report.stats["params_split"] >= 1
    unsharded, _ = run_data_parallel_passes(mlp, 2, **MERGE)
    plan = rank_plans(unsharded, 2, 2)[0]  # the pre-launch estimate plans the same pieces
    assert plan.owned_params == len(final.metadata["sharding"]["owned"])
    assert plan.optimizer_state_bytes == sum(v.nbytes() for v in final.persistables()
                                             if v.kind is VarKind.OPTIMIZER_STATE)
    assert plan.gradient_bytes == sum(final.var(op.outputs[0]).nbytes() for op in block.ops if op.type == RS_WAIT)


def test_what_needs_whole_gradients_keeps_whole_parameter_ownership(mlp):
    final, report = rank_0(mlp, grad_clip=fleetc.ClipGradByNorm(0.05))
    assert "params_split" not in report.stats and "state_pieces" not in final.metadata
    assert any(note.startswith("stage 2 owns whole parameters here") and "fleetc.clip_by_norm reads whole gradients"
               in note for note in report.notes)


PURE_BF16 = {"amp": True, "amp_configs": {"use_pure_fp16": True, "use_fp16_guard": False, "dtype": "bfloat16"}}


def test_pure_low_precision_updates_pieces_of_the_averaged_gradients(mlp):
    """use_pure_fp16: the bfloat16 gradients are reduce-scattered (low_precision.py) and the master weight's update
    reads the float32 cast of the averaged piece, so stage 2 cuts it into pieces like any other
    (tests/fleet/test_sharding.py trains it against data parallel)."""
    final, report = rank_0(mlp, **PURE_BF16)
    assert report.stats["params_split"] >= 1
    scattered = [final.var(op.outputs[0]) for _, op in final.walk_ops() if op.type == RS_WAIT]
    assert scattered and {var.dtype for var in scattered} == {"bfloat16"}
    unsharded, _ = run_data_parallel_passes(mlp, 2, **PURE_BF16)  # the pre-launch estimate counts 2-byte pieces
    assert rank_plans(unsharded, 2, 2)[0].gradient_bytes == sum(var.nbytes() for var in scattered) == 2 * 3461
    update = next(op for _, op in final.walk_ops() if op.attrs.get("param") == "fc2.weight")
    assert update.args[0].name == "fc2.weight@master_weight" and tuple(final.var(update.args[1].name).shape) == (2811,)


def test_fp16_allreduce_reduce_scatters_bfloat16_pieces_and_updates_from_their_float32_cast(mlp):
    """fp16_allreduce under stage 2 (float32 parameters, CPU): the buckets are reduce-scattered in bfloat16, and
    each update reads the float32 cast of its averaged piece (fc2.weight cut at 2811 elements on rank 0)."""
    final, report = rank_0(mlp, fp16_allreduce=True)
    assert report.stats["params_split"] >= 1
    assert {final.var(op.outputs[0]).dtype for _, op in final.walk_ops() if op.type == RS_WAIT} == {"bfloat16"}
    update = next(op for _, op in final.walk_ops() if op.attrs.get("param") == "fc2.weight")
    gradient = final.var(update.args[1].name)
    assert gradient.dtype == "float32" and tuple(gradient.shape) == (2811,)


def test_stage_3_with_pure_low_precision_holds_low_precision_pieces_and_float32_master_pieces(mlp):
    """use_pure_fp16 under stage 3, rank 0 of 2: the gathers bring the bfloat16 parameters (not the master weights);
    fc2.weight is cut at 1349 of 4096 (rank 0 holds fc1.* and that piece: 2048 + 64 + 1349 = 3461 elements), its
    Var, master weight, moments, gradient piece and the unscaled piece are all 1349 elements, and the update reads
    the unscaled float32 cast of the averaged bfloat16 gradient piece. Every parameter's declared dtype is stamped, those this
    rank drops included: the module's copies of them must be bfloat16 too, or the ranks' gathers disagree in size
    (tests/fleet/test_sharding_stage3_flat.py trains it against data parallel on 2 ranks)."""
    stamped = mlp.clone()
    stamped.metadata["sharding"] = sharding_metadata(ProcessMesh(sharding=2), 0)
    final, history = run_data_parallel_passes(stamped, 2, sharding=True,
                                              sharding_configs={"stage": 3, "sharding_degree": 2}, **PURE_BF16)
    meta = final.metadata["sharding"]
    assert meta["param_layout"] == "flat" and meta["param_pieces"]["fc2.weight"] == [0, 1349]
    assert set(meta["param_dtypes"].values()) == {"bfloat16"} and len(meta["param_dtypes"]) == 6
    assert final.find_var("out.weight") is None  # held by rank 1 only
    gathers = [op for _, op in final.walk_ops() if op.type == GATHER_START]
    assert len(gathers) == 2 and all(op.args[2] == torch.bfloat16 for op in gathers)
    assert all("master" not in ref.name for op in gathers for ref in op.args[0])
    update = next(op for _, op in final.walk_ops() if op.attrs.get("param") == "fc2.weight")
    assert update.args[0].name == "fc2.weight@master_weight" and update.args[1].name.endswith("@UNSCALED")
    for name in ("fc2.weight", "fc2.weight@master_weight", "fc2.weight@GRAD", update.args[1].name):
        assert tuple(final.find_var(name, 1).shape) == (1349,), name
    assert final.find_var("fc2.weight@master_weight").dtype == "float32"
    assert final.find_var("fc2.weight@GRAD", 1).dtype == "bfloat16"
    assert final.metadata["state_pieces"]["fc2.weight@master_weight"] == [0, 1349]
    assert history["sharding"].report.stats["found_inf_allreduces"] == 1


def stage_3(segment_mb: float = 32.0) -> dict:
    return {"sharding": True, "sharding_configs": {"stage": 3, "sharding_degree": 2, "segment_broadcast_MB": segment_mb}}


@pytest.mark.parametrize("clip, fields", [
    (None, {"amp": True}),
    (fleetc.ClipGradByGlobalNorm(0.05), {"amp": True}),
    (fleetc.ClipGradByGlobalNorm(0.05), MERGE),
    (fleetc.ClipGradByGlobalNorm(0.05), {"amp": True, **MERGE}),
], ids=["amp", "amp_clipped", "merged_clipped", "amp_merged_clipped"])
def test_stage_3_holds_pieces_under_amp_clipping_and_gradient_merge(mlp, clip, fields):
    """Stage 3's one bucket (declaration order) ends rank 0's range inside fc2.weight: this rank's Var of it, its
    gradient piece (AMP's unscaled, the clipped, gradient merge's average) and its momentum are that piece's size."""
    final, report = rank_0(mlp, grad_clip=clip, sharding=stage_3(), **fields)
    meta = final.metadata["sharding"]
    assert meta["param_layout"] == "flat" and report.stats["params_split"] >= 1
    lo, hi = meta["param_pieces"]["fc2.weight"]
    assert 0 < hi - lo < 4096 and tuple(final.var("fc2.weight").shape) == (hi - lo,)
    assert final.metadata["state_pieces"]["fc2.weight@momentum_buffer"] == [lo, hi]
    update = next(op for _, op in final.walk_ops() if op.attrs.get("param") == "fc2.weight")
    assert tuple(final.find_var(update.args[1].name, 1).shape) == (hi - lo,)
    if clip is not None:
        assert update.args[1].name.endswith("@CLIP") and report.stats["clip_norm_allreduces"] == 1
    types = [op.type for _, op in final.walk_ops()]
    assert types.count(FOUND_INF_MAX) == int(fields.get("amp", False))


def test_stage_3_gradient_merge_reduce_scatters_the_accumulators_by_parameter_bucket(mlp):
    """Small buckets: gradient merge's one bucket of accumulators becomes one reduce-scatter per parameter bucket
    (its layout, so each leaves this rank the merged gradient of exactly the pieces it holds), once per k steps."""
    final, report = rank_0(mlp, sharding=stage_3(0.01), **MERGE)
    buckets = final.metadata["sharding"]["param_buckets"]
    block = update_block(final)
    scatters = [op for op in block.ops if op.type == RS_START]
    assert len(buckets) > 1 and [[ref.name.removesuffix("@GRAD@MERGE") for ref in op.args[0]] for op in scatters] \
        == buckets
    assert not [op for op in final.global_block.ops if op.type in (RS_START, START)]
    accumulators = set(final.metadata["gradient_merge"]["accumulators"].values())  # whole, zeroed after the update
    assert accumulators <= {op.args[0].name for op in block.ops if op.type == "fleetc.zero"}
    assert all(final.var(a).shape == mlp.var(a.removesuffix("@GRAD@MERGE")).shape for a in accumulators)
    for param, (lo, hi) in final.metadata["sharding"]["param_pieces"].items():
        update = next(op for op in block.ops if op.attrs.get("param") == param)
        assert var_numel(final.var(update.args[1].name)) == hi - lo == var_numel(final.var(param))
    assert any("accumulators stay whole" in note for note in report.notes)
    unsharded, _ = run_data_parallel_passes(mlp, 2, **MERGE)
    plan = rank_plans(unsharded, 2, 3, segment_mb=0.01)[0]  # the pre-launch estimate plans the same pieces
    assert plan.owned_params == len(final.metadata["sharding"]["owned"])
    assert plan.optimizer_state_bytes == sum(v.nbytes() for v in final.persistables()
                                             if v.kind is VarKind.OPTIMIZER_STATE)
    assert plan.gradient_bytes == sum(final.var(op.outputs[0]).nbytes() for op in block.ops if op.type == RS_WAIT)


def test_stage_3_keeps_whole_parameters_where_whole_gradients_are_needed(mlp):
    final, report = rank_0(mlp, grad_clip=fleetc.ClipGradByNorm(0.05), sharding=stage_3())
    assert final.metadata["sharding"]["param_layout"] == "whole" and "params_split" not in report.stats
    assert any(note.startswith("stage 3 owns whole parameters here") and "fleetc.clip_by_norm reads whole gradients"
               in note for note in report.notes)


@pytest.mark.parametrize("sharding", [STAGE_2, stage_3()], ids=["stage_2", "stage_3"])
def test_amp_under_gradient_merge_checks_this_ranks_pieces_of_the_merged_gradients(mlp, sharding):
    """The merge's update block reduce-scatters the whole accumulators; AMP's check reads only this rank's averaged
    pieces of them (not another rank's, though the reduce-scatter read every accumulator) and found_inf is
    max-allreduced before the loss scaling and the nested updates read it."""
    final, report = rank_0(mlp, grad_clip=fleetc.ClipGradByGlobalNorm(0.05), sharding=sharding, amp=True, **MERGE)
    assert report.stats["params_split"] >= 1 and report.stats["found_inf_allreduces"] == 1
    block = update_block(final)
    check = next(op for op in block.ops if op.type == "fleetc.check_finite_and_unscale")
    views = {name for op in block.ops if op.type == "fleetc.shard_views" for name in op.outputs}
    averaged = {op.outputs[0] for op in block.ops if op.type == "aten.div.Tensor" and op.args[0].name in views}
    assert {ref.name for ref in check.args[0]} == averaged and len(averaged) == len(final.metadata["sharding"]["owned"])
    found_inf = next(op.outputs[0] for op in block.ops if op.type == FOUND_INF_MAX)
    assert all(check.outputs[-1] not in op.inputs for op in block.ops[block.ops.index(check) + 2:])
    assert any(found_inf in op.inputs for op in block.ops if op.type == "fleetc.update_loss_scaling")
