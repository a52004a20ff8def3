"""Trainer checkpoints: everything restored (RNG included, so dropout continues the same stream), in versions."""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from checkpoint_helpers import assert_same, make_trainer, snapshot, train

import fleetc
from fleetc.runtime import checkpoint_commit


def test_a_resumed_run_continues_exactly_where_it_stopped(tmp_path):
    uninterrupted = make_trainer(merge=2)
    expected = train(uninterrupted, range(5))

    first = make_trainer(merge=2)
    losses = train(first, range(3))  # stops mid-accumulation, with dropout RNG state to carry over
    first.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(12345)  # the resumed process starts from other weights and another RNG state
    resumed = make_trainer(seed=7, merge=2)
    resumed.load_checkpoint(tmp_path / "ckpt")
    losses += train(resumed, range(3, 5))
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=0, atol=0)
    assert_same(resumed.model.state_dict(), uninterrupted.model.state_dict())


def test_each_save_is_a_new_version_behind_an_atomic_pointer(tmp_path):
    trainer = make_trainer()
    root = tmp_path / "ckpt"
    states = []
    for i in range(3):
        train(trainer, range(i, i + 1))
        states.append(snapshot(trainer))
        assert trainer.save_checkpoint(root) == str(root / f"v00000{i + 1}")
    assert sorted(os.listdir(root)) == ["LATEST", "v000002", "v000003"]  # the previous version is kept
    assert (root / "LATEST").read_text() == "v000003\n"
    fresh = make_trainer(seed=3)
    assert fresh.load_checkpoint(root) == str(root / "v000003")
    assert_same(snapshot(fresh)["model"], states[2]["model"])
    assert fresh.load_checkpoint(root / "v000002") == str(root / "v000002")  # a version directory loads too
    assert_same(snapshot(fresh)["model"], states[1]["model"])


def test_a_checkpoint_from_before_versioning_still_loads(tmp_path):
    trainer = make_trainer()
    train(trainer, range(2))
    for name, value in (("model.pt", trainer.model.state_dict()), ("optimizer.pt", trainer.optimizer.state_dict()),
                        ("fleetc.pt", trainer.state_dict())):
        torch.save(value, tmp_path / name)
    fresh = make_trainer(seed=3)
    fresh.load_checkpoint(tmp_path)
    assert_same(snapshot(fresh)["optimizer"], snapshot(trainer)["optimizer"])


class _Payload:
    """Unpickling it would create `marker`: what a malicious checkpoint does."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("versioned", [True, False])
def test_pickled_code_never_runs_even_with_torch_force_no_weights_only_load(tmp_path, monkeypatch, versioned):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # the common workaround that makes torch.load unsafe
    trainer = make_trainer()
    train(trainer, range(1))
    root = tmp_path / "ckpt"
    version = trainer.save_checkpoint(root)
    if not versioned:
        os.remove(os.path.join(version, checkpoint_commit.MANIFEST))
        os.remove(root / checkpoint_commit.POINTER)
    marker = tmp_path / "pwned"
    with open(os.path.join(version, "model.pt"), "wb") as handle:
        pickle.dump({"weight": _Payload(str(marker))}, handle)
    if versioned:  # a manifest that agrees, so it is torch.load itself that must refuse
        manifest_path = os.path.join(version, checkpoint_commit.MANIFEST)
        with open(manifest_path) as handle:
            manifest = json.load(handle)
        manifest["files"]["model.pt"] = checkpoint_commit._digest(os.path.join(version, "model.pt"))
        with open(manifest_path, "w") as handle:
            json.dump(manifest, handle)
    before = snapshot(trainer)
    with pytest.raises(fleetc.CheckpointError, match="model.pt: not a loadable torch file.*weights_only=True"):
        trainer.load_checkpoint(version if not versioned else root)
    assert not marker.exists()
    assert_same(snapshot(trainer), before)


def test_state_dict_of_another_strategy_is_refused_before_anything_changes():
    merged = make_trainer(merge=4)
    train(merged, range(2))
    plain = make_trainer()
    train(plain, range(1))
    before = snapshot(plain)
    with pytest.raises(fleetc.CheckpointError, match="gradient_merge"):
        plain.load_state_dict(merged.state_dict())
    assert_same(snapshot(plain), before)
