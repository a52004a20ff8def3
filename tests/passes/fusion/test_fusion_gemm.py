"""Gemm epilogue fusion: counts on the zoo (2-D and leading batch dims), references, unfusable backward reported."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import run_side_by_side
from fusion_helpers import assert_close_all, fusion_strategy, op_types, stats
from torch import nn
from zoo import ZOO, ZooEntry

import fleetc
from fleetc.ir.program import Op, OpRole, Ref, Var
from fleetc.ir.serialize import program_from_json, program_to_json
from fleetc.ir.verifier import verify
from fleetc.ops.fused_gemm import fused_gemm_epilogue, fused_gemm_epilogue_grad
from fleetc.passes.fusion.gemm import FuseGemmEpilogue
from fleetc.runtime.pycodegen import generate_step

aten = torch.ops.aten


def test_mlp_each_linear_becomes_one_forward_and_one_backward_op():
    run = run_side_by_side("mlp", "adamw", strategy=fusion_strategy("fuse_gemm_epilogue"))
    run.assert_same()
    assert stats(run.trainer, "fuse_gemm_epilogue") == {"forward_groups": 3, "backward_groups": 3,
                                                        "ops_removed": 17}
    types = op_types(run.trainer.program)
    assert types.count("fleetc.fused_gemm_epilogue") == 3 and types.count("fleetc.fused_gemm_epilogue_grad") == 3
    assert not {"aten.addmm.default", "aten.mm.default", "aten.relu.default", "aten.threshold_backward.default",
                "aten.sum.dim_IntList"} & set(types)
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(run.trainer(x), run.eager_model(x), rtol=0, atol=0)  # bit-identical on CPU
    assert op_types(run.trainer.eval_program).count("fleetc.fused_gemm_epilogue") == 3


@functools.lru_cache(maxsize=None)
def gpt_run():
    return run_side_by_side("gpt", "sgd", steps=2, strategy=fusion_strategy("fuse_gemm_epilogue"))


def pre_activations(program) -> list[tuple]:
    """(module path, act, keep_pre_act, the pre-activation output) of each fused gemm forward op."""
    return [(op.module_path, op.args[4], op.args[6], op.outputs[1]) for _, op in program.walk_ops()
            if op.type == "fleetc.fused_gemm_epilogue"]


def test_pre_activation_is_kept_exactly_when_the_backward_reads_it():
    """relu's grad reads relu's output, gelu's its input; eval Programs have no backward and keep nothing."""
    mlp = run_side_by_side("mlp", "sgd", steps=1, strategy=fusion_strategy("fuse_gemm_epilogue")).trainer
    assert pre_activations(mlp.program) == [("fc1", "relu", False, None), ("fc2", "relu", False, None),
                                            ("out", None, False, None)]
    run = gpt_run()
    fused = pre_activations(run.trainer.program)
    assert [keep for _, act, keep, _ in fused] == [act == "gelu" for _, act, _, _ in fused]
    assert {path for path, act, _, _ in fused if act} == {"layers.0.fc", "layers.1.fc"}
    for path, _, keep, pre in fused:
        if keep:
            [reader] = [op for _, op in run.trainer.program.walk_ops() if Ref(pre) in op.args]
            assert reader.type == "fleetc.fused_gemm_epilogue_grad" and reader.args[1] == Ref(pre), path
    (tokens, _), _ = ZOO["gpt"].make_batch(torch.Generator().manual_seed(5))
    run.eager_model.eval(), run.compiled_model.eval()  # no dropout: both compute the same function
    try:
        with torch.no_grad():
            torch.testing.assert_close(run.trainer(tokens), run.eager_model(tokens), rtol=1e-5, atol=1e-5)
    finally:
        run.eager_model.train(), run.compiled_model.train()
    assert [keep for _, _, keep, _ in pre_activations(run.trainer.eval_program)] == [False] * 8


