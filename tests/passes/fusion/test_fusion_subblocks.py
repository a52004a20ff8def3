"""Fusion inside sub-blocks: optimizer updates that AMP's skip-on-overflow block or gradient merge's update block
holds are fused there, block by block; sub-block reads count as reads of the owning op; the runtime runs them."""
from __future__ import annotations

import pytest
import torch
from conftest import run_side_by_side
from fusion_helpers import fusion_strategy, stats
from helpers.amp import pure_strategy
from helpers.gradient_merge import assert_same_state, eager_accumulation, run_merged
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.ir.liveness import block_reads, block_writes, last_use_index
from fleetc.ir.program import (
    CONDITIONAL_BLOCK,
    Block,
    Op,
    OpRole,
    Program,
    Ref,
    Var,
    VarKind,
)
from fleetc.ir.verifier import verify
from fleetc.passes.fusion.auto import FUSED_OP_TYPE, AutoFusion
from fleetc.passes.fusion.elementwise import FuseElementwiseAddAct
from fleetc.passes.fusion.optimizer import FuseOptimizerOps
from fleetc.passes.recompute.plan import forward_region
from fleetc.passes.recompute.policy import RecomputePolicy
from fleetc.runtime.pycodegen import generate_step

UPDATE_TYPES = {"fleetc.sgd", "fleetc.adam"}
FUSED_TYPE = {"sgd": "fleetc.fused_sgd", "momentum": "fleetc.fused_sgd", "adam": "fleetc.fused_adam",
              "adamw": "fleetc.fused_adam"}
MLP_PARAMS = 6
K_STEPS = 2


def strategy(fuse: bool, amp: bool = False, merge: bool = False, **amp_configs) -> fleetc.DistributedStrategy:
    result = fusion_strategy(*(["fuse_all_optimizer_ops"] if fuse else []))
    if amp:
        result.amp = True
        result.amp_configs = {"dtype": "bfloat16", **amp_configs}
    if merge:
        result.gradient_merge = True
        result.gradient_merge_configs = {"k_steps": K_STEPS, "avg": True}
    return result


def compiled(optimizer_name: str, strategy: fleetc.DistributedStrategy) -> fleetc.CompiledTrainer:
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    model = entry.make_model()
    return fleetc.compile(model, strategy, optimizer=OPTIMIZERS[optimizer_name](model.parameters()),
                          loss_fn=entry.loss_fn, verify=True)


def update_block(program: Program) -> Block:
    """The block holding the optimizer update: the innermost sub-block (AMP's skip block nests in gradient merge's)."""
    blocks = [b for b in program.blocks if any(op.type.startswith("fleetc.fused_") or op.type in UPDATE_TYPES
                                               for op in b.ops)]
    assert len(blocks) == 1, [b.idx for b in blocks]
    return blocks[0]


def assert_fused_in_sub_block(trainer: fleetc.CompiledTrainer, optimizer_name: str) -> None:
    """Exactly one fused update with all six parameters, inside a sub-block, and no per-parameter update left."""
    program = trainer.program
    block = update_block(program)
    assert block.idx != 0
    fused = [op for op in block.ops if op.type == FUSED_TYPE[optimizer_name]]
    assert len(fused) == 1 and len(fused[0].args[0]) == MLP_PARAMS
    assert not UPDATE_TYPES & {op.type for _, op in program.walk_ops()}
    assert stats(trainer, "fuse_all_optimizer_ops") == {"fused_ops": 1, "params_fused": MLP_PARAMS,
                                                        "ops_removed": MLP_PARAMS - 1}
    owner = next(op for _, op in program.walk_ops() if op.sub_block == block.idx)
    assert any(note.startswith(f"block {block.idx} (the sub-block of {owner.name}): 1 fused update")
               for note in trainer.history["fuse_all_optimizer_ops"].report.notes)


def assert_bit_identical(fused: fleetc.CompiledTrainer, unfused: fleetc.CompiledTrainer, fused_losses: list,
                         unfused_losses: list) -> None:
    """The fused update is the per-parameter update, so the whole run matches the unfused one exactly."""
    torch.testing.assert_close(torch.stack(fused_losses), torch.stack(unfused_losses), rtol=0, atol=0)
    assert_same_state(fused.model.state_dict(), unfused.model.state_dict(), rtol=0, atol=0)
    assert_same_state(fused.optimizer.state_dict()["state"], unfused.optimizer.state_dict()["state"], rtol=0, atol=0)


