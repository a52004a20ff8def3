"""Notebook views: Program, PassRecord, History and diff HTML show what each pass did, op by op."""
from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
import torch
import torch.nn.functional as F
from zoo import MLP

import fleetc
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Op, OpRole, Ref
from fleetc.passes.base import PassReport
from fleetc.passes.manager import History, PassRecord
from fleetc.viz.changes import ADDED, CHANGED, REMOVED, compare_programs
from fleetc.viz.program_view import OPEN_ALL_UP_TO


class _Elements(HTMLParser):
    """Collects (tag, attrs, text) of elements with a class, and checks tags balance."""

    def __init__(self):
        super().__init__()
        self.stack, self.found = [], []

    def handle_starttag(self, tag, attrs):
        if tag not in ("br", "meta", "path", "rect", "circle", "polyline"):
            self.stack.append([tag, dict(attrs), ""])

    def handle_endtag(self, tag):
        if tag in ("path", "rect", "circle", "polyline"):
            return
        opened = self.stack.pop()
        assert opened[0] == tag, f"<{opened[0]}> closed by </{tag}>"
        self.found.append(tuple(opened))
        if self.stack:
            self.stack[-1][2] += opened[2]

    def handle_data(self, data):
        if self.stack:
            self.stack[-1][2] += data


def parse(html: str) -> list[tuple[str, dict, str]]:
    parser = _Elements()
    parser.feed(html)
    parser.close()
    assert parser.stack == []
    return parser.found


def ops_with(html: str, status: str) -> list[str]:
    return [attrs["data-op"] for tag, attrs, _ in parse(html)
            if tag == "div" and status in attrs.get("class", "").split() and "data-op" in attrs]


@pytest.fixture(scope="module")
def trainer():
    torch.manual_seed(0)
    model = MLP()
    train = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy)
    train.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    return train


def _edited_history(trainer) -> History:
    """The final Program, then a hand-made pass: relu fused, an op added with provenance, a sub-block."""
    base = trainer.history[-1]
    program = base.program.clone()
    block = program.global_block
    relu = next(op for op in block.ops if op.type == "aten.relu.default")
    relu.type, relu.attrs["provenance"] = "fleetc.fused_relu_demo", "demo_fusion"
    sub = program.new_block(0)
    sub.ops.append(Op("inner_add", "aten.add.Tensor", (Ref("x"), Ref("x")), outputs=[None],
                      attrs={"op_role": int(OpRole.OPTIMIZE), "module_path": "fc2"}))
    block.ops.append(Op("every_k_steps", "fleetc.conditional_block", (), outputs=[],
                        attrs={"op_role": int(OpRole.OPTIMIZE), "sub_block": sub.idx, "provenance": "demo_fusion"}))
    removed = block.ops.pop(0)
    record = PassRecord("demo_fusion", program, PassReport("demo_fusion", changed=True, stats={"fused": 1}),
                        0.004, estimate_memory(program))
    history = History([*trainer.history])
    history.append(record)
    record.removed_name = removed.name
    return history


def test_history_links_each_record_to_the_one_before(trainer) -> None:
    history = trainer.history
    assert history[0].previous is None
    assert [r.previous.name for r in history[1:]] == history.names()[:-1]


def test_record_view_highlights_the_ops_a_pass_removed_and_changed(trainer) -> None:
    record = trainer.history["remove_noop_views"]
    html = record._repr_html_()
    removed = ops_with(html, REMOVED)
    before = {op.name: op for _, op in record.previous.program.walk_ops()}
    assert removed and all(before[name].type in {"aten.detach.default", "aten.t.default", "aten.view.default"}
                           for name in removed)
    assert len(removed) == record.previous.program.num_ops() - record.program.num_ops()
    assert ops_with(html, CHANGED)  # consumers of a removed view now read its input
    text = re.sub(r"<[^>]+>", "", html)
    assert "#1 remove_noop_views" in text
    stats = ", ".join(f"{k}={v}" for k, v in sorted(record.report.stats.items()))
    assert stats in text and f"{record.seconds * 1000:.1f} ms" in text
    ops_before, ops_after = record.previous.program.num_ops(), record.program.num_ops()
    assert f"{ops_before} → {ops_after} (−{ops_before - ops_after})" in text
    assert "estimated peak" in text and "estimated live bytes after each op" in text


