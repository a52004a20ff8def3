"""Program.parse reads the printer's text back: every Program of the zoo's pass histories, and hand-built edge cases."""
from __future__ import annotations

import math
import os

import pytest
import sympy
import torch
from helpers.data_parallel import captured_program, run_data_parallel_passes
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.errors import ProgramParseError
from fleetc.ir.program import CONDITIONAL_BLOCK, Op, OpRole, Program, Ref, Var, VarKind
from fleetc.passes.order import fusion_flags
from fleetc.strategy.config import StrategyConfig

S0 = sympy.Symbol("s0", integer=True, positive=True)
FORWARD = int(OpRole.FORWARD)

# Strategies whose pass histories the round trip covers; FLEETC_FULL=1 adds each fusion flag on its own.
STRATEGIES = {
    "default": {},
    "all_fusions": {**{f"build_strategy.{flag}": True for flag in fusion_flags()},
                    "build_strategy.enable_auto_fusion": True},
    "recompute": {"recompute": True},
    "amp": {"amp": True},
    "amp_pure_fp16": {"amp": True, "amp_configs.use_pure_fp16": True, "amp_configs.use_fp16_guard": False},
    "gradient_merge": {"gradient_merge": True, "gradient_merge_configs.k_steps": 2},
}
if os.environ.get("FLEETC_FULL") == "1":
    STRATEGIES.update({flag: {f"build_strategy.{flag}": True} for flag in fusion_flags()})
    STRATEGIES["amp_gradient_merge_recompute"] = {**STRATEGIES["amp"], **STRATEGIES["gradient_merge"],
                                                  "recompute": True}


def assert_parses_back(program: Program) -> Program:
    """The text parses to a Program that prints the same and is equal field by field."""
    text = str(program)
    back = Program.parse(text)
    assert str(back) == text
    assert back == program
    return back


@pytest.mark.slow
@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
def test_every_program_of_every_zoo_history_parses_back(strategy_name: str) -> None:
    for zoo_name, entry in ZOO.items():
        torch.manual_seed(0)
        model = entry.make_model()
        optimizer = OPTIMIZERS["adam" if strategy_name.startswith("amp") else "momentum"](model.parameters())
        trainer = fleetc.compile(model, StrategyConfig(STRATEGIES[strategy_name]), optimizer=optimizer,
                                 loss_fn=entry.loss_fn, verify=True)
        args, kwargs = entry.make_batch(torch.Generator().manual_seed(1))
        trainer.step(*args, **kwargs)
        for record in trainer.history:
            assert_parses_back(record.program)


@pytest.mark.slow
@pytest.mark.parametrize("fields", [{}, {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2},
                                         "sync_nccl_allreduce": False}])
def test_data_parallel_histories_parse_back(fields: dict) -> None:
    for zoo_name in ZOO:
        _, history = run_data_parallel_passes(captured_program(zoo_name), **fields)
        for record in history:
            assert_parses_back(record.program)


def edge_case_program() -> Program:
    """What captured Programs never show but the text form must still hold exactly."""
    program = Program(metadata={"levels": (1, [2, (3,)], ()), "by_id": {7: "seven", (1, 2): None},
                                "quote": "it's \"odd\"\n", "limits": (-math.inf, math.inf, -0.0, 1e-12)})
    block = program.global_block
    block.add_var(Var("x", (S0, 4), "float32", "cuda:0", VarKind.DATA))
    block.add_var(Var("True", (4,), "float32", "cuda:0", VarKind.PARAM))  # a name that reads as a constant
    block.add_var(Var("a b", (2 * S0 + 1, 4), "bfloat16", "cuda:0"))  # a name with a space
    block.add_var(Var("on_host", (4,), "float32", "cpu"))  # off the program's default device
    block.add_var(Var("late", (4,), "float32", "cuda:0"))  # block 0's, first written in the sub-block
    block.add_var(Var("dangling", (3,), "float32", "cuda:0"))  # no op writes it
    block.add_var(Var("flag", (), "bool", "cuda:0", VarKind.COUNTER))
    program.feeds = ["x"]
    program.fetches = {"loss": "a b", "grad:True": "late"}
    block.ops += [
        Op("cat", "aten.cat.default", ([Ref("x"), Ref("True")], 0), outputs=["a b", None],
           attrs={"op_role": FORWARD, "module_path": "enc:0", "source": "/one/model.py:12"}),
        Op("copy", "aten._to_copy.default", (Ref("True"),),
           {"dtype": torch.float32, "device": torch.device("cpu"), "layout": torch.strided,
            "memory_format": torch.contiguous_format}, outputs=["on_host"],
           attrs={"op_role": FORWARD, "module_path": "", "source": "/two/model.py:3", "forward_op": "cat"}),
        Op("bare", "aten.mul.Tensor", (Ref("x"), 2 * S0, "s", 'q"uote', None, True), outputs=[None]),
        Op("odd attrs", "fleetc.noop", (), outputs=["x"],
           attrs={"op_role": 1 << 9, "module_path": None, "source": "generated", "provenance": "my pass",
                  "pairs": ((1, 2), [3]), "op_device": "stage:1"}),
    ]
    sub = program.new_block(0)
    sub.add_var(Var("x", (4,), "float32", "cuda:0"))  # shadows block 0's x
    sub.ops += [
        Op("late", "aten.add.Tensor", (Ref("True"), Ref("True")), {"alpha": 0.5}, outputs=["late"],
           attrs={"op_role": int(OpRole.OPTIMIZE), "module_path": "m"}),
        Op("shadow", "aten.neg.default", (Ref("late"),), outputs=["x"], attrs={"op_role": int(OpRole.OPTIMIZE)}),
    ]
    block.ops.append(Op("cond", CONDITIONAL_BLOCK, (Ref("flag"),), outputs=[],
                        attrs={"op_role": int(OpRole.OPTIMIZE), "module_path": "", "sub_block": 1}))
    block.ops.append(Op("after", "aten.relu.default", (Ref("late"),), outputs=["late"],
                        attrs={"op_role": FORWARD, "module_path": ""}))
    return program


