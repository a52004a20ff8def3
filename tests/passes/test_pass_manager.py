"""The pass manager runs one live Program and rebuilds each record's Program on request (issue 25); fusion passes
hand their use-def index on to the next pass."""
from __future__ import annotations

import pytest
import torch
from helpers.scaling import all_passes_strategy, encoder_and_batch

import fleetc
from fleetc.capture import capture_train_program
from fleetc.errors import PassError, VerificationError
from fleetc.ir import usedef
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Op, Program, Ref
from fleetc.passes import manager
from fleetc.passes.base import PassReport
from fleetc.passes.fusion import match
from fleetc.passes.manager import History, PassManager, PassRecord, fingerprint
from fleetc.passes.order import ordered_passes
from fleetc.strategy import resolve_conflicts, resolve_strategy


@pytest.fixture(scope="module")
def captured() -> Program:
    model, optimizer, batch = encoder_and_batch(2)
    return capture_train_program(model, None, optimizer, batch, {})


def _config():
    return resolve_conflicts(resolve_strategy(all_passes_strategy()))[0]


def _run(program: Program, passes, config, disabled=(), fingerprint_arguments=False) -> tuple[Program, History]:
    history = History([PassRecord("capture", program, PassReport("capture"), 0.0, estimate_memory(program))])
    manager = PassManager(passes, disabled=disabled, fingerprint_arguments=fingerprint_arguments)
    return manager.run(program, config, history), history


def test_history_programs_rebuilt_on_request_print_as_a_copy_per_pass_would(captured, monkeypatch):
    config = _config()
    passes = ordered_passes(config)
    expected, program = [str(captured)], captured.clone()
    memory = [estimate_memory(captured)]
    for p in passes:  # the former manager: every pass on a copy of the Program before it
        program, _ = p.run(program.clone(), config)
        expected.append(str(program))
        memory.append(estimate_memory(program))
    copies = 0
    clone = Program.clone

    def counted(self: Program) -> Program:
        nonlocal copies
        copies += 1
        return clone(self)

    monkeypatch.setattr(Program, "clone", counted)
    final, history = _run(captured, passes, config)
    assert copies == 1, "the manager copies the captured Program once, whatever the number of passes"
    monkeypatch.setattr(Program, "clone", clone)
    assert history[-1].program is final
    assert "rebuilt on access" in repr(history[1]) and "built" in repr(history[-1])
    assert [str(record.program) for record in history] == expected
    assert [record.memory for record in history] == memory
    assert sum(record.report.changed for record in history[1:]) >= 4  # the check sees several passes' edits
    assert history["capture"].program is captured
    assert history.diff("fuse_gemm_epilogue").startswith("--- before fuse_gemm_epilogue")


def test_a_disabled_pass_shares_the_program_before_it(captured):
    config = _config()
    final, history = _run(captured, ordered_passes(config), config, disabled={"fuse_gemm_epilogue"})
    i = history.index_of("fuse_gemm_epilogue")
    assert history[i].program is history[i - 1].program
    assert "fused_gemm" not in str(final)


class _Unsteady:
    """A pass that is not deterministic: it names its op after how many times it ran."""

    name = "unsteady"
    runs = 0

    def run(self, program: Program, config) -> tuple[Program, PassReport]:
        type(self).runs += 1
        loss = program.fetches["loss"]
        program.global_block.ops.append(Op(f"unsteady_{self.runs}", "aten.clone.default", (Ref(loss),),
                                           outputs=[None]))
        return program, PassReport(self.name, changed=True)


class _Last:
    name = "last"

    def run(self, program: Program, config) -> tuple[Program, PassReport]:
        return program, PassReport(self.name)


def test_replaying_a_pass_that_is_not_deterministic_is_refused(captured):
    _, history = _run(captured, [_Unsteady(), _Last()], _config())
    with pytest.raises(PassError, match="replaying pass 'unsteady'.*not deterministic"):
        history["unsteady"].program  # noqa: B018


