"""The checkpoint fault-injection suite: a writer killed at every step of a save, every file corrupted or
truncated, loads into mismatched trainers. After each, the last good checkpoint loads, and the live trainer is
either fully restored or untouched."""
from __future__ import annotations

import os

import pytest
import torch
from checkpoint_helpers import assert_same, make_trainer, snapshot, train

import fleetc
from fleetc.runtime import checkpoint_commit
from fleetc.runtime.checkpoint import FILES

POINTS = checkpoint_commit.commit_points(FILES)
KILLED = 17


def _good_checkpoint(root) -> tuple[fleetc.CompiledTrainer, dict, dict]:
    """A gradient-merge trainer with one saved version (state `saved`), trained further since (state `live`)."""
    trainer = make_trainer(merge=2)
    train(trainer, range(3))
    trainer.save_checkpoint(root)
    saved = snapshot(trainer)
    train(trainer, range(3, 4))
    return trainer, saved, snapshot(trainer)


def _save_killed_at(trainer: fleetc.CompiledTrainer, root, point: str) -> int:
    """Save in a forked child that dies (os._exit, no cleanup) at `point`; its exit status."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 0
        try:
            def die(where: str) -> None:
                if where == point:
                    os._exit(KILLED)
            checkpoint_commit.fault_hook = die
            trainer.save_checkpoint(root)
        except BaseException:
            status = 1
        os._exit(status)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _loaded(root) -> dict:
    fresh = make_trainer(seed=5, merge=2)
    fresh.load_checkpoint(root)
    return snapshot(fresh)


def _same_training_state(actual: dict, expected: dict) -> None:
    for part in ("model", "optimizer", "owned"):
        assert_same(actual[part], expected[part], part)


@pytest.mark.parametrize("point", POINTS)
def test_a_writer_killed_at_any_point_leaves_a_complete_checkpoint(tmp_path, point):
    root = tmp_path / "ckpt"
    trainer, saved, live = _good_checkpoint(root)
    assert _save_killed_at(trainer, root, point) == KILLED, f"the save never reached {point!r}"
    published = POINTS.index(point) >= POINTS.index(f"swapped {checkpoint_commit.POINTER}")
    _same_training_state(_loaded(root), live if published else saved)
    # The next save cleans up what the killed one left behind, and is complete.
    trainer.save_checkpoint(root)
    left = sorted(os.listdir(root))
    assert not [name for name in left if name.startswith(".") or name.endswith(".tmp")], left
    assert len([name for name in left if name.startswith("v")]) <= checkpoint_commit.KEEP_VERSIONS
    _same_training_state(_loaded(root), live)


def _damage(path: str, how: str) -> None:
    data = open(path, "rb").read()
    with open(path, "wb") as handle:
        if how == "truncate":
            handle.write(data[: len(data) // 2])
        elif how == "flip":  # one bit, inside the data
            at = len(data) // 2
            handle.write(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])
        elif how == "garbage":
            handle.write(b"\x80\x03 not a checkpoint at all")
        # "empty": nothing


@pytest.mark.parametrize("how", ["truncate", "flip", "empty", "garbage"])
@pytest.mark.parametrize("name", [*FILES, checkpoint_commit.MANIFEST, checkpoint_commit.POINTER])
def test_a_damaged_file_is_named_and_the_previous_version_still_loads(tmp_path, name, how):
    root = tmp_path / "ckpt"
    trainer, first, _ = _good_checkpoint(root)
    trainer.save_checkpoint(root)  # v000002, the one to damage
    second = snapshot(trainer)
    damaged = root / (name if name == checkpoint_commit.POINTER else f"v000002/{name}")
    _damage(str(damaged), how)
    train(trainer, range(4, 5))
    before = snapshot(trainer)
    with pytest.raises(fleetc.CheckpointError, match=f"{name}"):
        trainer.load_checkpoint(root)
    assert_same(snapshot(trainer), before)  # untouched, RNG included
    _same_training_state(_loaded(root / "v000001"), first)
    assert second  # (v000002 was complete before the damage)


def _mismatches() -> dict:
    return {
        "a wider model": (dict(width=32), "model.pt", "shape"),
        "another kind of optimizer": (dict(optimizer="sgd"), "optimizer.pt", "holds Adam state"),
        "no gradient merge": (dict(merge=1), "fleetc.pt", "gradient_merge"),
        "another k_steps": (dict(merge=4), "fleetc.pt", "k_steps"),
    }


@pytest.mark.parametrize("case", list(_mismatches()))
def test_a_mismatched_trainer_is_left_untouched(tmp_path, case):
    options, file, words = _mismatches()[case]
    root = tmp_path / "ckpt"
    _good_checkpoint(root)
    other = make_trainer(seed=9, **options)
    train(other, range(2))
    before = snapshot(other)
    with pytest.raises(fleetc.CheckpointError, match=f"{file}.*{words}"):
        other.load_checkpoint(root)
    assert_same(snapshot(other), before)


def test_a_trainer_that_has_not_compiled_yet_is_checked_too(tmp_path):
    root = tmp_path / "ckpt"
    _good_checkpoint(root)
    fresh = make_trainer(seed=9, optimizer="sgd", merge=2)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(fleetc.CheckpointError, match="optimizer.pt: holds Adam state"):
        fresh.load_checkpoint(root)
    assert_same(fresh.model.state_dict(), before)
    assert fresh.counters == {} and fresh.optimizer.state_dict()["state"] == {}


def test_restoring_is_rolled_back_when_torch_refuses_part_of_it(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    trainer, _, live = _good_checkpoint(root)

    original, calls = trainer.optimizer.load_state_dict, []

    def refuse_once(state_dict):  # torch refuses the checkpoint's optimizer state, but not the rollback's
        calls.append(state_dict)
        if len(calls) == 1:
            raise RuntimeError("simulated failure after the model was restored")
        original(state_dict)
    monkeypatch.setattr(trainer.optimizer, "load_state_dict", refuse_once)
    with pytest.raises(fleetc.CheckpointError, match="the trainer is unchanged"):
        trainer.load_checkpoint(root)
    monkeypatch.undo()
    _same_training_state(snapshot(trainer), live)
    assert torch.equal(snapshot(trainer)["rng"], live["rng"])
