"""Guards: a change to what a compiled step assumed recompiles it (matching eager) or raises GuardError."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.side_by_side import Block, batches, train_pair
from torch import nn

import fleetc
from fleetc.ir.serialize import program_from_json, program_to_json
from fleetc.runtime.guards import GuardRecord


def _recompiles(pair) -> list[str]:
    return pair.trainer.report().recompiles


def test_a_submodule_switched_to_eval_after_compile_recompiles():
    def freeze(model, _):
        model.bn.eval()
        model.drop.eval()
    pair = train_pair(Block, 4, {2: freeze})
    pair.assert_same()
    assert int(pair.compiled.bn.num_batches_tracked) == 2  # frozen after two steps, as in eager
    (line,) = _recompiles(pair)
    assert "step 3" in line and "bn.training changed: True when compiled, now False" in line


def test_a_plain_attribute_forward_reads_is_guarded():
    def cool(model, _):
        model.temperature = 4.0
    pair = train_pair(Block, 3, {1: cool})
    pair.assert_same()
    assert "attribute temperature changed: 1.0 when compiled, now 4.0" in _recompiles(pair)[0]


def test_an_equal_value_in_a_new_object_does_not_recompile():
    def same(model, _):
        model.temperature = float("1.0")  # equal, maybe another object: the check re-arms, no recompile
        model.drop.p = 0.25 + 0.25
    pair = train_pair(Block, 3, {1: same})
    pair.assert_same()
    assert _recompiles(pair) == []


def test_forward_hooks_added_after_compile_are_traced_and_removal_is_noticed():
    handles = []

    def add(model, _):
        handles.append(model.fc.register_forward_hook(lambda module, args, out: out * 0.5))
        handles.append(model.head.register_forward_pre_hook(lambda module, args: (args[0] + 1,)))

    def remove(model, _):
        while handles:
            handles.pop().remove()
    pair = train_pair(Block, 5, {1: add, 3: remove})
    pair.assert_same()
    lines = _recompiles(pair)
    assert len(lines) == 1 and "fc forward hooks" in lines[0]  # step 4 finds the step-1 Program again


def test_freezing_a_parameter_after_compile_stops_its_updates():
    def freeze(model, _):
        model.fc.weight.requires_grad_(False)
    pair = train_pair(Block, 3, {1: freeze})
    pair.assert_same()
    assert "fc.weight.requires_grad changed: True when compiled, now False" in _recompiles(pair)[0]


def test_param_group_membership_is_guarded():
    def two_groups(params):
        params = list(params)
        return torch.optim.SGD([{"params": params[:2]}, {"params": params[2:4], "lr": 0.5}, {"params": params[4:]}],
                               lr=0.1)

    def swap(model, optimizer):  # same group sizes, different members: an old Program would use old lrs
        first, second = optimizer.param_groups[0]["params"], optimizer.param_groups[1]["params"]
        first[1], second[0] = second[0], first[1]
    pair = train_pair(Block, 3, {1: swap}, make_optimizer=two_groups)
    pair.assert_same()
    assert "param groups changed" in _recompiles(pair)[0]


def test_a_parameter_added_to_a_group_in_place_is_noticed():
    def freeze_then_unfreeze(params):
        params = list(params)
        return torch.optim.SGD(params[:-1], lr=0.1)  # head.bias is not optimized at first

    def add(model, optimizer):
        optimizer.param_groups[0]["params"].append(model.head.bias)
    pair = train_pair(Block, 3, {1: add}, make_optimizer=freeze_then_unfreeze)
    pair.assert_same()
    assert "param group sizes changed" in _recompiles(pair)[0]


def test_a_replaced_submodule_recompiles_and_trains_the_new_one():
    def replace(model, optimizer):
        torch.manual_seed(5)
        model.head = nn.Linear(8, 4)
        optimizer.param_groups[0]["params"] = list(model.parameters())
    pair = train_pair(Block, 3, {1: replace})
    pair.assert_same()
    assert "module head was replaced" in _recompiles(pair)[0]


def test_on_guard_failure_error_raises_naming_the_change():
    model = Block()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy,
                             on_guard_failure="error")
    (x, y), = batches(1)
    trainer.step(x, y)
    model.bn.eval()
    with pytest.raises(fleetc.GuardError, match="bn.training changed: True when compiled, now False"):
        trainer.step(x, y)
    model.bn.train()
    trainer.step(x, y)  # back as compiled: fine
    with pytest.raises(fleetc.GuardError, match=r"argument args\[0\] changed"):
        trainer.step(x[:8], y[:8])


def test_the_program_cache_is_bounded_and_reports_what_it_dropped():
    model = Block()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy,
                             cache_limit=2, dynamic=False)  # every batch size its own Program
    (x, y), = batches(1)
    for rows in (16, 8, 4, 16):
        trainer.step(x[:rows], y[:rows])
    lines = trainer.report().recompiles
    assert sum("dropped the least recently used train Program (cache_limit=2)" in line for line in lines) == 2
    assert sum("recompiled" in line for line in lines) == 3  # 16 was dropped, so it compiles again
    assert len(trainer._cache) == 2


def test_report_lists_the_guards_and_every_recompile():
    pair = train_pair(Block, 3, {1: lambda model, _: model.drop.eval()})
    report = pair.trainer.report()
    text = str(report)
    assert "guards (a change recompiles):" in text and "recompiles:" in text
    assert any(line.startswith("training (2): bn=True, drop=False") for line in report.guards)
    assert any(line.startswith("attribute (") for line in report.guards)
    attributes = pair.trainer._last_train.guards.record.of_kind("attribute")
    assert {(g.target, g.expected) for g in attributes} >= {("temperature", 1.0), ("drop.p", 0.5)}
    assert any(line.startswith("requires_grad (") for line in report.guards)
    assert "hooks: none registered" in report.guards


def test_hooks_registered_elsewhere_do_not_recompile_and_the_check_stays_cheap():
    pair = train_pair(Block, 2)
    guards = pair.trainer._last_train.guards
    other = nn.Linear(2, 2)
    other.register_forward_hook(lambda *args: None)
    assert not guards._unchanged()  # torch's hook counter moved
    assert guards.passes() and guards._unchanged()  # nothing of ours changed: re-armed
    pair.trainer.step(*batches(1)[0])
    assert pair.trainer.report().recompiles == []


def test_the_guard_record_is_json_and_travels_with_the_program():
    pair = train_pair(Block, 1)
    record = pair.trainer._last_train.guards.record
    assert GuardRecord.from_json(record.to_json()) == record
    program = program_from_json(program_to_json(pair.trainer.program))
    assert GuardRecord.from_data(program.metadata["guards"]) == record
    kinds = {g.kind for g in record.guards}
    assert kinds == {"input", "training", "attribute", "module", "tensor", "requires_grad", "param_group", "hooks"}


def test_an_eval_call_keeps_every_submodule_flag_as_the_user_set_it():
    model = Block()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy)
    model.bn.eval()
    x, _ = batches(1)[0]
    out = trainer(x)
    assert model.training and not model.bn.training and model.drop.training
    model.eval()
    torch.testing.assert_close(out, model(x))
