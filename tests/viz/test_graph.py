"""Graph pictures: one box per op, one arrow per dataflow edge, a module's ops alone, a text fallback."""
from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.nn.functional as F
from zoo import MLP

import fleetc
from fleetc.viz.graph import program_graph


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    model = MLP()
    train = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy)
    train.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    return train.program


def _boxes(svg: str) -> dict[str, tuple[float, float]]:
    return {name: (float(x), float(y)) for name, x, y in
            re.findall(r'<g class="node" data-op="([^"]+)"><title>[^<]*</title><rect x="([\d.]+)" y="([\d.]+)"', svg)}


def test_every_op_is_a_box_and_every_edge_points_down(program) -> None:
    picture = program_graph(program)
    boxes = _boxes(picture.svg)
    assert set(boxes) == {op.name for op in program.global_block.ops}
    # An op reading another op's result sits in a lower layer (the in-place sgd update included).
    ops = program.global_block.ops
    producer: dict[str, str] = {}
    edges = set()
    for op in ops:
        edges |= {(producer[n], op.name) for n in op.inputs if n in producer}
        producer.update((n, op.name) for n in op.defined)
    assert len(re.findall(r"<path d=\"M[\d.]+,[\d.]+ C", picture.svg)) == len(edges)
    assert all(boxes[a][1] < boxes[b][1] for a, b in edges)
    addmm = next(op for op in ops if op.type == "aten.addmm.default")
    assert f"<title>{addmm.name}: f32[4,64] = aten.addmm.default(" in picture.svg
    assert picture._repr_html_().count("<svg") == 1


def test_one_modules_ops(program) -> None:
    picture = program_graph(program, module="fc1")
    names = set(_boxes(picture.svg))
    assert names == {op.name for op in program.global_block.ops if op.module_path == "fc1"}
    assert any("@GRAD" in op.outputs[0] for op in program.global_block.ops if op.name in names and op.outputs)
    assert "fleetc.sgd" not in str(picture) and "] sgd (" in str(picture)


def test_unknown_module_names_the_closest(program) -> None:
    with pytest.raises(ValueError, match="no op of block 0 has module path 'ffc1'; did you mean 'fc1'"):
        program_graph(program, module="ffc1")


def test_without_networkx_the_graph_is_text_with_a_note(program, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "networkx", None)  # import networkx now raises ImportError
    picture = program_graph(program, module="out")
    assert picture.svg is None
    assert str(picture).startswith("networkx is not installed, so the graph is shown as text")
    assert "<svg" not in picture._repr_html_() and "] addmm (" in picture._repr_html_()
