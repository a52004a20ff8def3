"""prune_to_targets: a target in the middle of the model keeps exactly the ops, state and inputs it needs."""
from __future__ import annotations

import pytest
import torch
from helpers.export import aten_call_count, trained
from zoo import ZOO

import fleetc
from fleetc.fleet import inference
from fleetc.passes.export import PruneToTargets
from fleetc.passes.export.prune import resolve_targets


def _eval_program(name: str, *args, **kwargs):
    trainer, example, _ = trained(ZOO[name], steps=1)
    trainer(*(args or example), **kwargs)
    return trainer, trainer.eval_program


def _prune(program, targets, feeds, prune=True):
    return PruneToTargets(resolve_targets(program, targets), feeds, prune).run(program.clone(), None)


def test_mlp_up_to_fc2_keeps_five_ops_and_two_layers_of_weights(tmp_path):
    trainer, program = _eval_program("mlp")
    assert [op.type for op in program.global_block.ops] == ["aten.t.default", "aten.addmm.default",
                                                            "aten.relu.default"] * 2 + ["aten.t.default",
                                                                                        "aten.addmm.default"]
    pruned, report = _prune(program, ["fc2"], ["x"])
    assert [op.name for op in pruned.global_block.ops] == ["t", "addmm", "relu", "t_1", "addmm_1"]
    assert pruned.fetches == {"fc2": "addmm_1"}
    assert sorted(v.name for v in pruned.persistables()) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert report.stats == {"ops_removed": 3, "vars_removed": 3, "state_removed": 2, "targets": 1}

    result = inference.save_inference_model(trainer, str(tmp_path / "fc2"), "x", "fc2")
    exported = result.artifacts[0].model.exported
    assert aten_call_count(exported) == 5
    assert sorted(exported.state_dict) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    x = torch.randn(3, 32)
    model = trainer.model
    torch.testing.assert_close(exported.module()(x), model.fc2(torch.relu(model.fc1(x))))


def test_without_export_for_deployment_every_op_stays(tmp_path):
    trainer, program = _eval_program("mlp")
    pruned, report = _prune(program, ["fc2"], ["x"], prune=False)
    assert pruned.num_ops() == program.num_ops() == 8 and "ops_removed" not in report.stats
    result = inference.save_inference_model(trainer, str(tmp_path / "all"), "x", "fc2", export_for_deployment=False)
    assert aten_call_count(result.artifacts[0].model.exported) == 8
    assert result.meta["pruned"] is False and result.meta["ops"] == {"eval_program": 8, "exported": 8}


def test_gpt_up_to_the_first_block_drops_every_later_op():
    _, program = _eval_program("gpt")
    ops = program.global_block.ops
    first_later = next(i for i, op in enumerate(ops) if op.module_path.startswith("layers.1"))
    pruned, _ = _prune(program, ["layers.0"], ["idx"])
    assert [op.name for op in pruned.global_block.ops] == [op.name for op in ops[:first_later]]
    assert not any(op.module_path.startswith(("layers.1", "ln_f", "lm_head")) for op in pruned.global_block.ops)
    assert {v.name.split(".")[0] for v in pruned.persistables()} == {"tok", "pos", "layers"}
    assert all(not v.name.startswith("layers.1") for v in pruned.persistables())


def test_targets_are_outputs_leaves_module_paths_and_values():
    _, program = _eval_program("loss_dict", torch.randn(8, 16), labels=torch.randint(0, 5, (8,)))
    assert resolve_targets(program, ["output"]) == {"output.0": "output.0", "output.1": "output.1"}
    fetches = resolve_targets(program, ["body.fc1", "output.1", "relu"])
    assert list(fetches) == ["body.fc1", "output.1", "relu"] and fetches["relu"] == "relu"


def test_an_input_only_pruned_ops_read_is_not_needed(tmp_path):
    """forward(x, labels) returns logits and loss; the logits alone need no labels."""
    trainer, program = _eval_program("loss_dict", torch.randn(8, 16), labels=torch.randint(0, 5, (8,)))
    pruned, _ = _prune(program, ["output.0"], ["x"])
    assert pruned.feeds == ["x"] and "labels" not in pruned.global_block.vars
    _, report = _prune(program, ["output.0"], ["x", "labels"])
    assert report.notes == ["inputs the targets do not read (the exported module takes and ignores them): "
                            "['labels']"]
    with pytest.raises(fleetc.ExportError, match=r"need the input 'labels', which is not in feeded_var_names \['x'\]"):
        inference.save_inference_model(trainer, str(tmp_path / "m"), ["x"], ["output"], main_program=program)
    with pytest.raises(fleetc.ExportError, match=r"'x2' is not an argument of ReturnsLossDict.forward"):
        inference.save_inference_model(trainer, str(tmp_path / "m"), ["x2"], ["output"], main_program=program)
