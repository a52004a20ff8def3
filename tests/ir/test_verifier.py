"""The verifier catches each broken invariant and names the op, its context and the pass."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from zoo import MLP

import fleetc
import fleetc.compiler as compiler
from fleetc.ir.program import Block, Op, OpRole, Ref, Var
from fleetc.ir.verifier import verify
from fleetc.passes.base import PassReport


@pytest.fixture
def program():
    torch.manual_seed(0)
    model = MLP()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy)
    trainer.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    return trainer.program.clone()


def _op_index(program, op_type):
    return next(i for i, op in enumerate(program.global_block.ops) if op.type == op_type)


def test_captured_program_verifies(program):
    verify(program)


def test_use_before_definition(program):
    ops = program.global_block.ops
    i = _op_index(program, "aten.relu.default")
    ops.insert(0, ops.pop(i))
    with pytest.raises(fleetc.VerificationError, match="before any op defines it") as info:
        verify(program, after_pass="my_pass")
    assert "after pass 'my_pass'" in str(info.value) and ">>" in str(info.value)


def test_a_ref_without_a_name_is_reported_not_a_crash(program):
    op = program.global_block.ops[_op_index(program, "aten.relu.default")]
    op.args = (Ref(None), *op.args[1:])
    with pytest.raises(fleetc.VerificationError, match="which no block in scope declares") as info:
        verify(program)
    assert "%<no name>" in str(info.value)


def test_two_definers_of_a_temporary(program):
    ops = program.global_block.ops
    i = _op_index(program, "aten.relu.default")
    dup = Op("dup", ops[i].type, ops[i].args, dict(ops[i].kwargs), list(ops[i].outputs), dict(ops[i].attrs))
    ops.insert(i + 1, dup)
    with pytest.raises(fleetc.VerificationError, match="already defined by op"):
        verify(program)


def test_declared_shape_must_match_computed_shape(program):
    relu = program.global_block.ops[_op_index(program, "aten.relu.default")]
    program.var(relu.outputs[0]).shape = (4, 7)
    with pytest.raises(fleetc.VerificationError, match=r"declared float32\[4, 7\] but computes float32\[4, 64\]"):
        verify(program)


def test_declared_dtype_must_match(program):
    relu = program.global_block.ops[_op_index(program, "aten.relu.default")]
    program.var(relu.outputs[0]).dtype = "float16"
    with pytest.raises(fleetc.VerificationError, match="declared float16"):
        verify(program)


def test_optimize_op_before_the_backward_op_that_feeds_it(program):
    ops = program.global_block.ops
    i = _op_index(program, "fleetc.sgd")
    ops.insert(_op_index(program, "aten.ones_like.default"), ops.pop(i))
    with pytest.raises(fleetc.VerificationError, match="before"):
        verify(program)


def test_aten_op_may_not_write_persistable_state(program):
    relu = program.global_block.ops[_op_index(program, "aten.relu.default")]
    relu.outputs = ["fc1.bias"]
    with pytest.raises(fleetc.VerificationError, match="persistable|writes"):
        verify(program, check_shapes=False)


def test_unknown_op_type(program):
    program.global_block.ops[0].type = "aten.no_such_op.default"
    with pytest.raises(fleetc.VerificationError, match="no_such_op"):
        verify(program)


def test_sub_block_references(program):
    sub = program.new_block(parent_idx=0)
    relu_out = program.global_block.ops[_op_index(program, "aten.relu.default")].outputs[0]
    sub.add_var(Var("doubled", (4, 64), "float32"))
    sub.ops.append(Op("double", "aten.mul.Tensor", (Ref(relu_out), 2.0), outputs=["doubled"],
                      attrs={"op_role": int(OpRole.FORWARD)}))
    program.global_block.add_var(Var("cond", None, "bool", kind=fleetc.VarKind.HYPER))
    program.feeds.append("cond")
    owner = Op("cond_block", "fleetc.conditional_block", (Ref("cond"),), attrs={"sub_block": sub.idx, "op_role": 1})
    program.global_block.ops.insert(_op_index(program, "aten.relu.default") + 1, owner)
    verify(program)  # valid: the sub-block reads a value defined before its owner
    owner.attrs["sub_block"] = 9
    with pytest.raises(fleetc.VerificationError, match="sub_block 9 does not exist"):
        verify(program)
    owner.attrs["sub_block"] = sub.idx
    program.blocks.append(Block(2, parent_idx=1))
    owner.attrs["sub_block"] = 2
    with pytest.raises(fleetc.VerificationError, match="has parent 1, not 0"):
        verify(program)


class _BreakingPass:
    """Moves an op in front of the ops that define its inputs."""

    name = "breaks_things"
    summary = "a deliberately wrong pass"
    reads = ()

    def run(self, program, config):
        ops = program.global_block.ops
        ops.insert(0, ops.pop(len(ops) // 2))
        return program, PassReport(self.name, changed=True)


def test_verify_instrument_names_the_pass_that_broke_the_program(monkeypatch):
    original = compiler.ordered_passes
    monkeypatch.setattr(compiler, "ordered_passes",
                        lambda config, **options: [_BreakingPass(), *original(config, **options)])
    trainer = fleetc.compile(MLP(), loss_fn=F.cross_entropy, verify=True)
    with pytest.raises(fleetc.VerificationError, match="after pass 'breaks_things'"):
        trainer.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))


def test_forward_op_must_name_an_existing_op(program):
    backward = next(op for op in program.global_block.ops if op.attrs.get("forward_op"))
    backward.attrs["forward_op"] = "removed_long_ago"
    with pytest.raises(fleetc.VerificationError, match="forward_op 'removed_long_ago' names no op"):
        verify(program)


def test_conditional_block_takes_one_bool_and_each_sub_block_has_one_owner(program):
    sub = program.new_block(parent_idx=0)
    program.global_block.add_var(Var("cond", None, "bool", kind=fleetc.VarKind.HYPER))
    program.feeds.append("cond")
    owner = Op("cond_block", "fleetc.conditional_block", (Ref("cond"),), attrs={"sub_block": sub.idx, "op_role": 4})
    program.global_block.ops.append(owner)
    verify(program)
    owner.args = (Ref("lr@group0"),)
    with pytest.raises(fleetc.VerificationError, match="takes exactly one argument, a bool Var"):
        verify(program)
    owner.args = (Ref("cond"),)
    owner.type = "fleetc.while_loop"
    with pytest.raises(fleetc.VerificationError, match="only fleetc.conditional_block owns a sub-block"):
        verify(program)
    owner.type = "fleetc.conditional_block"
    program.global_block.ops.append(Op("cond_block_2", "fleetc.conditional_block", (Ref("cond"),),
                                       attrs={"sub_block": sub.idx, "op_role": 4}))
    with pytest.raises(fleetc.VerificationError, match="block 1 is owned by 2 ops"):
        verify(program)
    del program.global_block.ops[-2:]
    with pytest.raises(fleetc.VerificationError, match="block 1 is owned by 0 ops"):
        verify(program)