class _UnsteadyInside:
    """A pass that is not deterministic in one value only: the op it adds has the same name, type and outputs on
    every run, but its argument, its dtype argument or an attribute depends on how many times it ran."""

    name = "unsteady_inside"
    runs = 0

    def __init__(self, where: str):
        self.where = where

    def run(self, program: Program, config) -> tuple[Program, PassReport]:
        type(self).runs += 1
        odd = self.runs % 2 == 1
        loss = Ref(program.fetches["loss"])
        args = {"argument": (loss, self.runs), "dtype": (loss, torch.float32 if odd else torch.bfloat16),
                "attribute": (loss, 1)}[self.where]
        attrs = {"note": self.runs} if self.where == "attribute" else {}
        program.global_block.ops.append(Op("unsteady", "aten.add.Scalar", args, outputs=[None], attrs=attrs))
        return program, PassReport(self.name, changed=True)


@pytest.mark.parametrize("where", ["argument", "dtype", "attribute"])
def test_replaying_a_pass_that_changes_only_a_value_is_refused_when_arguments_are_fingerprinted(captured, where):
    _, history = _run(captured, [_UnsteadyInside(where), _Last()], _config(), fingerprint_arguments=True)
    with pytest.raises(PassError, match="replaying pass 'unsteady_inside'.*not deterministic"):
        history["unsteady_inside"].program  # noqa: B018


@pytest.mark.parametrize("verify", [False, True])
def test_a_verified_compile_fingerprints_arguments_and_every_pass_replays_to_the_same_values(monkeypatch, verify):
    asked = []

    def recorded(program: Program, arguments: bool = False) -> str:
        asked.append(arguments)
        return fingerprint(program, arguments)

    monkeypatch.setattr(manager, "fingerprint", recorded)
    model, optimizer, batch = encoder_and_batch(2)
    trainer = fleetc.compile(model, all_passes_strategy(), optimizer=optimizer, verify=verify)
    trainer.step(*batch)
    assert asked and set(asked) == {verify}
    programs = [str(record.program) for record in trainer.history]  # every pass replayed and checked
    assert len(set(programs)) >= 4


def _index_builds(captured: Program, config, monkeypatch) -> int:
    """How many times a use-def index of the global block is built from scratch in one run of the pass order."""
    builds = 0
    init = usedef.UseDef.__init__

    def counted(self, program, block):
        nonlocal builds
        builds += block is program.global_block  # not the verifier's rebuilds (tests/conftest.py), of a copy
        init(self, program, block)

    monkeypatch.setattr(usedef.UseDef, "__init__", counted)
    _run(captured, ordered_passes(config), config)
    monkeypatch.setattr(usedef.UseDef, "__init__", init)
    return builds


def test_fusion_passes_hand_the_use_def_index_on(captured, monkeypatch):
    """The five fusion passes in a row build the global block's index once; with hand-on off (every pass drops
    what it was handed) they build it once each. tests/conftest.py verifies each index handed on when taken."""
    config = _config()
    names = [p.name for p in ordered_passes(config)]
    fusions = names[names.index("fuse_bn_add_act"):names.index("auto_fusion") + 1]
    assert len(fusions) >= 5 and all("fus" in name for name in fusions), names
    kept = _index_builds(captured, config, monkeypatch)
    monkeypatch.setattr(match, "hand_on", lambda index: None)
    rebuilt = _index_builds(captured, config, monkeypatch)
    assert rebuilt - kept == len(fusions) - 1, (kept, rebuilt)


def test_an_index_handed_on_only_lives_one_pass_and_a_stale_one_is_caught(captured):
    program = captured.clone()
    block = program.global_block
    with usedef.keeping(program):
        index = usedef.UseDef(program, block)
        index.compact()
        usedef.hand_on(index)
        assert usedef.handed_on(program, block) is None  # not before the pass that handed it on is done
        usedef.pass_done(program)
        assert usedef.handed_on(program, block).readers == index.readers
        usedef.pass_done(program)  # a pass that handed nothing on: what it was handed is gone
        assert usedef.handed_on(program, block) is None
        index = usedef.UseDef(program, block)
        index.compact()
        usedef.hand_on(index)
        usedef.pass_done(program)
        reader = next(op for op in block.ops if op.inputs)
        program.rename_reads(reader, {reader.inputs[0]: "renamed_behind_the_index"})  # an edit not through it
        with pytest.raises(VerificationError, match="use-def information of block 0 is stale"):
            usedef.handed_on(program, block)
    assert usedef.handed_on(program, block) is None  # outside the manager's run nothing is handed on
