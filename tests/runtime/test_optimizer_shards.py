"""Joining optimizer shard files (runtime/optimizer_shards.py) and checking that a checkpoint's optimizer state is
over this optimizer's parameters: misfits are CheckpointErrors naming the file, the parameter and the key, where
torch would fail with a bare RuntimeError or load the state into the wrong parameters."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fleetc
from fleetc.errors import CheckpointError
from fleetc.runtime.optimizer_shards import merge_optimizer_shards

SHAPES = {0: (3, 5), 1: (7,)}


def _describe(index: int) -> str:
    return f"parameter {index} ('p{index}')"


def _state(index: int) -> dict:
    g = torch.Generator().manual_seed(index)
    return {"step": torch.tensor(3.0), "exp_avg": torch.randn(SHAPES[index], generator=g),
            "exp_avg_sq": torch.rand(SHAPES[index], generator=g)}


def _pieces(index: int, cuts: list[int]) -> list[dict]:
    """The flattened state of a parameter cut at `cuts`, as the ranks holding each piece save it."""
    whole = _state(index)
    return [{k: v.reshape(-1)[lo:hi].clone() if v.dim() else v for k, v in whole.items()}
            for lo, hi in itertools.pairwise(cuts)]


def _merge(files: list, wanted: set[int] | None = None) -> tuple[dict, dict]:
    state: dict = {}
    origin = merge_optimizer_shards(state, files, lambda i: SHAPES[i], _describe, wanted)
    return state, origin


def test_pieces_from_several_files_join_into_the_whole_state():
    a, b, c = _pieces(0, [0, 4, 11, 15])
    state, origin = _merge([("f0", {0: a, 1: _state(1)}, [[0, 0, 4]]), ("f1", {0: b}, [[0, 4, 11]]),
                            ("f2", {0: c}, [[0, 11, 15]])])
    for index in SHAPES:
        for key, value in _state(index).items():
            torch.testing.assert_close(state[index][key], value, rtol=0, atol=0)
    assert origin == {0: "f0", 1: "f0"}


@pytest.mark.parametrize("files, message", [  # (file, its pieces [index, lo, hi], the indices it holds whole)
    ([("f0", [[0, 0, 8]], []), ("f1", [[0, 6, 15]], [])],
     "f1: holds elements [6, 15) of the optimizer state of parameter 0 ('p0'), and overlaps elements [6, 8)"),
    ([("f0", [[0, 0, 8]], []), ("f1", [[0, 9, 15]], [])],
     "f1: holds elements [9, 15) of the optimizer state of parameter 0 ('p0'), and elements [8, 9) are in no file"),
    ([("f0", [[0, 0, 8]], [])],
     "f0: the optimizer shards hold elements [0, 8) of the state of parameter 0 ('p0'), which has 15"),
    ([("f0", [[1, 0, 9]], [])],
     "f0: holds elements [0, 9) of the optimizer state of parameter 1 ('p1'), which has 7 elements"),
    ([("f0", [[1, 4, 2]], [])],
     "f0: the manifest gives it the piece [1, 4, 2]"),
    ([("f0", [], [1]), ("f1", [], [1])],
     "f1: holds the optimizer state of parameter 1 ('p1'), which f0 holds too"),
    ([("f0", [[1, 0, 3]], []), ("f1", [], [1])],
     "f1: holds the optimizer state of parameter 1 ('p1'), which f0 holds too"),
])
def test_pieces_that_do_not_fit_name_the_file_and_the_parameter(files, message):
    shards = [(where, {**{index: {"exp_avg": torch.zeros(max(hi - lo, 1))} for index, lo, hi in pieces},
                       **{index: _state(index) for index in whole}}, pieces) for where, pieces, whole in files]
    with pytest.raises(CheckpointError) as caught:
        _merge(shards)
    assert message in str(caught.value)


def test_a_piece_with_the_wrong_number_of_values_names_its_key():
    with pytest.raises(CheckpointError, match=r"f0: parameter 0 \('p0'\): state 'exp_avg' holds 5 values for the "
                                              r"4 elements \[0, 4\)"):
        _merge([("f0", {0: {"exp_avg": torch.zeros(5)}}, [[0, 0, 4]])])


def test_a_rank_reading_only_some_files_joins_only_what_it_wants():
    a, _ = _pieces(0, [0, 4, 15])
    state, _ = _merge([("f0", {0: a, 1: _state(1)}, [[0, 0, 4]])], wanted={1})  # f1 (the rest of 0) skipped
    torch.testing.assert_close(state[1]["exp_avg"], _state(1)["exp_avg"], rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="in no file"):
        _merge([("f0", {0: a, 1: _state(1)}, [[0, 0, 4]])], wanted={0, 1})


def _trainer(layers: tuple[int, ...] = (0, 2)) -> fleetc.CompiledTrainer:
    """Adam over the parameters of `layers`, in that order, of a model whose two layers have the same shapes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    params = [p for layer in layers for p in model[layer].parameters()]
    return fleetc.compile(model, optimizer=torch.optim.Adam(params, lr=0.1), loss_fn=F.mse_loss)


def test_optimizer_state_over_another_parameter_order_is_refused_by_name(tmp_path):
    """torch matches optimizer state to parameters by position: the same shapes in another order would load each
    layer's moments into the other layer. The manifest's parameter names catch it."""
    trainer = _trainer()
    trainer.step(torch.randn(8, 4), torch.randn(8, 4))
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    same = _trainer()
    same.load_checkpoint(str(tmp_path / "ckpt"))  # the same order loads
    torch.testing.assert_close(same.optimizer.state_dict()["state"][2]["exp_avg"],
                               trainer.optimizer.state_dict()["state"][2]["exp_avg"], rtol=0, atol=0)
    swapped = _trainer((2, 0))
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: its optimizer state numbers '0\.weight' as parameter "
                                              r"0, this optimizer numbers '2\.weight' so"):
        swapped.load_checkpoint(str(tmp_path / "ckpt"))
    fewer = _trainer((0,))
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: its optimizer state is over 4 parameters, this "
                                              r"optimizer has 2"):
        fewer.load_checkpoint(str(tmp_path / "ckpt"))
