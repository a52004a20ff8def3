"""The use-def index: built right, updated locally by replace/rename, and the verifier catches a stale one.
Names hands out fresh names; the visit counter counts Op/Var reads only while active."""
from __future__ import annotations

import pytest

import fleetc
from fleetc.ir.program import Op, Program, Ref, Var, VarKind
from fleetc.ir.usedef import Names, UseDef, check_consistent
from fleetc.ir.verifier import verify_usedef
from fleetc.ir.visits import count_visits


def _program() -> Program:
    """x (fed) → a = relu(x) → b = add(a, a) → c = mul(b, a)."""
    program = Program(feeds=["x"], fetches={"output": "c"})
    block = program.global_block
    block.add_var(Var("x", (4,), "float32", kind=VarKind.DATA))
    for name in ("a", "b", "c", "a2"):
        block.add_var(Var(name, (4,), "float32"))
    block.ops = [Op("relu", "aten.relu.default", (Ref("x"),), outputs=["a"]),
                 Op("add", "aten.add.Tensor", (Ref("a"), Ref("a")), outputs=["b"]),
                 Op("mul", "aten.mul.Tensor", (Ref("b"), Ref("a")), outputs=["c"])]
    return program


def _names(ops):
    return [op.name for op in ops]


def test_index_of_a_block():
    program = _program()
    usedef = UseDef(program, program.global_block)
    assert _names(usedef.readers["a"]) == ["add", "mul"] and _names(usedef.readers["x"]) == ["relu"]
    assert usedef.definer("b").name == "add" and usedef.definer("x") is None
    assert usedef.position == {"relu": 0, "add": 1, "mul": 2}
    assert check_consistent(usedef) is None


def test_replace_and_rename_update_the_index_locally():
    program = _program()
    block = program.global_block
    usedef = UseDef(program, block)
    sigmoid = Op("sigmoid", "aten.sigmoid.default", (Ref("x"),), outputs=["a2"])
    usedef.replace([block.ops[0]], sigmoid, 0)
    usedef.rename("a", "a2")
    assert check_consistent(usedef) is None
    assert _names(usedef.readers["a2"]) == ["add", "mul"] and "a" not in usedef.readers
    assert usedef.definer("a2") is sigmoid and not usedef.live(Op("relu", "aten.relu.default"))
    usedef.compact()
    assert _names(block.ops) == ["sigmoid", "add", "mul"] and block.ops[2].args == (Ref("b"), Ref("a2"))
    fleetc.ir.verifier.verify(program)


def test_replacing_into_an_occupied_slot_is_refused():
    program = _program()
    block = program.global_block
    usedef = UseDef(program, block)
    with pytest.raises(ValueError, match="slot 1 holds 'add'"):
        usedef.replace([block.ops[0]], Op("n", "aten.relu.default", (Ref("x"),), outputs=["a"]), 1)


def test_the_verifier_catches_a_stale_index():
    program = _program()
    block = program.global_block
    usedef = UseDef(program, block)
    block.ops[2].rename_inputs({"a": "b"})  # edited behind the index's back
    with pytest.raises(fleetc.VerificationError, match=r"readers of \['a'\] disagree") as info:
        verify_usedef(usedef, after_pass="my_pass")
    assert "after pass 'my_pass'" in str(info.value)
    usedef = UseDef(program, block)
    usedef.position["mul"] = 0
    assert check_consistent(usedef) == "positions do not match the slots the ops stand in"
    usedef = UseDef(program, block)
    block.ops.append(Op("neg", "aten.neg.Tensor", (Ref("c"),), outputs=["a2"]))
    assert "changed directly" in check_consistent(usedef)


def test_compact_verifies_in_tests():
    program = _program()
    usedef = UseDef(program, program.global_block)
    usedef.writers["c"].clear()
    with pytest.raises(fleetc.VerificationError, match=r"writers of \['c'\]"):
        usedef.compact()  # tests/conftest.py turns fleetc.ir.usedef.CHECK on


def test_fresh_names():
    names = Names(_program())
    assert names.fresh("relu") == "relu_1" and names.fresh("relu") == "relu_2" and names.fresh("new") == "new"
    assert names.fresh("x") == "x_1"


def test_visit_counter_counts_only_while_active():
    program = _program()
    with count_visits() as counter:
        read = [op.inputs for op in program.global_block.ops]
        with pytest.raises(RuntimeError, match="does not nest"), count_visits():
            pass
    counted = counter.total
    assert counted >= 6  # each op: args and kwargs
    assert [op.inputs for op in program.global_block.ops] == read
    assert counter.total == counted and "__getattribute__" not in Op.__dict__
