"""fleet.save_inference_model / fleetc.load_inference_model: trained zoo models exported and loaded without fleetc."""
from __future__ import annotations

import json
import os
import pathlib
import warnings

import pytest
import torch
from fleet.spawn import assert_all_ok, spawn
from helpers.export import eager_eval, fusion_strategy, op_types, run_without_fleetc, trained
from torch import nn
from zoo import ZOO

import fleetc
import fleetc.fleet as fleet
from fleetc.fleet import export_sources, inference
from fleetc.fleet.inference import META_FILE, MODEL_FILE

# The models every export check runs on: an entry needs only make_model, make_batch and loss_fn, and the inputs are
# fed by forward argument name. Hugging Face architectures are checked separately (test_hugging_face_models_...):
# their outputs are transformers classes, which a process without transformers cannot rebuild.
EXPORT_ZOO = dict(ZOO)
STATIC_BATCH = {"gpt"}  # zoo models whose eval Program fixes the batch size (a view to [b, t, heads, d])


@pytest.fixture(scope="module")
def exported_zoo(tmp_path_factory):
    """Every model trained a step with every fusion on, exported, then loaded and run in one process without fleetc;
    the batch is 3 rows larger than the exported example where the batch is dynamic."""
    work = tmp_path_factory.mktemp("exported_zoo")
    cases, runs = {}, []
    for name, entry in EXPORT_ZOO.items():
        trainer, args, kwargs = trained(entry, fusion_strategy(), steps=1)
        inputs = export_sources.named_inputs(trainer.model, args, kwargs)
        with warnings.catch_warnings():  # a static batch's note is checked below
            warnings.simplefilter("ignore")
            result = fleet.save_inference_model(None, str(work / name), list(inputs), ["output"],
                                                main_program=trainer)
        if result.meta["inputs"][0]["dynamic_dims"]:
            inputs = {k: torch.cat([v, v[:3]]) for k, v in inputs.items()}
        cases[name] = (result, tuple(inputs.values()), eager_eval(trainer.model, **inputs))
        runs.append((work / name / MODEL_FILE, tuple(inputs.values())))
    outputs = run_without_fleetc(runs, work)
    return {name: (*case, out) for (name, case), out in zip(cases.items(), outputs)}


@pytest.mark.parametrize("name", list(EXPORT_ZOO))
def test_exported_model_matches_eager_eval_in_a_process_without_fleetc(exported_zoo, name):
    result, _, want, got = exported_zoo[name]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    exported = result.artifacts[0].model.exported
    assert all(t.startswith("aten.") or t == "<built-in function getitem>" for t in op_types(exported))
    assert result.artifacts[0].history.names() == ["eval", "lower_to_aten", "prune_to_targets"]
    meta = json.loads(pathlib.Path(result.dirname, META_FILE).read_text())
    assert meta == result.meta and meta["files"] == {"float32": MODEL_FILE}
    assert meta["fleetc_version"] == fleetc.__version__ and meta["strategy"]["build_strategy"]["fuse_gemm_epilogue"]
    dynamic = meta["inputs"][0]["dynamic_dims"] == {"0": "batch"}
    static_note = any("batch dimension is exported static" in note for note in meta["notes"])
    assert dynamic != static_note  # dynamic, or a note says why not
    if name in ZOO:
        assert dynamic == (name not in STATIC_BATCH)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "vit", "gpt2", "t5"])
def test_hugging_face_models_export_and_match_eager_eval(tmp_path, name):
    """Real architectures (tests/models/factories.py), trained a step with every fusion on, exported and loaded
    with torch.export.load alone: the logits equal eager eval. A KV cache cannot be an exported output, so caching
    is off (with it on, the CaptureError says to do this), on every config: T5's decoder keeps its own copy."""
    factories = pytest.importorskip("models.factories")
    case = getattr(factories, name)()
    trainer, args, kwargs = trained(case, fusion_strategy(), steps=1)
    for module in trainer.model.modules():
        if getattr(module, "config", None) is not None:
            module.config.use_cache = False
    inputs = export_sources.named_inputs(trainer.model, args, kwargs)
    with warnings.catch_warnings():  # the static-batch note is not what this checks
        warnings.simplefilter("ignore")
        fleet.save_inference_model(None, str(tmp_path / name), list(inputs), ["output"], main_program=trainer)
    got = torch.export.load(str(tmp_path / name / MODEL_FILE)).module()(*inputs.values())
    want = eager_eval(trainer.model, **inputs)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_kv_cache_output_is_refused_with_the_use_cache_hint(tmp_path):
    factories = pytest.importorskip("models.factories")
    trainer, args, kwargs = trained(factories.gpt2(), steps=1)
    inputs = export_sources.named_inputs(trainer.model, args, kwargs)
    with pytest.raises(fleetc.CaptureError, match="use_cache = False"):
        fleet.save_inference_model(None, str(tmp_path / "gpt2"), list(inputs), ["output"], main_program=trainer)


