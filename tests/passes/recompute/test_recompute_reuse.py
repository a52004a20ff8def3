"""Recompute "auto" planned once per distinct piece of the repeated blocks (fleetc/passes/recompute/pieces.py): the
plan equals the whole network's minimum cut, the Program prints identically with reuse on and off and trains like
eager, a block whose piece differs is solved on its own, and the report says how many blocks reused."""
from __future__ import annotations

import re

import networkx as nx
import pytest
import torch
from conftest import run_side_by_side
from helpers.scaling import all_passes_strategy, encoder_and_batch
from zoo import ZOO, TinyGPT, _gpt_batch, _lm_loss

import fleetc
from fleetc.capture import capture_train_program
from fleetc.ir.block_copies import REUSE_ENV
from fleetc.passes.recompute import Choice, RecomputePolicy, pieces
from fleetc.passes.recompute.auto import min_cut_plan
from fleetc.passes.recompute.plan import forward_region


def _auto() -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": "auto"}
    return strategy


def _captured(name: str):
    if name == "encoder_6_layers":
        model, optimizer, batch = encoder_and_batch(6)
        return capture_train_program(model, None, optimizer, batch, {})
    if name == "gpt_4_layers":
        torch.manual_seed(0)
        model = TinyGPT(layers=4)
        args, _ = _gpt_batch(torch.Generator().manual_seed(0))
        return capture_train_program(model, _lm_loss, torch.optim.AdamW(model.parameters()), args, {})
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.make_model()
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(0))
    return capture_train_program(model, entry.loss_fn, torch.optim.AdamW(model.parameters()), args, kwargs)


def _plans(program, monkeypatch, policy=None):
    region = forward_region(program, policy or RecomputePolicy())
    plans = {}
    for reuse in ("0", "recompute"):
        monkeypatch.setenv(REUSE_ENV, reuse)
        plans[reuse] = min_cut_plan(region)
    return plans["recompute"], plans["0"]


def _reused(lines: list[str]) -> list[tuple[int, int]]:
    return [tuple(map(int, re.match(r"(\d+) of (\d+) blocks", line).groups())) for line in lines]


@pytest.mark.parametrize("name", ["encoder_6_layers", "gpt_4_layers", *ZOO])
def test_pieces_give_the_whole_networks_cut(name, monkeypatch):
    by_pieces, whole = _plans(_captured(name), monkeypatch)
    assert by_pieces.saved == whole.saved
    assert by_pieces.notes == whole.notes  # the same saved bytes: the sum of the pieces' cuts
    assert not whole.reused_blocks
    if name in ("encoder_6_layers", "gpt_4_layers"):
        counts = _reused(by_pieces.reused_blocks)
        assert counts and counts[0][0] >= 2, by_pieces.reused_blocks


class _SaveOneMore(RecomputePolicy):
    """The default policy, but one elementwise op of one block must be saved: that block's pieces differ."""

    def __init__(self, op_name: str):
        self.op_name = op_name

    def choose(self, program, block, op, written_state):
        return Choice.MUST_SAVE if op.name == self.op_name else super().choose(program, block, op, written_state)


def test_a_block_whose_piece_differs_is_solved_on_its_own(monkeypatch):
    program = _captured("gpt_4_layers")
    baseline, _ = _plans(program, monkeypatch)
    target = next(op for op in program.global_block.ops if op.module_path.startswith("layers.2")
                  and op.type == "aten.gelu.default")
    by_pieces, whole = _plans(program, monkeypatch, _SaveOneMore(target.name))
    assert by_pieces.saved == whole.saved and by_pieces.notes == whole.notes
    assert target.outputs[0] in whole.saved and target.outputs[0] not in baseline.saved  # the plan did change
    assert _reused(by_pieces.reused_blocks)[0][0] < _reused(baseline.reused_blocks)[0][0]


