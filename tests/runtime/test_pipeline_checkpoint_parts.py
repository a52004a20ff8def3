"""Loading a checkpoint written as pipeline parts (one file per pipeline rank), in one process: the parts merge back
into one model and optimizer state, a tied key is filled from its source, and damaged or misplaced parts are
CheckpointErrors naming the file, with nothing changed."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fleetc
from fleetc.runtime import checkpoint_commit
from fleetc.runtime.checkpoint import TrainerState, rng_state, write_checkpoint
from fleetc.runtime.pipeline_checkpoint import PART_FILE


class Tied(nn.Module):
    """An embedding and a head sharing one weight (what the zoo GPT's first and last stage both hold)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.relu(self.mid(self.emb(idx))))


def _trainer(seed: int):
    torch.manual_seed(seed)
    model = Tied()
    return model, fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy)


def _write(root, model: nn.Module, trainer, parts: list[dict], tied: dict[str, str]) -> None:
    staged = checkpoint_commit.begin(root)
    names = []
    for index, part in enumerate(parts):
        names.append(PART_FILE.format(index))
        staged.write(names[-1], {"optimizer": {}, "owned": {}, "merge": {"steps_merged": 0, "carried": {},
                                                                           "period_flags": []}, **part})
    write_checkpoint(staged, TrainerState(model, trainer.optimizer, {}), trainer.config, [rng_state()],
                     pipeline_parts={"files": names, "tied": tied, "model": {}, "optimizer_state": {}})


def _stages(model: nn.Module) -> list[dict]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return [{"model": {"emb.weight": state["emb.weight"]}},
            {"model": {"mid.weight": state["mid.weight"], "mid.bias": state["mid.bias"]}}]


def test_parts_merge_back_and_the_tied_key_loads_from_its_source(tmp_path):
    saved, trainer = _trainer(0)
    _write(tmp_path / "ckpt", saved, trainer, _stages(saved), {"head.weight": "emb.weight"})
    model, other = _trainer(1)
    other.load_checkpoint(str(tmp_path / "ckpt"))
    for (name, p), q in zip(model.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(p, q), name
    plain = Tied()
    plain.load_state_dict(fleetc.read_checkpoint(str(tmp_path / "ckpt"))["model"])
    assert plain.head.weight is plain.emb.weight and torch.equal(plain.emb.weight, saved.emb.weight)


@pytest.mark.parametrize("damage, message", [
    ("overlap", "'emb.weight' is also in .*pipeline.pp00000.pt"),
    ("tied source missing", "'head.weight' is tied to 'nowhere', which no file holds"),
    ("mid period", "saved between gradient-merge updates by a pipeline"),
    ("not a part", "expected a pipeline part"),
])
def test_damaged_or_misplaced_parts_are_refused_by_name(damage, message, tmp_path):
    saved, trainer = _trainer(0)
    parts, tied = _stages(saved), {"head.weight": "emb.weight"}
    if damage == "overlap":
        parts[1]["model"]["emb.weight"] = saved.emb.weight.detach().clone()
    elif damage == "tied source missing":
        tied = {"head.weight": "nowhere"}
    elif damage == "mid period":
        parts[0]["merge"] = {"steps_merged": 1, "carried": {0: {"emb.weight@GRAD": torch.ones(6, 4)}},
                             "period_flags": [0.1]}
    else:
        parts[1]["model"] = [1, 2]
    _write(tmp_path / "ckpt", saved, trainer, parts, tied)
    model, other = _trainer(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fleetc.CheckpointError, match=message):
        other.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