def test_fused_ops_are_lowered_and_a_static_batch_is_reported(exported_zoo):
    cnn = exported_zoo["cnn"][0].artifacts[0].history["lower_to_aten"].report.stats
    assert cnn["ops_lowered"] >= 5  # bn+act, bn+add+act and gemm epilogues
    gpt = exported_zoo["gpt"][0].meta
    assert gpt["inputs"][0]["shape"] == [4, 16]
    assert any("batch dimension is exported static (size 4)" in note for note in gpt["notes"])


def test_dict_output_keeps_its_structure(exported_zoo):
    _, _, want, got = exported_zoo["loss_dict"]
    assert isinstance(got, dict) and list(got) == ["logits"] == list(want)


def test_load_inference_model_returns_a_callable_module(exported_zoo):
    result, args, want, _ = exported_zoo["mlp"]
    module = fleetc.load_inference_model(result.dirname)
    torch.testing.assert_close(module(*args), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(fleetc.ExportError, match="holds no bfloat16 model"):
        fleetc.load_inference_model(result.dirname, "bfloat16")


def test_load_refuses_a_directory_fleetc_did_not_write(tmp_path):
    with pytest.raises(fleetc.ExportError, match="is not a fleetc inference model: it has no meta.json"):
        fleetc.load_inference_model(str(tmp_path))
    (tmp_path / META_FILE).write_text('{"format": "something else"}')
    with pytest.raises(fleetc.ExportError, match="was not written by fleetc.save_inference_model"):
        fleetc.load_inference_model(str(tmp_path))


def test_pure_fp16_exports_float32_master_weights_and_the_training_dtype(tmp_path):
    strategy = fleetc.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"use_pure_fp16": True, "use_fp16_guard": False}
    trainer, (x,), _ = trained(ZOO["mlp"], strategy)
    assert trainer.model.fc1.weight.dtype == torch.bfloat16
    result = inference.save_inference_model(trainer, str(tmp_path / "pure"), "x", "output")
    assert result.meta["files"] == {"float32": MODEL_FILE, "bfloat16": "model.bfloat16.pt2"}
    fp32, low = result.artifacts
    masters = {name: trainer.optimizer.state[p]["master_weight"] for name, p in trainer.model.named_parameters()}
    reference = ZOO["mlp"].make_model()
    reference.load_state_dict(masters)
    assert all(v.dtype == torch.float32 for v in fp32.model.exported.state_dict.values())
    assert "aten._to_copy.default" not in op_types(fp32.model.exported)  # the float32 Program has no AMP casts
    torch.testing.assert_close(fleetc.load_inference_model(result.dirname)(x), eager_eval(reference, x),
                               rtol=1e-5, atol=1e-6)
    assert all(v.dtype == torch.bfloat16 for v in low.model.exported.state_dict.values())
    torch.testing.assert_close(fleetc.load_inference_model(result.dirname, "bfloat16")(x), trainer(x),
                               rtol=0, atol=0)  # the trainer's own eval Program, replayed


def test_amp_exports_float32_arithmetic(tmp_path):
    strategy = fleetc.DistributedStrategy()
    strategy.amp = True
    trainer, (x,), _ = trained(ZOO["mlp"], strategy)
    result = inference.save_inference_model(trainer, str(tmp_path / "amp"), "x", "output")
    assert list(result.meta["files"]) == ["float32"]
    torch.testing.assert_close(fleetc.load_inference_model(result.dirname)(x), eager_eval(trainer.model, x),
                               rtol=1e-5, atol=1e-6)


def test_main_program_and_existing_directory_are_replaced_atomically(tmp_path):
    trainer, (x,), _ = trained(ZOO["mlp"])
    trainer(x)
    target = tmp_path / "model"
    inference.save_inference_model(trainer, str(target), "x", "output")
    (target / "stale.txt").write_text("from an earlier export")
    result = inference.save_inference_model(trainer, str(target), ["x"], ["fc2"], main_program=trainer.eval_program)
    assert sorted(os.listdir(tmp_path)) == ["model"]  # no temporary directory left behind
    assert sorted(os.listdir(target)) == [META_FILE, MODEL_FILE]
    assert result.target_names == ["fc2"] and result.meta["outputs"][0]["name"] == "fc2"


def test_a_module_target_is_its_own_output_even_when_fusion_merged_it_with_the_activation(tmp_path):
    trainer, (x,), _ = trained(ZOO["mlp"], fusion_strategy())
    trainer(x)
    assert trainer.eval_program.global_block.ops[1].type == "fleetc.fused_gemm_epilogue"  # fc1 + relu in one op
    result = inference.save_inference_model(trainer, str(tmp_path / "fc1"), "x", "fc1")
    assert "fuse_gemm_epilogue" in result.meta["fusion_passes_skipped"]
    torch.testing.assert_close(fleetc.load_inference_model(result.dirname)(x), eager_eval(trainer.model.fc1, x))