def test_fused_gemm_program_round_trips_through_json():
    program = gpt_run().trainer.program
    back = program_from_json(program_to_json(program))
    assert back == program and pre_activations(back) == pre_activations(program)
    assert generate_step(back).source == generate_step(program).source


def test_gpt_linears_with_leading_batch_dims_fuse_through_the_reshape():
    run = gpt_run()
    run.assert_same()
    # forward: addmm + view (+ gelu in the MLPs); backward: 6 ops + view (+ gelu grad) → one op each: 10 + 50
    assert stats(run.trainer, "fuse_gemm_epilogue") == {"forward_groups": 8, "backward_groups": 8,
                                                        "ops_removed": 60}
    fc = [op for op in run.trainer.program.global_block.ops
          if op.type == "fleetc.fused_gemm_epilogue" and op.module_path == "layers.0.fc"]
    assert len(fc) == 1 and fc[0].args[3] == [4, 16, 128] and fc[0].args[4] == "gelu"


def test_new_style_fused_passes_gemm_epilogue_runs_the_same_pass():
    strategy = fleetc.Strategy({"fused_passes": {"enable": True, "gemm_epilogue": True}})
    run = run_side_by_side("mlp", "sgd", steps=1, strategy=strategy)
    assert stats(run.trainer, "fuse_gemm_epilogue")["forward_groups"] == 3


@pytest.mark.parametrize("act, param", [(None, None), ("relu", None), ("gelu", "none"), ("gelu", "tanh")])
@pytest.mark.parametrize("out_shape", [None, [2, 3, 5]])
def test_gemm_references_match_the_unfused_aten_sequence(act, param, out_shape):
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(6, 4, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    h = aten.addmm(bias, x, aten.t(w))
    h = aten.view(h, out_shape) if out_shape else h
    out = {None: h, "relu": aten.relu(h), "gelu": aten.gelu(h, approximate=param or "none")}[act]
    assert_close_all(fused_gemm_epilogue(x, aten.t(w), bias, out_shape, act, param, True), (out, h), rtol=0, atol=0)
    assert_close_all(fused_gemm_epilogue(x, aten.t(w), bias, out_shape, act, param, False), (out, None),
                     rtol=0, atol=0)

    dout = torch.randn(out.shape, generator=g)
    saved = {None: None, "relu": out, "gelu": h}[act]
    ga = {None: dout, "relu": aten.threshold_backward(dout, out, 0) if act == "relu" else None,
          "gelu": aten.gelu_backward(dout, h, approximate=param or "none") if act == "gelu" else None}[act]
    g2 = aten.view(ga, [6, 5])
    expected = (aten.mm(g2, aten.t(aten.t(w))), aten.mm(aten.t(g2), x), aten.view(aten.sum(g2, [0], True), [5]))
    got = fused_gemm_epilogue_grad(dout, saved, x, aten.t(w), act, param, [True, True, True])
    assert_close_all(got, expected, rtol=0, atol=0)
    assert_close_all(fused_gemm_epilogue_grad(dout, saved, x, aten.t(w), act, param, [False, True, False]),
                     (None, expected[1], None), rtol=0, atol=0)


def test_forward_fused_but_backward_not_is_reported():
    """A value inside the backward group read elsewhere (here: fetched) keeps that backward unfused."""
    run = run_side_by_side("mlp", "sgd", steps=1)
    program = run.trainer.history["remove_noop_views"].program.clone()
    block = program.global_block
    act_grad = next(op for op in block.ops if op.type == "aten.threshold_backward.default")
    at = block.ops.index(act_grad) + 1
    block.add_var(Var("peek", program.var(act_grad.outputs[0]).shape, "float32"))
    block.ops.insert(at, Op("peek", "aten.clone.default", (Ref(act_grad.outputs[0]),), outputs=["peek"],
                            attrs={"op_role": int(OpRole.BACKWARD)}))
    program.fetches["peek"] = "peek"
    fused, report = FuseGemmEpilogue().run(program, run.trainer.config)
    verify(fused)
    assert report.stats["forward_groups"] == 3
    assert report.stats["backward_groups"] == 2 and report.stats["backward_not_fused"] == 1
    assert any("forward fused, backward not" in note and "read outside" in note for note in report.notes)


class ExplicitBiasMLP(nn.Module):
    """Linears written out as `x @ w.t() + b` (mm + add.Tensor, not addmm): batched with relu, bias first, 2-D gelu."""

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(12, 8) * 0.3), nn.Parameter(torch.randn(12) * 0.1)
        self.w2, self.b2 = nn.Parameter(torch.randn(10, 12) * 0.3), nn.Parameter(torch.randn(10) * 0.1)
        self.w3, self.b3 = nn.Parameter(torch.randn(4, 10) * 0.3), nn.Parameter(torch.randn(4) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(x @ self.w1.t() + self.b1)  # x: [2, 3, 8] → matmul reshapes to 2-D and back
        h = self.b2 + h @ self.w2.t()
        return F.gelu(h.flatten(0, 1) @ self.w3.t() + self.b3)


class UntransposedWeight(nn.Module):
    """`x @ w + b` with w stored [in, out]: dW = t(x) @ g has the other layout than the fused grad's."""

    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(8, 6) * 0.3), nn.Parameter(torch.randn(6) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x.flatten(0, 1) @ self.w + self.b)


