"""The stored-step check (fleetc/runtime/step_check.py) and `restore_step`: every step pycodegen emits for the zoo
passes the check and is rebuilt to the same source and the same results; each form it never emits is refused."""
from __future__ import annotations

import pytest
import torch
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.runtime.pycodegen import generate_step, restore_step
from fleetc.runtime.step_check import StepSourceError, check_step_source


def _trainer(zoo_name: str, **options) -> fleetc.CompiledTrainer:
    entry = ZOO[zoo_name]
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, optimizer=OPTIMIZERS["momentum"](model.parameters()), loss_fn=entry.loss_fn,
                             **options)
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(1))
    trainer.step(*args, **kwargs)
    return trainer


@pytest.mark.parametrize("zoo_name", sorted(ZOO))
@pytest.mark.parametrize("measure_memory", [False, True])
def test_every_zoo_step_is_restored_to_the_same_step(zoo_name, measure_memory):
    program = _trainer(zoo_name).program
    generated = generate_step(program, measure_memory=measure_memory)
    data = generated.to_data()
    assert data is not None
    restored = restore_step(program, data)
    assert restored.source == generated.source
    assert restored.globals.keys() == generated.globals.keys()
    assert {line: op.name for line, op in restored.op_at_line.items()} == {
        line: op.name for line, op in generated.op_at_line.items()}
    for name, value in generated.globals.items():
        if callable(value):  # resolved again from the op type (a fleetc op's dispatcher is a new closure)
            again = restored.globals[name]
            assert (again.__module__, again.__qualname__) == (value.__module__, value.__qualname__), name
        elif isinstance(value, dict):  # the constants, rebuilt from the Program's metadata
            assert value.keys() == restored.globals[name].keys()
            for key, tensor in value.items():
                torch.testing.assert_close(restored.globals[name][key], tensor, rtol=0, atol=0)
        else:
            assert restored.globals[name] == value or value != value, name  # nan stays nan


def test_a_profiled_step_is_not_stored():
    program = _trainer("mlp").program
    assert generate_step(program, profile=True).to_data() is None


HEADER = "def step(state, feeds, mem):\n"


@pytest.mark.parametrize("body, problem", [
    ("    w = state['w']\n    x, _, = k_mm(w, [w, (1, -2.0)], alpha={'a': None})\n    del w\n    return {'y': x}\n",
     None),
    ("    x = k_mm(state['w'])\n    return {}\n", "a Subscript expression"),
    ("    x = open('f')\n    return {}\n", "a call of 'open'"),
    ("    x = k_mm(feeds).t()\n    return {}\n", "mem.track or mem.drop"),
    ("    x = state.w\n    return {}\n", "an assignment from a Attribute"),
    ("    import os\n    return {}\n", "a Import statement"),
    ("    x = k_mm(lambda: 0)\n    return {}\n", "a Lambda expression"),
    ("    x = k_mm(y)\n    return {}\n", "the name 'y'"),
    ("    x = k_mm(__builtins__)\n    return {}\n", "the name '__builtins__'"),
    ("    k_mm = state['w']\n    return {}\n", "an assignment to anything but a fresh local name"),
    ("    mem.__class__(1)\n    return {}\n", "mem.track or mem.drop"),
    ("    x = k_mm(**state)\n    return {}\n", "a \\*\\* argument"),
    ("    x = feeds[0]\n    return {}\n", "a subscript other than"),
    ("    for x in feeds:\n        pass\n    return {}\n", "a For statement"),
    ("    return {'y': k_mm}\n", "the name 'k_mm'"),
    ("    pass\n", "does not end in"),
])
def test_only_the_generators_forms_pass(body, problem):
    source = HEADER + body
    if problem is None:
        check_step_source(source, kernels={"k_mm"}, values=set())
    else:
        with pytest.raises(StepSourceError, match=problem):
            check_step_source(source, kernels={"k_mm"}, values=set())


@pytest.mark.parametrize("source", ["def step(state, feeds, mem=1):\n    return {}\n",
                                    "@k_mm\ndef step(state, feeds, mem):\n    return {}\n",
                                    "def other(state, feeds, mem):\n    return {}\n",
                                    "x = 1\n" + HEADER + "    return {}\n"])
def test_only_one_plain_step_function_passes(source):
    with pytest.raises(StepSourceError):
        check_step_source(source, kernels={"k_mm"}, values=set())