# ----- the zoo under AMP, gradient merge and both ---------------------------------------------------
@pytest.mark.parametrize("optimizer_name", sorted(FUSED_TYPE))
def test_amp_skip_block_updates_are_fused_and_training_matches(optimizer_name):
    """bf16: bit-identical to unfused AMP, losses within 5% of eager fp32 (as tests/passes/precision/test_amp.py; bf16
    parameters drift too far under Adam for a useful bound). With every white op black-listed AMP computes
    in float32 (scaling by a power of two is exact), so the fused skip block must match eager to fp32 tolerance."""
    run = run_side_by_side("mlp", optimizer_name, steps=3, strategy=strategy(True, amp=True))
    plain = run_side_by_side("mlp", optimizer_name, steps=3, strategy=strategy(False, amp=True))
    assert_fused_in_sub_block(run.trainer, optimizer_name)
    assert update_block(run.trainer.program).parent_idx == 0
    assert_bit_identical(run.trainer, plain.trainer, run.compiled_losses, plain.compiled_losses)
    eager, amp = torch.stack(run.eager_losses), torch.stack(run.compiled_losses)
    assert ((amp - eager).abs() / eager.abs()).max() < 0.05

    fp32 = run_side_by_side("mlp", optimizer_name, steps=3, strategy=strategy(True, amp=True,
                                                                              custom_black_list=["matmul"]))
    assert_fused_in_sub_block(fp32.trainer, optimizer_name)
    fp32.assert_same()


@pytest.mark.parametrize("optimizer_name", sorted(FUSED_TYPE))
def test_gradient_merge_update_block_is_fused_and_matches_eager_accumulation(optimizer_name):
    micro_steps = 2 * K_STEPS
    eager_model, eager_losses = eager_accumulation("mlp", optimizer_name, K_STEPS, True, micro_steps)
    trainer = compiled(optimizer_name, strategy(True, merge=True))
    losses = run_merged(trainer, "mlp", micro_steps)
    assert_fused_in_sub_block(trainer, optimizer_name)
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-5, atol=1e-6)
    assert_same_state(trainer.model.state_dict(), eager_model.state_dict())


@pytest.mark.parametrize("optimizer_name", sorted(FUSED_TYPE))
def test_amp_with_gradient_merge_fuses_the_nested_skip_block(optimizer_name):
    """The updates sit two blocks deep (gradient merge's block holds AMP's); bf16 numerics as above."""
    micro_steps = 2 * K_STEPS
    _, eager_losses = eager_accumulation("mlp", optimizer_name, K_STEPS, True, micro_steps)
    trainer = compiled(optimizer_name, strategy(True, amp=True, merge=True))
    losses = run_merged(trainer, "mlp", micro_steps)
    plain = compiled(optimizer_name, strategy(False, amp=True, merge=True))
    plain_losses = run_merged(plain, "mlp", micro_steps)
    assert_fused_in_sub_block(trainer, optimizer_name)
    program = trainer.program
    assert program.blocks[update_block(program).parent_idx].parent_idx == 0, "nested: block 0 → merge → skip"
    assert_bit_identical(trainer, plain, losses, plain_losses)
    eager = torch.stack(eager_losses)
    assert ((torch.stack(losses) - eager).abs() / eager.abs()).max() < 0.05


