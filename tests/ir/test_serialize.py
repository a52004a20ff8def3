"""JSON round trip of Programs: captured zoo programs and hand-built ones with every tagged value kind."""
from __future__ import annotations

import json
import math

import pytest
import sympy
import torch
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ir.serialize import (
    FORMAT_VERSION,
    from_dict,
    program_from_json,
    program_to_json,
    to_dict,
)
from fleetc.ir.verifier import verify
from fleetc.runtime.pycodegen import generate_step

S0 = sympy.Symbol("s0", integer=True, positive=True)


def assert_round_trips(program: Program) -> Program:
    """Same fields, same text, and the same JSON again (deterministic output)."""
    text = program_to_json(program)
    back = program_from_json(text)
    assert back == program
    assert from_dict(json.loads(text)) == back  # the one-parse decoder (object_hook) and the data decoder agree
    assert str(back) == str(program)
    assert program_to_json(back) == text
    return back


@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_captured_zoo_programs_round_trip(zoo_name: str) -> None:
    entry = ZOO[zoo_name]
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, optimizer=OPTIMIZERS["momentum"](model.parameters()), loss_fn=entry.loss_fn,
                             verify=True)
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(1))
    trainer.step(*args, **kwargs)
    assert_round_trips(trainer.program)
    for record in trainer.history:
        assert_round_trips(record.program)


def test_gradient_merge_program_round_trips_and_generates_the_same_runtime() -> None:
    entry = ZOO["mlp"]
    model = entry.make_model()
    strategy = fleetc.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2}
    trainer = fleetc.compile(model, strategy, optimizer=OPTIMIZERS["momentum"](model.parameters()),
                             loss_fn=entry.loss_fn, verify=True)
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(1))
    trainer.step(*args, **kwargs)
    back = assert_round_trips(trainer.program)
    verify(back)
    assert [(b.idx, b.parent_idx) for b in back.blocks] == [(0, -1), (1, 0)]
    assert back.var("fc1.weight@GRAD@MERGE").kind is VarKind.ACCUMULATOR
    assert generate_step(back).source == trainer.generated_source()


def hand_built_program() -> Program:
    """Every value kind the encoder tags, a symbolic shape, None outputs and a sub-block."""
    program = Program(metadata={"kind": "train", "levels": (1, [2, (3,)]), "by_id": {7: "seven"},
                                "$odd": "dollar key", "limits": (-math.inf, math.inf)})
    block = program.global_block
    block.add_var(Var("x", (S0, 4), "float32", "cpu", VarKind.DATA))
    block.add_var(Var("w", (4, 4), "bfloat16", "cuda:0", VarKind.PARAM))
    block.add_var(Var("lr", None, "float64", "cpu", VarKind.HYPER))
    block.add_var(Var("flag", (), "bool", "cpu", VarKind.COUNTER))
    block.add_var(Var("y", (2 * S0 + 1, 4), "float32"))
    block.add_var(Var("w32", (4, 4), "float32"))
    program.feeds = ["x", "lr"]
    program.fetches = {"loss": "y", "grad:w": "w32"}
    forward = {"op_role": int(OpRole.FORWARD), "module_path": "enc.fc", "source": "/src/model.py:12"}
    block.ops.append(Op("cat", "aten.cat.default", ([Ref("x"), Ref("x")], 0), outputs=["y", None], attrs=forward))
    block.ops.append(Op("to", "aten._to_copy.default", (Ref("w"),),
                        {"dtype": torch.float32, "device": torch.device("cpu"), "layout": torch.strided,
                         "memory_format": torch.contiguous_format}, outputs=["w32"], attrs=forward))
    block.ops.append(Op("clamp", "aten.clamp.default", (Ref("y"), -math.inf, math.inf), outputs=[None],
                        attrs={"op_role": int(OpRole.FORWARD | OpRole.LOSS), "pairs": ((1, 2), [3, 4])}))
    sub = program.new_block(0)
    sub.add_var(Var("acc", (4, 4), "float32"))
    sub.ops.append(Op("accumulate", "aten.add.Tensor", (Ref("w32"), Ref("w32")), {"alpha": 0.5}, outputs=["acc"],
                      attrs={"op_role": int(OpRole.OPTIMIZE)}))
    block.ops.append(Op("merge", "fleetc.conditional_block", (Ref("flag"),), outputs=[],
                        attrs={"op_role": int(OpRole.OPTIMIZE), "sub_block": 1}))
    return program


