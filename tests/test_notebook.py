"""examples/inspect_passes.ipynb runs in a real Jupyter kernel and its cells show the records they claim to."""
from __future__ import annotations

import pathlib
import re

import nbclient
import nbformat
import pytest
import torch
from conftest import eager_step
from zoo import ZOO

import fleetc
from fleetc.passes.order import ordered_passes
from fleetc.strategy import resolve_conflicts, resolve_strategy

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _passes(strategy) -> list[str]:
    return ["capture", *(p.name for p in ordered_passes(resolve_conflicts(resolve_strategy(strategy))[0]))]


def _merge_every_2_steps() -> fleetc.DistributedStrategy:
    merge = fleetc.DistributedStrategy()
    merge.gradient_merge = True
    merge.gradient_merge_configs = {"k_steps": 2, "avg": True}
    return merge


@pytest.fixture(scope="module")
def cells() -> dict[str, dict]:
    notebook = nbformat.read(EXAMPLES / "inspect_passes.ipynb", as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()
    return {cell.metadata["tags"][0]: cell for cell in notebook.cells if cell.metadata.get("tags")}


def _stdout(cell: dict) -> str:
    assert not [o for o in cell.outputs if o.output_type == "error"]
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def _html(cell: dict) -> str:
    return next(o.data["text/html"] for o in cell.outputs if o.output_type == "execute_result")


@pytest.mark.slow
def test_each_strategy_runs_its_passes_and_agrees_on_the_loss(cells) -> None:
    fusion = fleetc.DistributedStrategy()
    fusion.build_strategy.fuse_bn_act_ops = True
    fusion.build_strategy.fuse_elewise_add_act_ops = True
    expected = {"default": _passes(None), "fusion": _passes(fusion), "gradient merge": _passes(_merge_every_2_steps()),
                "no view cleanup": _passes(None)}
    runs = re.findall(r"^(.+): loss=([\d.]+) ops=(\d+)->(\d+) passes=(\S+)$", _stdout(cells["strategies"]), re.M)
    assert [label for label, *_ in runs] == list(expected)
    losses = {label: float(loss) for label, loss, *_ in runs}  # the 3rd step's loss, after two updates
    assert losses["default"] == pytest.approx(_eager_third_loss(), abs=1e-6)
    assert losses["fusion"] == losses["no view cleanup"] == losses["default"]  # exact rewrites, printed to 1e-6
    assert losses["gradient merge"] != losses["default"]  # one merged update in two steps, not two updates
    for label, _, ops_before, ops_after, passes in runs:
        assert passes.split(",") == expected[label]
    final_ops = {label: int(ops_after) for label, _, _, ops_after, _ in runs}
    assert final_ops["default"] < int(runs[0][2])
    assert final_ops["no view cleanup"] > final_ops["default"]  # the disabled pass's views are still there
    report = _stdout(cells["report"])
    assert report.startswith("fleetc compile report: ")
    applied = next(line for line in report.splitlines() if line.startswith("applied: "))
    assert "fuse_bn_act" in applied.split(": ", 1)[1].split(", ")  # the CNN's bn+relu pairs were fused


def _eager_third_loss() -> float:
    """What the notebook's compile_zoo("cnn") computes, eagerly: the loss of the 3rd AdamW step."""
    entry = ZOO["cnn"]
    torch.manual_seed(0)
    model = entry.make_model()
    g = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = [eager_step(model, optimizer, entry.loss_fn, *entry.make_batch(g)) for _ in range(3)]
    return float(losses[-1])


@pytest.mark.slow
def test_history_walk_record_and_diff_show_the_same_passes(cells) -> None:
    walk = re.findall(r"^(\d+) (\w+) (changed|unchanged) ops=(\d+) peak=(\d+) ", _stdout(cells["walk"]), re.M)
    names = [name for _, name, *_ in walk]
    assert names == _passes(None)
    record = _html(cells["record"])
    i = names.index("remove_noop_views")
    assert f"#{i} remove_noop_views" in record
    ops_before, ops_after = int(walk[i - 1][3]), int(walk[i][3])
    assert f"{ops_before} → {ops_after} (−{ops_before - ops_after})" in record
    removed = re.findall(r'class="op r-\w+ removed" data-op="[^"]+"><span class="idx">—</span>[^=]+= (aten\.\w+)',
                         record)
    assert len(removed) == ops_before - ops_after and set(removed) <= {
        "aten.detach", "aten.t", "aten.view", "aten.expand", "aten.clone", "aten.alias"}
    merge = _html(cells["sub-block"])
    assert f"#{_passes(_merge_every_2_steps()).index('gradient_merge')} gradient_merge" in merge
    assert merge.count('<details class="subblock" open><summary>block 1 (parent 0)') == 1
    sub_block = merge.split('<details class="subblock"', 1)[1]
    assert "= fleetc.adam(" in sub_block and re.search(r'class="op r-\w+ added"', merge)  # AdamW, every 2 steps
    history = _html(cells["history"])
    assert re.findall(r'<section class="record" id="pass-(\d+)"><h3>#\d+ (\w+) ', history) == \
        [(str(k), name) for k, name in enumerate(names)]
    diff = next(o for o in cells["diff"].outputs if o.output_type == "execute_result").data
    plain = diff["text/plain"]  # the str's repr: quoted with " when the diff holds ' (quoted string arguments)
    assert plain[0] in "'\"" and plain[1:].startswith(f"--- after capture\\n+++ after {names[-1]}\\n")
    assert '<span class="del">-  ' in diff["text/html"] and "aten.detach.default" in diff["text/html"]


@pytest.mark.slow
def test_graph_memory_and_program_views(cells) -> None:
    graph = _html(cells["graph"])
    boxes = re.findall(r'<g class="node" data-op="([^"]+)">', graph)
    assert len(boxes) > 10 and "convolution_backward" in graph and graph.count("<svg") == 1
    walk = re.findall(r"^\d+ \w+ \w+ ops=\d+ peak=(\d+) ", _stdout(cells["walk"]), re.M)
    peaks = dict(re.findall(r"^(.+): estimated_peak_bytes=(\d+) peak_op=\S+$", _stdout(cells["memory"]), re.M))
    assert list(peaks) == ["default", "fusion", "gradient merge", "no view cleanup"]
    assert peaks["default"] == walk[-1]  # memory_stats() agrees with the last record
    program = _html(cells["program"])
    assert re.search(r"<summary><b>blocks\.0\.conv1</b>", program) and "r-backward" in program