def test_edge_cases_parse_back_exactly() -> None:
    program = edge_case_program()
    back = assert_parses_back(program)
    text = str(program)
    assert "device: cuda:0" in text and "on_host: f32[4]@cpu" in text
    assert "%'a b': bf16[2*s0 + 1,4], _ = aten.cat.default([x, %'True'], 0)" in text
    assert "  # forward  module_path='enc:0'  /one/model.py:12" in text  # two files named model.py: full paths
    assert "# -  -  name=bare" in text  # an op without op_role or module_path
    assert "temp dangling: f32[3] cuda:0" in text and "temp x: f32[4] cuda:0" in text
    assert [type(v) for v in back.metadata["levels"]] == [int, list, tuple]
    assert back.var("a b").shape[0].free_symbols == {S0}
    assert back.blocks[1].vars.keys() == {"x"} and "late" in back.global_block.vars


def test_source_files_are_named_once_in_the_header() -> None:
    program = Program()
    program.global_block.add_var(Var("x", (2,), "float32", kind=VarKind.DATA))
    program.feeds = ["x"]
    program.global_block.ops.append(Op("y", "aten.relu.default", (Ref("x"),), outputs=["y"],
                                       attrs={"op_role": FORWARD, "module_path": "fc", "source": "/src/m.py:7"}))
    program.global_block.add_var(Var("y", (2,), "float32"))
    text = str(program)
    assert text.splitlines()[:2] == ["program: 1 ops, 1 block(s)", "sources: /src/m.py"]
    assert text.endswith("y: f32[2] = aten.relu.default(x)  # forward  fc  m.py:7\n}")
    assert_parses_back(program)


def test_nan_arguments_print_back_the_same() -> None:
    program = Program()
    program.global_block.add_var(Var("x", (2,), "float32", "cpu", VarKind.DATA))
    program.feeds = ["x"]
    program.global_block.ops.append(Op("fill", "aten.fill.Scalar", (Ref("x"), math.nan), outputs=["x"],
                                       attrs={"op_role": FORWARD, "module_path": ""}))
    back = Program.parse(str(program))
    assert math.isnan(back.global_block.ops[0].args[1]) and str(back) == str(program)


def test_pass_record_dumps_and_comments_parse() -> None:
    program = edge_case_program()
    text = f"# constructed by some_pass (1.0 ms): changed\n// a comment\n\n{program}\n"
    assert Program.parse(text) == program


def test_values_without_a_text_form_are_refused_by_name() -> None:
    program = edge_case_program()
    program.global_block.ops[2].args = (torch.ones(1),)
    with pytest.raises(ProgramParseError, match=r"line \d+, column \d+: expected a value \(values printed as <type"):
        Program.parse(str(program))


HEADER = "program train: 1 ops, 1 block(s)\nfeeds: -\nfetches: -\nblock 0 {\n  data x: f32[2] cpu\n"


@pytest.mark.parametrize("text, message", [
    ("", r"line 1: expected the header 'program KIND: N ops, M block\(s\)', found the end"),
    ("progrm train: 1 ops\n", r"line 1: expected the header"),
    (HEADER + "  y: f32[2] = aten.relu.default(x)  # forward\n}\n", None),
    (HEADER + "  y: f32[2] = aten.relu.default(x)\n}\n", r"line 6, column 35: expected '  # ' and the op's notes"),
    (HEADER + "  y: f32[2] = aten.relu.default(x  # forward\n}\n", r"line 6, column 34: expected ', ' or '\)'"),
    (HEADER + "  y: f32[2] = aten.relu.default(x)  # sideways\n}\n", r"line 6, column 39: expected a role made of"),
    (HEADER + "  y: f32[2] = aten.relu.default(x)  # forward  shape=2\n}\n", r"line 6.*a note key among"),
    (HEADER + "  x: f32[3] = aten.relu.default(x)  # forward\n}\n",
     r"line 6, column 6: expected the type of data Var 'x' \(float32\[2\] on cpu\)"),
    (HEADER + "  () = aten.relu.default(x)  # forward\n}\n", r"line 6.*expected a name=… note"),
    (HEADER + "  y: f32[2] = aten.relu.default(x)  # forward\n", r"line 7: expected an op, a declaration or '}'"),
    (HEADER + "  y: f32[2] = aten.relu.default(x)  # forward\n  y: f32[2] = aten.relu.default(x)  # forward\n}\n",
     r"line 1: the header says 1 ops; the text has 2"),
    (HEADER + "  data x: f32[2] cpu\n}\n",
     r"line 6, column 8: expected a Var not declared before in block 0 \('x' is\)"),
    (HEADER + "  block 1 (parent 0) {\n  }\n}\n", r"line 6: expected an op before nested block 1"),
    (HEADER.replace("feeds: -", "feeds: x: f32[3]") + "  y: f32[2] = aten.relu.default(x)  # forward\n}\n",
     r"line 2: feed 'x' does not match its declaration"),
    (HEADER.replace("fetches: -", "retches: -"), r"line 3: expected a header line"),
])
def test_parse_errors_name_the_line_and_what_was_expected(text: str, message: str | None) -> None:
    if message is None:
        assert str(Program.parse(text)) == text.rstrip("\n")
        return
    with pytest.raises(ProgramParseError, match=message):
        Program.parse(text)