def test_hand_built_program_round_trips_with_exact_types() -> None:
    back = assert_round_trips(hand_built_program())
    cat, to, clamp, merge = back.global_block.ops
    assert type(cat.args) is tuple and type(cat.args[0]) is list and cat.args[0] == [Ref("x"), Ref("x")]
    assert cat.outputs == ["y", None]
    assert to.kwargs == {"dtype": torch.float32, "device": torch.device("cpu"), "layout": torch.strided,
                         "memory_format": torch.contiguous_format}
    assert list(to.kwargs) == ["dtype", "device", "layout", "memory_format"]  # the printer shows kwargs in order
    assert clamp.args[1:] == (-math.inf, math.inf)
    assert type(clamp.attrs["pairs"]) is tuple and type(clamp.attrs["pairs"][1]) is list
    assert merge.sub_block == 1 and back.blocks[1].parent_idx == 0
    assert back.blocks[1].ops[0].kwargs == {"alpha": 0.5}
    assert back.metadata["levels"] == (1, [2, (3,)]) and back.metadata["by_id"] == {7: "seven"}
    assert back.metadata["$odd"] == "dollar key"
    y_shape = back.var("y").shape
    assert y_shape == (2 * S0 + 1, 4) and all(s.is_positive for s in y_shape[0].free_symbols)
    assert back.var("w").device == "cuda:0" and back.var("flag").kind is VarKind.COUNTER


def test_json_is_strict_and_tags_special_values() -> None:
    def reject(constant: str) -> None:
        raise AssertionError(f"bare {constant} in JSON output")

    data = json.loads(program_to_json(hand_built_program()), parse_constant=reject)
    assert data["fleetc_program"] == FORMAT_VERSION == 2
    clamp = data["blocks"][0]["ops"][2]
    assert clamp["args"] == [{"$ref": "y"}, {"$float": "-inf"}, {"$float": "inf"}]
    assert data["blocks"][0]["ops"][1]["kwargs"]["dtype"] == {"$dtype": "float32"}
    assert data["blocks"][0]["vars"][4]["shape"][0]["$sym"] == "2*s0 + 1"


def test_nan_round_trips() -> None:
    program = Program()
    program.global_block.add_var(Var("x", (2,), "float32", "cpu", VarKind.DATA))
    program.feeds = ["x"]
    program.global_block.ops.append(Op("fill", "aten.fill.Scalar", (Ref("x"), math.nan), outputs=["x"]))
    back = program_from_json(program_to_json(program))
    assert math.isnan(back.global_block.ops[0].args[1])
    assert str(back) == str(program)


def test_output_does_not_depend_on_attr_insertion_order() -> None:
    a, b = hand_built_program(), hand_built_program()
    op = b.global_block.ops[0]
    op.attrs = dict(reversed(list(op.attrs.items())))
    assert program_to_json(a) == program_to_json(b)


@pytest.mark.parametrize("version", [1, 3, None])
def test_other_format_versions_are_rejected(version: int | None) -> None:
    data = to_dict(hand_built_program())
    if version is None:
        del data["fleetc_program"]
    else:
        data["fleetc_program"] = version
    with pytest.raises(ValueError, match="format version 2"):
        from_dict(data)


def test_unknown_tag_is_rejected() -> None:
    data = to_dict(hand_built_program())
    data["blocks"][0]["ops"][0]["args"][1] = {"$complex": [1, 2]}
    with pytest.raises(ValueError, match=r"unknown tag '\$complex'"):
        from_dict(data)
    with pytest.raises(ValueError, match=r"unknown tag '\$complex'"):
        program_from_json(json.dumps(data))


def test_a_fetch_key_that_looks_like_a_tag_round_trips() -> None:
    program = hand_built_program()
    program.fetches = {"$ref": "y"}
    assert program_from_json(program_to_json(program)).fetches == {"$ref": "y"}
    assert_round_trips(program)


def test_unencodable_argument_names_op_and_argument() -> None:
    program = hand_built_program()
    program.global_block.ops.append(Op("scale", "aten.mul.Tensor", (Ref("x"), object()), outputs=["x"]))
    with pytest.raises(TypeError, match=r"op 'scale' \(aten.mul.Tensor\) argument 1.*object"):
        program_to_json(program)


def test_unencodable_nested_keyword_names_the_keyword() -> None:
    program = hand_built_program()
    program.global_block.ops.append(Op("pad", "aten.pad.default", (Ref("x"),), {"value": [1, torch.ones(1)]},
                                      outputs=["x"]))
    with pytest.raises(TypeError, match=r"op 'pad' .*keyword argument\['value'\]\[1\].*Tensor"):
        program_to_json(program)