@pytest.mark.parametrize("fuse", [False, True])
def test_amp_with_gradient_merge_in_float32_matches_eager_accumulation_exactly_enough(fuse):
    """With every white op black-listed AMP computes in float32 (loss scaling by a power of two is exact), so
    the merged update, nested in the skip block, must match eager accumulation to fp32 tolerance. Momentum
    with dampening catches a missing latch of the fed "fresh momentum buffer" flag read inside that block."""
    micro_steps = 2 * K_STEPS
    eager_model, eager_losses = eager_accumulation("mlp", "momentum", K_STEPS, True, micro_steps)
    trainer = compiled("momentum", strategy(fuse, amp=True, merge=True, custom_black_list=["matmul"]))
    losses = run_merged(trainer, "mlp", micro_steps)
    assert any(op.type == "fleetc.latch" for op in trainer.program.global_block.ops)
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-5, atol=1e-6)
    assert_same_state(trainer.model.state_dict(), eager_model.state_dict())
    if fuse:
        assert_fused_in_sub_block(trainer, "momentum")


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_pure_bf16_rounding_of_masters_moves_after_the_fused_update(optimizer_name):
    """use_pure_fp16 rounds each updated master into its bf16 parameter right after its update: those assigns
    read what the fused op writes, so they move after it (else they would round the stale master)."""
    fused = run_side_by_side("mlp", optimizer_name, steps=3, strategy=_pure(True))
    plain = run_side_by_side("mlp", optimizer_name, steps=3, strategy=_pure(False))
    assert_fused_in_sub_block(fused.trainer, optimizer_name)
    ops = update_block(fused.trainer.program).ops
    assert [op.type for op in ops] == [FUSED_TYPE[optimizer_name]] + ["fleetc.assign"] * MLP_PARAMS
    assert_bit_identical(fused.trainer, plain.trainer, fused.compiled_losses, plain.compiled_losses)


def _pure(fuse: bool) -> fleetc.DistributedStrategy:
    result = pure_strategy()
    result.build_strategy.fuse_all_optimizer_ops = fuse
    return result


def test_generated_runtime_runs_the_fused_update_under_the_condition():
    trainer = compiled("adam", strategy(True, amp=True))
    trainer.step(*ZOO["mlp"].make_batch(torch.Generator().manual_seed(1))[0])
    lines = trainer.generated_source().splitlines()
    branch = next(i for i, line in enumerate(lines) if line.startswith("    if v_grads_finite:"))
    assert lines[branch + 1].startswith("        k_fleetc_fused_adam([v_fc1_weight, ")
    assert lines[branch + 1].endswith("# fused_adam_6_params")


# ----- hand-built Programs: reads through sub-blocks, block boundaries, placement ------------------------
def _conditional(program: Program, name: str, condition: str, sub: Block) -> Op:
    return Op(name, CONDITIONAL_BLOCK, (Ref(condition),), outputs=[],
              attrs={"sub_block": sub.idx, "op_role": int(OpRole.FORWARD)})


def _nested_program() -> Program:
    """block 0: s = x + y; if flag: { block 1: u = relu(s); t = u + x; if flag: { block 2: v = t * s; a = v + x;
    buf = relu(a) } }; out = relu(y + x).  `relu(s)` would complete an add + act pair across a block boundary."""
    program = Program()
    g = program.global_block
    for name in ("x", "y"):
        g.add_var(Var(name, (4,), "float32", kind=VarKind.DATA))
    g.add_var(Var("flag", None, "bool", kind=VarKind.HYPER))
    g.add_var(Var("buf", (4,), "float32", kind=VarKind.BUFFER))
    for name in ("s", "r", "out"):
        g.add_var(Var(name, (4,), "float32"))
    one = program.new_block(0)
    two = program.new_block(one.idx)
    for block, names in ((one, ("u", "t")), (two, ("v", "a", "w"))):
        for name in names:
            block.add_var(Var(name, (4,), "float32"))

    def op(name, op_type, args, out):
        return Op(name, op_type, args, outputs=[out], attrs={"op_role": int(OpRole.FORWARD)})

    two.ops = [op("mul_v", "aten.mul.Tensor", (Ref("t"), Ref("s")), "v"),
               op("add_a", "aten.add.Tensor", (Ref("v"), Ref("x")), "a"),
               op("relu_w", "aten.relu.default", (Ref("a"),), "w"),
               op("store", "fleetc.assign", (Ref("buf"), Ref("w")), "buf")]
    one.ops = [op("relu_u", "aten.relu.default", (Ref("s"),), "u"),
               op("add_t", "aten.add.Tensor", (Ref("u"), Ref("x")), "t"),
               _conditional(program, "inner", "flag", two)]
    g.ops = [op("add_s", "aten.add.Tensor", (Ref("x"), Ref("y")), "s"),
             _conditional(program, "outer", "flag", one),
             op("add_r", "aten.add.Tensor", (Ref("y"), Ref("x")), "r"),
             op("relu_out", "aten.relu.default", (Ref("r"),), "out")]
    program.feeds, program.fetches = ["x", "y", "flag"], {"output": "out"}
    verify(program)
    return program