def test_each_distinct_piece_is_solved_once(monkeypatch):
    """Solves of networkx's min-cut do not grow with the number of identical blocks."""
    calls, solve = {}, pieces._solve
    for depth in (4, 8):
        model, optimizer, batch = encoder_and_batch(depth)
        region = forward_region(capture_train_program(model, None, optimizer, batch, {}), RecomputePolicy())
        monkeypatch.setenv(REUSE_ENV, "recompute")
        solved = []

        def counted(graph, piece, solved=solved):
            solved.append(piece)
            return solve(graph, piece)

        with monkeypatch.context() as patch:
            patch.setattr(pieces, "_solve", counted)
            min_cut_plan(region)
        calls[depth] = len(solved)
    assert calls[8] == calls[4], calls


@pytest.mark.parametrize("zoo_name", ["gpt", "cnn"])
def test_auto_by_pieces_matches_eager_and_the_whole_cut_bit_for_bit(zoo_name, monkeypatch):
    monkeypatch.setenv(REUSE_ENV, "recompute")
    reused = run_side_by_side(zoo_name, "adamw", steps=3, strategy=_auto())
    reused.assert_same()
    monkeypatch.setenv(REUSE_ENV, "0")
    whole = run_side_by_side(zoo_name, "adamw", steps=3, strategy=_auto())
    reused.assert_compiled_identical(whole)
    assert str(reused.trainer.program) == str(whole.trainer.program)
    lines = [line for line in reused.trainer.report().repeated_blocks if line.startswith("recompute: ")]
    assert lines and not [line for line in whole.trainer.report().repeated_blocks if line.startswith("recompute: ")]


@pytest.mark.parametrize("seed", range(40))
def test_the_pieces_cuts_combine_into_the_whole_networks_cut_on_random_networks(seed):
    """The decomposition itself (pieces.py's docstring), on random networks shaped like auto.py's: value nodes
    `v_in → v_out` with capacities (equal ones too, so minimum cuts tie), unbounded edges between values in forward
    order, random ties to source and sink. networkx's cut of the whole network is the union of the pieces' cuts."""
    g = torch.Generator().manual_seed(seed)
    randint = lambda n: int(torch.randint(0, n, (1,), generator=g))
    graph = nx.DiGraph()
    graph.add_nodes_from((pieces.SOURCE, pieces.SINK))
    for v in range(30):
        graph.add_edge(f"{v}_in", f"{v}_out", capacity=randint(4))
        for u in {randint(v) for _ in range(randint(3))} if v else ():
            graph.add_edge(f"{u}_out", f"{v}_in")
        if randint(4) == 0:
            graph.add_edge(pieces.SOURCE, f"{v}_in")
        if randint(3) == 0:
            graph.add_edge(f"{v}_out", pieces.SINK)
    whole, (reachable, _) = nx.minimum_cut(graph, pieces.SOURCE, pieces.SINK)
    parts = [pieces._solve(graph, piece) for piece in pieces._pieces(graph)]
    assert len(parts) > 1
    assert sum(capacity for capacity, _ in parts) == whole
    assert set().union(*(side for _, side in parts)) == reachable - {pieces.SOURCE}


@pytest.mark.slow
def test_checkpoints_with_every_reuse_build_the_same_program(monkeypatch):
    """Checkpoint plans are not made per block (docs/ir.md says why); with every other reuse on (fusion answers, AMP's
    dtype memo) around them, the Program still prints as without reuse."""
    strategy = all_passes_strategy()
    strategy.amp = True
    strategy.recompute_configs = {"checkpoints": [f"layers.{i}" for i in range(4)]}
    programs = {}
    for reuse in ("1", "0"):
        monkeypatch.setenv(REUSE_ENV, reuse)
        torch.manual_seed(0)
        model = TinyGPT(layers=4)
        trainer = fleetc.compile(model, strategy, optimizer=torch.optim.AdamW(model.parameters()), loss_fn=_lm_loss)
        trainer.step(*_gpt_batch(torch.Generator().manual_seed(0))[0])
        programs[reuse] = str(trainer.program)
        assert trainer.history["recompute"].report.stats["checkpoints"] == 4
    assert programs["1"] == programs["0"]