def test_added_fused_and_sub_block_ops_are_marked(trainer) -> None:
    history = _edited_history(trainer)
    record = history[-1]
    html = record._repr_html_()
    elements = parse(html)
    assert ops_with(html, ADDED) == ["every_k_steps", "inner_add"]
    assert ops_with(html, CHANGED) == [next(op.name for _, op in record.program.walk_ops()
                                            if op.type == "fleetc.fused_relu_demo")]
    assert ops_with(html, REMOVED) == [record.removed_name]
    badges = [text for tag, attrs, text in elements if tag == "span" and "fused" in attrs.get("class", "")]
    assert badges.count("fused") == 2 and badges.count("by demo_fusion") == 2  # the legend's chip, the fused op
    sub = [text for tag, attrs, text in elements if tag == "details" and attrs.get("class") == "subblock"]
    assert len(sub) == 1 and sub[0].startswith("block 1 (parent 0): 1 ops")
    assert "_ = aten.add.Tensor(x, x)  # optimize  fc2  name=inner_add" in sub[0]  # no output to name it after


def test_program_view_groups_ops_by_module_and_colours_roles(trainer) -> None:
    program = trainer.program
    html = program._repr_html_()
    elements = parse(html)
    groups = [text.split(" ", 1)[0] for tag, attrs, text in elements if tag == "summary" and text[:1] != "P"]
    assert {"fc1", "fc2", "out", "(model"} <= set(groups)
    op_divs = [attrs for tag, attrs, _ in elements if tag == "div" and "data-op" in attrs]
    assert len(op_divs) == program.num_ops()
    roles = {op.name: op.role for _, op in program.walk_ops()}
    for attrs in op_divs:
        role_class = next(c for c in attrs["class"].split() if c.startswith("r-"))
        role = roles[attrs["data-op"]]
        expected = "optimize" if OpRole.OPTIMIZE in role else "backward" if OpRole.BACKWARD in role else \
            "loss" if OpRole.LOSS in role else "forward"
        assert role_class == f"r-{expected}"
    assert program.num_ops() <= OPEN_ALL_UP_TO and '<details class="module">' not in html  # small: all open


def test_large_program_opens_only_changed_groups(trainer) -> None:
    history = _edited_history(trainer)
    program, before = history[-1].program.clone(), history[-2].program.clone()
    for p in (program, before):
        p.global_block.ops[:0] = [Op(f"pad_{i}", "aten.relu.default", (Ref("x"),), outputs=[None],
                                     attrs={"op_role": int(OpRole.FORWARD), "module_path": "pad"})
                                  for i in range(OPEN_ALL_UP_TO)]
    html = fleetc.viz.program_html(program, before)
    opened = re.findall(r'<details class="module" open><summary><b>([^<]+)</b>', html)
    folded = re.findall(r'<details class="module"><summary><b>([^<]+)</b>', html)
    assert "pad" in folded and "fc2" in folded  # nothing changed there
    assert "fc1" in opened and "(model top level)" in opened  # an op removed, an op fused


def test_changes_are_empty_against_the_same_program(trainer) -> None:
    changes = compare_programs(trainer.program, trainer.program.clone())
    assert changes.summary() == "no op changed"
    assert changes.count(ADDED) == changes.count(REMOVED) == changes.count(CHANGED) == 0


def test_history_view_lists_every_pass_with_a_section(trainer) -> None:
    html = trainer.history._repr_html_()
    sections = [attrs["id"] for tag, attrs, _ in parse(html) if tag == "section"]
    assert sections == [f"pass-{i}" for i in range(len(trainer.history))]
    for i, name in enumerate(trainer.history.names()):
        assert f'<a href="#pass-{i}">{name}</a>' in html


def test_diff_is_a_string_with_a_coloured_view(trainer) -> None:
    history = trainer.history
    diff = history.diff("remove_noop_views")
    assert isinstance(diff, str) and diff.startswith("--- before remove_noop_views\n+++ after remove_noop_views\n")
    html = diff._repr_html_()
    deleted = [text for tag, attrs, text in parse(html) if tag == "span" and attrs.get("class") == "del"]
    assert deleted == [line for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert "no difference" in history.diff("capture")._repr_html_()


def test_diff_between_any_two_passes(trainer) -> None:
    history = trainer.history
    diff = history.diff(-1, base="capture")
    assert diff.startswith(f"--- after capture\n+++ after {history.names()[-1]}\n")
    removed = [line for line in diff.splitlines() if line.startswith("-  ")]
    assert any("aten.detach.default" in line for line in removed)
    assert history.diff(2, base=2) == ""
