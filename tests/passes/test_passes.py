"""Baseline passes (no-op view removal, DCE) on small before/after fixtures, and the manager's bookkeeping."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.ir import op_lines
from zoo import MLP, ZOO

import fleetc
from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ir.verifier import verify
from fleetc.passes.cleanup.dce import DeadCodeElimination
from fleetc.passes.cleanup.noop_views import RemoveNoopViews
from fleetc.passes.order import PASS_ORDER, SWITCHED_BY_ARGUMENT, ordered_passes
from fleetc.strategy import resolve_strategy


def _fixture() -> Program:
    """x → t → t → relu, plus a detach, an unused exp and a dropout whose result is unused."""
    p = Program()
    b = p.global_block
    b.add_var(Var("x", (3, 2), "float32", kind=VarKind.DATA))
    p.feeds.append("x")
    for name, shape in (("a", (2, 3)), ("b", (3, 2)), ("c", (3, 2)), ("d", (3, 2)), ("unused", (3, 2)),
                        ("drop", (3, 2)), ("mask", (3, 2))):
        b.add_var(Var(name, shape, "bool" if name == "mask" else "float32"))
    role = {"op_role": int(OpRole.FORWARD)}
    b.ops = [
        Op("t1", "aten.t.default", (Ref("x"),), outputs=["a"], attrs=dict(role)),
        Op("t2", "aten.t.default", (Ref("a"),), outputs=["b"], attrs=dict(role)),
        Op("det", "aten.detach.default", (Ref("b"),), outputs=["c"], attrs=dict(role)),
        Op("exp", "aten.exp.default", (Ref("c"),), outputs=["unused"], attrs=dict(role)),
        Op("dropout", "aten.native_dropout.default", (Ref("c"), 0.5, True), outputs=["drop", "mask"],
           attrs=dict(role)),
        Op("relu", "aten.relu.default", (Ref("c"),), outputs=["d"], attrs=dict(role)),
    ]
    p.fetches["out"] = "d"
    verify(p)
    return p


def test_noop_views_forward_values_and_drop_t_of_t():
    program, report = RemoveNoopViews().run(_fixture(), None)
    verify(program)
    assert op_lines(program) == [
        "a: f32[2,3] = aten.t.default(x)",
        "unused: f32[3,2] = aten.exp.default(x)",
        "drop: f32[3,2], mask: b8[3,2] = aten.native_dropout.default(x, 0.5, True)",
        "d: f32[3,2] = aten.relu.default(x)",
    ]
    assert report.changed and report.stats == {"t_removed": 1, "detach_removed": 1}


def test_dce_removes_dead_ops_but_keeps_rng_ops():
    program, _ = RemoveNoopViews().run(_fixture(), None)
    program, report = DeadCodeElimination().run(program, None)
    verify(program)
    assert [op.name for op in program.global_block.ops] == ["dropout", "relu"]
    assert report.stats["ops_removed"] == 2


def test_dce_reports_no_change_when_nothing_is_dead():
    program, _ = DeadCodeElimination().run(_fixture(), None)
    again, report = DeadCodeElimination().run(program, None)
    assert not report.changed and report.stats["ops_removed"] == 0


def _trained(**kwargs):
    model = MLP()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy,
                             **kwargs)
    trainer.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    return trainer


def test_history_has_one_record_per_pass_with_snapshots_and_diffs():
    trainer = _trained(verify=True)
    history = trainer.history
    # fuse_bn_add_act_ops is on by default (as in Paddle), so its pass runs and reports it found nothing;
    # the data-parallel passes run and report that a single process needs no collectives
    assert history.names() == ["capture", "remove_noop_views", "sync_batch_norm", "fuse_bn_add_act", "parameter_server",
                               "insert_allreduce",
                               "fuse_all_reduce_ops", "allreduce_views", "overlap_allreduce",
                               "dead_code_elimination"]
    assert history["capture"].program.num_ops() > history[-1].program.num_ops() == trainer.program.num_ops()
    assert history["capture"].program is not history["remove_noop_views"].program
    diff = history.diff("remove_noop_views")
    assert diff.startswith("--- before remove_noop_views") and "-  " in diff
    assert str(history[1]).startswith("# constructed by remove_noop_views (")


def test_report_lists_applied_passes_statistics_and_unimplemented_flags():
    strategy = fleetc.DistributedStrategy()
    strategy.lars = True
    trainer = _trained()
    report = trainer.report()
    assert report.applied == ["remove_noop_views", "dead_code_elimination"]
    assert report.stats["remove_noop_views"]["t_removed"] >= 1
    assert report.compile_seconds > 0 and "applied: remove_noop_views" in str(report)
    model = MLP()
    with_lars = fleetc.compile(model, strategy, loss_fn=F.cross_entropy)
    with_lars.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert with_lars.report().skipped["lars"] == ("lars replaces Momentum (torch.optim.SGD with momentum != 0), as "
                                                  "in Paddle; this Program's updates are no optimizer update")


def test_disabled_pass_is_skipped_and_reported():
    trainer = _trained(disable_passes=["remove_noop_views"])
    report = trainer.report()
    assert "remove_noop_views" not in report.applied
    assert "disabled" in report.skipped["remove_noop_views"]
    with pytest.raises(fleetc.PassError, match="unknown pass"):
        fleetc.compile(MLP(), disable_passes=["no_such_pass"])


def test_print_after_change_prints_only_changed_passes(capsys):
    _trained(print_after="change")
    out = capsys.readouterr().out
    assert out.count("// ----- after") == 2 and "program train" in out


@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_static_memory_estimate_tracks_the_measured_peak(zoo_name):
    entry = ZOO[zoo_name]
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, optimizer=torch.optim.AdamW(model.parameters()), loss_fn=entry.loss_fn,
                             measure_memory=True)
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(0))
    trainer.step(*args, **kwargs)
    trainer.step(*args, **kwargs)  # optimizer state exists now, as the estimate assumes
    stats = trainer.memory_stats()
    estimated, measured = stats["estimated_peak_bytes"], stats["measured_peak_bytes"]
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def test_every_pass_in_the_order_declares_how_it_is_switched_on():
    """Name, summary and reads on every pass; `enabled_by` is None or a real boolean strategy field."""
    config = resolve_strategy(None)
    assert len({p.name for p in PASS_ORDER}) == len(PASS_ORDER)
    for pass_type in PASS_ORDER:
        assert pass_type.name and pass_type.summary and isinstance(pass_type.reads, tuple)
        if pass_type.enabled_by is not None:
            value = config
            for part in pass_type.enabled_by.split("."):
                value = getattr(value, part)
            assert isinstance(value, bool), pass_type.enabled_by
    always = [p.name for p in PASS_ORDER if p.enabled_by is None and p not in SWITCHED_BY_ARGUMENT]
    by_default = [p.name for p in ordered_passes(config)]
    assert set(always) <= set(by_default) and "amp" not in by_default and "fuse_bn_add_act" in by_default