def test_unknown_feed_name_names_the_forward_arguments(tmp_path):
    trainer, _, _ = trained(ZOO["gpt"], steps=1)
    with pytest.raises(fleetc.ExportError, match=r"'ids' is not an argument of TinyGPT.forward; did you mean 'idx'"):
        fleet.save_inference_model(None, str(tmp_path / "m"), ["ids"], ["output"], main_program=trainer)


def test_unknown_target_names_the_closest_module(tmp_path):
    trainer, _, _ = trained(ZOO["mlp"], steps=1)
    with pytest.raises(fleetc.ExportError, match=r"'fc3' names no output, module or value .* did you mean 'fc2'"):
        inference.save_inference_model(trainer, str(tmp_path / "m"), "x", "fc3")
    assert not (tmp_path / "m").exists()


def test_unwritable_directory_fails_before_exporting(tmp_path):
    trainer, _, _ = trained(ZOO["mlp"], steps=1)
    (tmp_path / "file").write_text("")
    with pytest.raises(fleetc.ExportError, match="cannot write the inference model to .*file/m"):
        inference.save_inference_model(trainer, str(tmp_path / "file" / "m"), "x", "output")
    with pytest.raises(fleetc.ExportError, match="it exists and is not a directory"):
        inference.save_inference_model(trainer, str(tmp_path / "file"), "x", "output")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("the user's own")
    with pytest.raises(fleetc.ExportError, match="will not replace .*work.*: it holds files and is not a fleetc"):
        inference.save_inference_model(trainer, str(tmp_path / "work"), "x", "output")
    assert (tmp_path / "work" / "notes.txt").read_text() == "the user's own"


class EarlyExit(nn.Module):
    """Trains fine; in eval mode it branches on a tensor's value, which no static graph can hold."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and x.sum() > 0:
            return torch.zeros(x.shape[0], 4)
        return self.fc(x)


def test_a_model_that_cannot_be_exported_names_the_construct_and_the_line(tmp_path):
    model = EarlyExit()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=nn.functional.mse_loss)
    trainer.step(torch.randn(4, 8), torch.randn(4, 4))
    with pytest.raises(fleetc.CaptureError, match=r"cannot capture the forward pass \(eval mode\): data-dependent "
                                                  r"Python control flow .* at .*test_inference.py:\d+"):
        inference.save_inference_model(trainer, str(tmp_path / "m"), "x", "output")


def test_sharding_stage3_and_pipeline_hook(tmp_path, monkeypatch):
    """Sharding stage 3 in one process shards nothing: exported whole, with a note; released parameters are
    refused. A pipeline with one process per stage
    holds part of the weights on each rank, so export refuses until gathering is built."""
    strategy = fleetc.DistributedStrategy()
    strategy.sharding = True
    strategy.sharding_configs = {"stage": 3}
    trainer, (x,), _ = trained(ZOO["mlp"], strategy, steps=1)
    with pytest.warns(UserWarning, match="sharding stage 3: the weights were whole"):
        result = inference.save_inference_model(trainer, str(tmp_path / "m"), "x", "output")
    assert any(note.startswith("sharding stage 3: the weights were whole") for note in result.meta["notes"])
    released = trainer.model.fc1.weight.data
    trainer.model.fc1.weight.data = torch.empty(0)  # as a rank of a stage-3 run holds a parameter another owns
    with pytest.raises(fleetc.ExportError, match="call fleet.save_inference_model on every rank"):
        inference.save_inference_model(trainer, str(tmp_path / "m1"), "x", "output")
    trainer.model.fc1.weight.data = released
    strategy = fleetc.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"micro_batch_size": 8, "accumulate_steps": 2}  # the zoo mlp's batch of 16
    strategy.hybrid_configs = {"pp_degree": 2}
    trainer, (x,), _ = trained(ZOO["mlp"], strategy, steps=1)
    inference.save_inference_model(trainer, str(tmp_path / "m2"), "x", "output")  # one process: the whole model
    monkeypatch.setattr(export_sources, "world_size", lambda: 2)
    with pytest.raises(fleetc.ExportError, match="under pipeline with one process per stage"):
        inference.save_inference_model(trainer, str(tmp_path / "m3"), "x", "output")


def test_export_before_anything_was_compiled_says_what_to_do(tmp_path):
    model = ZOO["mlp"].make_model()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(fleetc.ExportError, match="nothing compiled yet"):
        inference.save_inference_model(trainer, str(tmp_path / "m"), "x", "output")


@pytest.mark.slow
def test_data_parallel_rank_0_writes_while_the_other_waits(tmp_path):
    results = spawn(2, "export_inference", {"dirname": str(tmp_path / "model")}, tmp_path / "ranks", deadline_s=120)
    assert_all_ok(results)
    wrote, waited = results[0].result, results[1].result
    assert wrote["wrote"] and not waited["wrote"]
    assert waited["files_after_barrier"] == [META_FILE, MODEL_FILE]  # complete by the time rank 1 leaves the barrier
    module = fleetc.load_inference_model(str(tmp_path / "model"))
    torch.testing.assert_close(module(wrote["x"]), wrote["eager"], rtol=1e-5, atol=1e-6)
