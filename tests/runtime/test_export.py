"""export_program: a Program of aten ops becomes an ExportedProgram with the model's state names and a dynamic batch."""
from __future__ import annotations

import pytest
import torch
from helpers.export import trained
from zoo import ZOO

import fleetc
from fleetc.fleet.export_sources import model_state
from fleetc.runtime.export import export_program


@pytest.fixture(scope="module")
def mlp():
    trainer, (x,), _ = trained(ZOO["mlp"], steps=1)
    trainer(x)
    return trainer, x


def test_batch_is_dynamic_from_one_up(mlp):
    trainer, x = mlp
    result = export_program(trainer.eval_program, model_state(trainer.model))
    assert result.dynamic_dims == {"x": {0: "batch"}} and not result.notes
    (bound,) = result.exported.range_constraints.values()
    assert bound.lower == 1
    module = result.exported.module()
    trainer.model.eval()
    for rows in (1, 16, 50):
        batch = torch.randn(rows, 32)
        torch.testing.assert_close(module(batch), trainer.model(batch).detach())
    trainer.model.train()


def test_static_batch_on_request(mlp):
    trainer, x = mlp
    result = export_program(trainer.eval_program, model_state(trainer.model), dynamic_batch=False)
    assert result.dynamic_dims == {}
    with pytest.raises(Exception, match="16"):
        result.exported.module()(torch.randn(3, 32))


def test_state_keeps_the_model_names_and_is_a_copy(mlp):
    trainer, _ = mlp
    result = export_program(trainer.eval_program, model_state(trainer.model))
    state = result.exported.state_dict
    assert sorted(state) == sorted(name for name, _ in trainer.model.named_parameters())
    weight = trainer.model.fc1.weight
    assert torch.equal(state["fc1.weight"], weight) and state["fc1.weight"].data_ptr() != weight.data_ptr()


def test_nested_inputs_cannot_be_fed_by_name(mlp):
    trainer, _ = mlp
    program = trainer.eval_program.clone()
    program.global_block.vars["x['a']"] = program.global_block.vars.pop("x")
    program.feeds = ["x['a']"]
    with pytest.raises(fleetc.ExportError, match=r"input \"x\['a'\]\" is not a plain forward argument"):
        export_program(program, model_state(trainer.model))