def test_an_op_owning_a_sub_block_reads_and_writes_what_its_sub_blocks_do():
    program = _nested_program()
    outer = program.global_block.ops[1]
    assert block_reads(program, outer) == ["flag", "s", "x", "buf"]  # not u, t, v, a, w: defined inside first
    assert block_writes(program, outer) == ["u", "t", "v", "a", "w", "buf"]
    assert last_use_index(program, program.global_block, {"out"})["s"] == 1, "s lives until the conditional"
    assert last_use_index(program, program.blocks[1], set())["t"] == 2, "t lives until the nested conditional"


def _run(program: Program, flag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.tensor([-1.0, 0.5, 2.0, -3.0]), torch.tensor([0.5, -2.0, 1.0, 4.0])
    buf = torch.zeros(4)
    out = generate_step(program).fn({"buf": buf}, (x, y, flag), None)["output"]
    return out, buf


@pytest.mark.parametrize("fusion", [FuseElementwiseAddAct, AutoFusion])
def test_each_block_is_fused_on_its_own_never_across_its_boundary(fusion):
    program = _nested_program()
    fused, report = fusion().run(program.clone(), None)
    verify(fused)
    types = [[op.type for op in block.ops] for block in fused.blocks]
    if fusion is FuseElementwiseAddAct:
        add_act = "fleetc.fused_elemwise_add_act"
        # add_s stays: its one reader in block 0 is the conditional; relu_u pairs with add_t inside block 1
        assert types == [["aten.add.Tensor", CONDITIONAL_BLOCK, add_act], [add_act, CONDITIONAL_BLOCK],
                         ["aten.mul.Tensor", add_act, "fleetc.assign"]]
        assert report.stats == {"forward_groups": 3, "ops_removed": 3}
        assert report.notes == ["block 1: 1 forward group(s) fused inside the sub-block",
                                "block 2: 1 forward group(s) fused inside the sub-block"]
    else:
        assert types == [["aten.add.Tensor", CONDITIONAL_BLOCK, FUSED_OP_TYPE], [FUSED_OP_TYPE, CONDITIONAL_BLOCK],
                         [FUSED_OP_TYPE, "fleetc.assign"]]
        assert report.stats == {"groups": 3, "ops_fused": 7, "reductions_fused": 0}
    # intermediates are internal now (u, a; and v with auto fusion); t and w are read after their group
    assert set(fused.blocks[1].vars) == {"t"}
    assert set(fused.blocks[2].vars) == ({"v", "w"} if fusion is FuseElementwiseAddAct else {"w"})
    for flag in (True, False):
        for got, want in zip(_run(fused, flag), _run(program, flag)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def _updates_program(between: str) -> Program:
    """Two sgd updates (p, q) in a skip block with one op between them: `reads_p` copies the new p into a buffer
    (it may follow the fused update), `independent` halves q's gradient (it does not use p's update, so it may
    precede both), `chained` copies the new p into q's gradient (it must come between the two updates)."""
    program = Program()
    g = program.global_block
    for name in ("p", "q"):
        g.add_var(Var(name, (3,), "float32", kind=VarKind.PARAM))
        g.add_var(Var(f"{name}@GRAD", (3,), "float32", kind=VarKind.ACCUMULATOR))
    g.add_var(Var("copy", (3,), "float32", kind=VarKind.BUFFER))
    g.add_var(Var("flag", None, "bool", kind=VarKind.HYPER))
    g.add_var(Var("lr", None, "float64", kind=VarKind.HYPER))
    sub = program.new_block(0)
    opt = {"op_role": int(OpRole.OPTIMIZE)}

    def sgd(param):
        return Op(f"sgd_{param}", "fleetc.sgd", (Ref(param), Ref(f"{param}@GRAD"), None, False, Ref("lr"), 0.0, 0.0,
                                                 False, 0.0, False), outputs=[param], attrs=dict(opt))

    op = {"reads_p": Op("keep_p", "fleetc.assign", (Ref("copy"), Ref("p")), outputs=["copy"], attrs=dict(opt)),
          "independent": Op("halve_q_grad", "fleetc.divide", (Ref("q@GRAD"), 2.0), outputs=["q@GRAD"],
                            attrs=dict(opt)),
          "chained": Op("p_into_q_grad", "fleetc.assign", (Ref("q@GRAD"), Ref("p")), outputs=["q@GRAD"],
                        attrs=dict(opt))}[between]
    sub.ops = [sgd("p"), op, sgd("q")]
    g.ops = [Op("skip", CONDITIONAL_BLOCK, (Ref("flag"),), outputs=[], attrs={**opt, "sub_block": sub.idx})]
    program.feeds = ["flag", "lr"]
    verify(program)
    return program


def _run_updates(program: Program) -> dict:
    state = {"p": torch.ones(3), "q": torch.ones(3), "p@GRAD": torch.full((3,), 2.0), "q@GRAD": torch.full((3,), 4.0),
             "copy": torch.full((3,), -7.0)}
    generate_step(program).fn(state, (True, 0.5), None)
    return state


@pytest.mark.parametrize(("between", "order"), [("reads_p", ["fused_sgd_2_params", "keep_p"]),
                                                ("independent", ["halve_q_grad", "fused_sgd_2_params"])])
def test_ops_that_use_an_earlier_update_move_after_the_fused_one_and_others_stay(between, order):
    program = _updates_program(between)
    fused, report = FuseOptimizerOps().run(program.clone(), None)
    verify(fused)
    assert [op.name for op in fused.blocks[1].ops] == order
    assert report.stats == {"fused_ops": 1, "params_fused": 2, "ops_removed": 1}
    want = _run_updates(program)
    for name, value in _run_updates(fused).items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)
    assert torch.equal(want["copy"], torch.zeros(3) if between == "reads_p" else torch.full((3,), -7.0))


def test_updates_an_op_between_them_feeds_are_left_unfused_and_reported():
    program = _updates_program("chained")
    fused, report = FuseOptimizerOps().run(program.clone(), None)
    verify(fused)
    assert [op.name for op in fused.blocks[1].ops] == ["sgd_p", "p_into_q_grad", "sgd_q"]
    assert not report.changed and report.skipped_reason is None
    assert report.stats == {"groups_not_fused": 1}
    assert report.notes == ["block 1: 2 fleetc.sgd ops not fused: p_into_q_grad (fleetc.assign) uses 'q@GRAD' "
                            "after the update of 'p' and before that of 'q'"]


def test_the_verifier_sees_what_a_conditional_blocks_updates_read():
    program = _updates_program("independent")
    program.global_block.ops.append(Op("late_grad", "fleetc.accumulate", (Ref("p@GRAD"), Ref("p@GRAD")),
                                       outputs=["p@GRAD"], attrs={"op_role": int(OpRole.BACKWARD)}))
    with pytest.raises(fleetc.VerificationError, match="optimize op reads 'p@GRAD' before its last backward writer"):
        verify(program)


def test_recompute_sees_forward_values_a_sub_block_reads_after_forward():
    """A forward value read only inside a conditional block after forward is live there (saved or recomputed)."""
    program = _updates_program("independent")
    g = program.global_block
    g.add_var(Var("h", (3,), "float32"))
    g.add_var(Var("x", (3,), "float32", kind=VarKind.DATA))
    g.ops.insert(0, Op("relu_h", "aten.relu.default", (Ref("x"),), outputs=["h"],
                       attrs={"op_role": int(OpRole.FORWARD)}))
    g.ops.insert(1, Op("grad_p", "fleetc.accumulate", (Ref("p@GRAD"), Ref("x")), outputs=["p@GRAD"],
                       attrs={"op_role": int(OpRole.BACKWARD)}))
    program.blocks[1].ops[1] = Op("h_into_copy", "fleetc.assign", (Ref("copy"), Ref("h")), outputs=["copy"],
                                  attrs={"op_role": int(OpRole.OPTIMIZE)})
    program.feeds.append("x")
    verify(program)
    assert forward_region(program, RecomputePolicy()).read_after == {"h"}