def _batch_of(target_columns: int):
    def make_batch(g: torch.Generator) -> tuple[tuple, dict]:
        return (torch.randn(2, 3, 8, generator=g), torch.randn(6, target_columns, generator=g)), {}

    return make_batch


@pytest.fixture
def explicit_bias_zoo(monkeypatch):
    """Both models as zoo entries for the test's duration, so run_side_by_side trains them against eager."""
    monkeypatch.setitem(ZOO, "explicit_bias", ZooEntry("explicit_bias", ExplicitBiasMLP, _batch_of(4), F.mse_loss))
    monkeypatch.setitem(ZOO, "untransposed", ZooEntry("untransposed", UntransposedWeight, _batch_of(6), F.mse_loss))


def test_mm_plus_explicit_bias_fuses_forward_and_backward(explicit_bias_zoo):
    run = run_side_by_side("explicit_bias", "adam", strategy=fusion_strategy("fuse_gemm_epilogue"))
    run.assert_same()
    # forward: mm [+ _unsafe_view] + add [+ act], 4 + 3 + 3 ops → 3; backward: [act grad,] sum + view (dBias),
    # [2-D view,] t + mm (dW), t + mm (dX, not for the first layer), 7 + 7 + 6 ops → 3: 7 + 17 removed
    assert stats(run.trainer, "fuse_gemm_epilogue") == {"forward_groups": 3, "backward_groups": 3,
                                                        "ops_removed": 24}
    types = op_types(run.trainer.program)
    assert not {"aten.mm.default", "aten.add.Tensor", "aten.sum.dim_IntList", "aten.relu.default",
                "aten.gelu_backward.default"} & set(types)
    fused = {op.args[2].name: op.args[3:5] for op in run.trainer.program.global_block.ops
             if op.type == "fleetc.fused_gemm_epilogue"}
    assert fused == {"b1": ([2, 3, 12], "relu"), "b2": ([2, 3, 10], None), "b3": (None, "gelu")}


def test_mm_plus_bias_whose_backward_cannot_fuse_is_reported(explicit_bias_zoo):
    run = run_side_by_side("untransposed", "sgd", steps=2, strategy=fusion_strategy("fuse_gemm_epilogue"))
    run.assert_same()
    assert stats(run.trainer, "fuse_gemm_epilogue") == {"forward_groups": 1, "backward_not_fused": 1,
                                                        "ops_removed": 2}
    [note] = run.trainer.report().notes["fuse_gemm_epilogue"]
    assert "forward fused, backward not: unrecognised backward ops" in note and "aten.mm.default" in note
