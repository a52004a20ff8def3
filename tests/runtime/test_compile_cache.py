"""The persistent compile cache (fleetc/compile_cache): hits train exactly like eager, every part of the key
misses when it changes, and bad entries or directories are ignored with a warning, never a crash."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import fleetc
from fleetc.compile_cache import CompileCacheWarning, fingerprint
from fleetc.compile_cache.deferred import CompileCacheError, DeferredProgram
from fleetc.compile_cache.store import STALE_LOCK_SECONDS, EntryStore
from fleetc.ir.printer import format_program
from fleetc.ir.program import Program
from fleetc.ir.serialize import program_to_json

ROOT = Path(__file__).resolve().parents[2]
SCALE = 1.0
SETTINGS = {"gain": 1.0}


def _tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


_activation = _tanh


class Net(nn.Module):
    """Reads a module attribute, global constants and a global helper: each is part of what the cache keys on."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.shift = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _activation(self.fc(x) * SCALE * SETTINGS["gain"] + self.shift).pow(2).mean()


def _other_forward(self, x: torch.Tensor) -> torch.Tensor:
    return _activation(self.fc(x) * SCALE * SETTINGS["gain"] - self.shift).pow(2).mean()


@pytest.fixture
def cache_dir(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    return tmp_path / "compile"


def _compile(model: nn.Module | None = None, strategy=None, x: torch.Tensor | None = None, lr: float = 0.1,
             mode: str = "capture", **options) -> fleetc.CompiledTrainer:
    torch.manual_seed(0)
    model = model if model is not None else Net()
    trainer = fleetc.compile(model, strategy, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                             compile_cache=mode, **options)
    trainer.step(x if x is not None else torch.ones(2, 8))
    return trainer


def _outcome(trainer: fleetc.CompiledTrainer) -> dict[str, str]:
    """{"capture": "hit"/"miss", "passes": ...} from the report's cache lines."""
    return {line.split(":")[0]: line.split(":")[1].split()[0].strip(",") for line in trainer.report().cache}


def test_hits_train_like_eager_and_print_the_same(cache_dir, zoo):
    from conftest import run_side_by_side

    for name in ("gpt", "cnn"):
        cold = run_side_by_side(name, "adamw", compile_cache="capture")
        warm = run_side_by_side(name, "adamw", compile_cache="capture")
        assert _outcome(cold.trainer) == {"capture": "miss", "passes": "miss"}
        assert _outcome(warm.trainer) == {"capture": "hit", "passes": "hit"}
        cold.assert_same()
        warm.assert_same()
        assert format_program(warm.trainer.program) == format_program(cold.trainer.program)
        assert [r.name for r in warm.trainer.history] == ["capture", "compile_cache"]
        assert warm.trainer.history[0].memory == cold.trainer.history[0].memory
        assert warm.trainer.history[-1].memory == cold.trainer.history[-1].memory
        assert warm.trainer.report().memory == cold.trainer.report().memory
        assert "compile cache: capture: hit" in str(warm.trainer.report())


class TwoHeads(nn.Module):
    """Returns a dict holding a tuple: the eval entry must restore that structure."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict:
        y = self.fc(x)
        return {"y": y, "parts": (y.relu(), y.sum())}


def test_an_eval_step_hits_with_its_output_structure(cache_dir):
    for _ in range(2):
        torch.manual_seed(0)
        model = TwoHeads()
        trainer = fleetc.compile(model, compile_cache="capture")
        out = trainer(torch.ones(2, 8))
        with torch.no_grad():
            torch.testing.assert_close(out, model(torch.ones(2, 8)))
    assert [line.split(" (")[0] for line in trainer._last_eval.report.cache] == ["capture: hit, capture skipped",
                                                                                "passes: hit, passes skipped"]


def test_passes_mode_captures_again_and_skips_the_passes(cache_dir):
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.fuse_elewise_add_act_ops = True
    cold, warm = _compile(strategy=strategy, mode="passes"), _compile(strategy=strategy, mode="passes")
    assert _outcome(cold) == {"passes": "miss"} and _outcome(warm) == {"passes": "hit"}
    assert warm.report().applied == cold.report().applied and warm.report().stats == cold.report().stats
    assert _compile(mode="off").report().cache == []


# Each change alters the captured Program (a different op or constant) or a version every key holds.
CHANGES = {
    "helper function": lambda mp: mp.setattr(sys.modules[__name__], "_activation", _sigmoid),
    "forward code": lambda mp: mp.setattr(Net, "forward", _other_forward),
    "global constant": lambda mp: mp.setattr(sys.modules[__name__], "SCALE", 2.0),
    "global dict": lambda mp: mp.setitem(SETTINGS, "gain", 3.0),
    "torch version": lambda mp: mp.setattr(torch, "__version__", torch.__version__ + "+other"),
    "fleetc source": lambda mp: mp.setattr(fingerprint, "fleetc_fingerprint", lambda: "edited"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_key_part_misses(cache_dir, monkeypatch, change):
    _compile()
    assert _outcome(_compile()) == {"capture": "hit", "passes": "hit"}  # unchanged: the control
    CHANGES[change](monkeypatch)
    assert _outcome(_compile()) == {"capture": "miss", "passes": "miss"}


def test_model_config_dtype_inputs_optimizer_and_strategy_miss(cache_dir):
    _compile()
    changed_shift = Net()
    changed_shift.shift = 0.25
    assert _outcome(_compile(changed_shift))["capture"] == "miss"
    assert _outcome(_compile(Net().double(), x=torch.ones(2, 8, dtype=torch.float64))) == {"capture": "miss",
                                                                                             "passes": "miss"}
    assert _outcome(_compile(x=torch.ones(3, 8))) == {"capture": "miss", "passes": "miss"}
    assert _outcome(_compile(lr=0.2))["capture"] == "miss"
    strategy = fleetc.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2}
    assert _outcome(_compile(strategy=strategy))["passes"] == "miss"
    assert _outcome(_compile(disable_passes=["dead_code_elimination"]))["passes"] == "miss"


def test_the_loss_modules_settings_are_in_the_key(cache_dir):
    def compiled(loss_fn: nn.Module) -> fleetc.CompiledTrainer:
        torch.manual_seed(0)
        model = nn.Linear(8, 3)
        trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn,
                                 compile_cache="capture")
        trainer.step(torch.ones(2, 8), torch.tensor([0, 2]))
        return trainer

    compiled(nn.CrossEntropyLoss())
    assert _outcome(compiled(nn.CrossEntropyLoss()))["capture"] == "hit"
    assert _outcome(compiled(nn.CrossEntropyLoss(label_smoothing=0.1))) == {"capture": "miss", "passes": "miss"}


def test_a_guard_the_key_does_not_cover_is_checked(cache_dir):
    _compile()
    frozen = Net()
    frozen.fc.bias.requires_grad_(False)
    trainer = _compile(frozen)
    assert "capture: miss: requires_grad guard on fc.bias changed" in trainer.report().cache[0]
    hooked = Net()
    hooked.register_forward_pre_hook(lambda module, args: None)
    assert _outcome(_compile(hooked))["capture"] == "miss"


def _entries(cache_dir: Path, kind: str) -> list[Path]:
    return sorted(cache_dir.glob(f"{kind}-*.json"))


@pytest.mark.parametrize("damage", ["truncated", "not json", "wrong version", "unknown tag", "program not text",
                                    "renamed"])
def test_a_damaged_entry_is_ignored_with_a_warning_and_replaced(cache_dir, damage):
    cold = _compile()
    (entry,) = _entries(cache_dir, "capture")
    text = entry.read_text()
    data = json.loads(text)
    if damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    elif damage == "not json":
        entry.write_bytes(b"\x80\x04 pickled?")
    elif damage == "wrong version":
        entry.write_text(json.dumps({**data, "fleetc_compile_cache": 0}))
    elif damage == "unknown tag":
        program = json.loads(data["payload"]["program_json"])
        program["metadata"] = {"x": {"$call": "os.system"}}
        data["payload"]["program_json"] = json.dumps(program)
        entry.write_text(json.dumps(data))
    elif damage == "program not text":
        data["payload"]["program_json"] = json.loads(data["payload"]["program_json"])
        entry.write_text(json.dumps(data))
    else:  # an entry under another key's name
        data["key"] = "0" * 64
        entry.write_text(json.dumps(data))
    with pytest.warns(CompileCacheWarning, match="ignoring"):
        again = _compile()
    assert _outcome(again)["capture"] == "miss"
    torch.testing.assert_close(again.step(torch.ones(2, 8)), cold.step(torch.ones(2, 8)))
    assert _outcome(_compile())["capture"] == "hit"  # the miss stored a good entry again


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_an_entry_owned_by_another_user_is_ignored(cache_dir):
    _compile()
    for entry in _entries(cache_dir, "capture"):
        os.chown(entry, 65534, 65534)
    with pytest.warns(CompileCacheWarning, match="owned by user id 65534"):
        assert _outcome(_compile())["capture"] == "miss"


def test_an_untrusted_directory_disables_the_cache(cache_dir):
    _compile()
    assert cache_dir.stat().st_mode & 0o777 == 0o700
    assert all(e.stat().st_mode & 0o777 == 0o600 for e in cache_dir.iterdir())
    cache_dir.chmod(0o777)
    with pytest.warns(CompileCacheWarning, match="writable by other users"):
        trainer = _compile()
    assert _outcome(trainer) == {"capture": "miss", "passes": "miss"}


def test_one_writer_per_key(tmp_path):
    store = EntryStore(tmp_path / "compile")
    lock = store.path("passes", "k").with_suffix(".lock")
    store.directory.mkdir(mode=0o700)
    lock.touch()
    assert not store.store("passes", "k", {"a": 1}) and store.load("passes", "k") is None
    old = time.time() - STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))  # its writer died: the lock is taken over
    assert store.store("passes", "k", {"a": 1}) and store.load("passes", "k") == {"a": 1}
    assert not lock.exists() and not list(store.directory.glob("*.tmp"))


WARM_START = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, "tests")
    import torch
    from helpers.scaling import all_passes_strategy, encoder_and_batch
    import fleetc
    model, optimizer, batch = encoder_and_batch(2)
    trainer = fleetc.compile(model, all_passes_strategy(), optimizer=optimizer, compile_cache="capture")
    losses = [float(trainer.step(*batch)) for _ in range(2)]
    print(json.dumps({"cache": trainer.report().cache, "losses": losses}))
""")


@pytest.mark.slow
def test_a_second_process_skips_capture_and_passes(tmp_path):
    env = {**os.environ, "FLEETC_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", WARM_START], cwd=ROOT, env=env, check=True,
                                      capture_output=True, text=True, timeout=600).stdout.splitlines()[-1])
            for _ in range(2)]
    assert [line.split(" (")[0] for line in runs[0]["cache"]] == ["capture: miss", "passes: miss"]
    assert [line.split(" (")[0] for line in runs[1]["cache"]] == ["capture: hit, capture skipped",
                                                                  "passes: hit, passes skipped"]
    assert runs[1]["losses"] == runs[0]["losses"]


def test_a_full_hit_decodes_the_captured_program_only_when_used(cache_dir):
    cold, warm = _compile(), _compile()
    captured = warm.history[0].program
    assert isinstance(captured, DeferredProgram) and captured._full is None  # the hit read its metadata only
    assert captured.num_ops() == cold.history[0].program.num_ops()
    assert captured.metadata == cold.history[0].program.metadata
    assert format_program(captured) == format_program(cold.history[0].program)  # decoded on first use
    assert captured == cold.history[0].program and type(captured.clone()) is Program


@pytest.mark.parametrize("damage", ["garbled bytes", "unknown tag", "op count"])
def test_a_capture_whose_ops_do_not_decode_is_captured_again_with_a_warning(cache_dir, monkeypatch, damage):
    cold = _compile(verify=True)
    (entry,) = _entries(cache_dir, "capture")
    data = json.loads(entry.read_text())
    text = good = data["payload"]["program_json"]
    body = text.index('"blocks"') + 40
    if damage == "garbled bytes":  # the entry and the Program's header still parse; its blocks do not
        text = text[:body] + "#\t@@ junk ]]" + text[body + 12:]
    elif damage == "unknown tag":
        program = json.loads(text)
        program["blocks"][0]["ops"][0]["args"] = [{"$call": "os.system"}]
        text = json.dumps(program)
    else:  # the text is intact, so the passes would hit; verify=True decodes the captured Program first
        data["payload"]["ops"] += 1
    data["payload"]["program_json"] = text
    entry.write_text(json.dumps(data))
    ran = []
    monkeypatch.setattr(os, "system", lambda *a: ran.append(a))  # nothing read from the entry may run
    # The header decodes, so the hit stands until its ops are needed (by the passes, a miss since their key hashes
    # the damaged text, or by verify=True); then the compile warns, naming the file, captures again and stores a
    # good entry in its place.
    reason = "is inconsistent" if damage == "op count" else "does not decode"
    with pytest.warns(CompileCacheWarning, match=f"ignoring entry {entry}, which {reason}"):
        again = _compile(verify=True)
    assert not ran
    assert _outcome(again) == {"capture": "miss", "passes": "hit"}  # the fresh capture is the stored one again
    assert "captured again" in again.report().cache[0] and "stored" in again.report().cache[0]
    assert type(again.history[0].program) is Program
    torch.testing.assert_close(again.step(torch.ones(2, 8)), cold.step(torch.ones(2, 8)))
    assert json.loads(entry.read_text())["payload"] == json.loads(
        json.dumps({**data["payload"], "program_json": good, "ops": cold.history[0].program.num_ops()}))
    warm = _compile()
    assert _outcome(warm) == {"capture": "hit", "passes": "hit"}
    assert format_program(warm.history[0].program) == format_program(cold.history[0].program)


@pytest.mark.parametrize("damage", ["garbled bytes", "unknown tag", "op count"])
def test_a_full_hit_whose_ops_are_damaged_is_captured_again_when_first_used(cache_dir, monkeypatch, damage):
    cold = _compile()
    (entry,) = _entries(cache_dir, "capture")
    if damage == "op count":  # the text is intact, so the passes hit and the compile never decodes the ops
        data = json.loads(entry.read_text())
        data["payload"]["ops"] += 1
        entry.write_text(json.dumps(data))
    warm = _compile()
    assert _outcome(warm) == {"capture": "hit", "passes": "hit"}
    captured = warm.history[0].program
    assert isinstance(captured, DeferredProgram) and captured._full is None
    text = captured._text
    body = text.index('"blocks"') + 40
    if damage == "garbled bytes":  # the body the hit holds, damaged after the compile (its passes key is spent)
        captured._text = text[:body] + "#\t@@ junk ]]" + text[body + 12:]
    elif damage == "unknown tag":
        program = json.loads(text)
        program["blocks"][0]["ops"][0]["args"] = [{"$call": "os.system"}]
        captured._text = json.dumps(program)
    ran = []
    monkeypatch.setattr(os, "system", lambda *a: ran.append(a))  # nothing read from the entry may run
    reason = "is inconsistent" if damage == "op count" else "does not decode"
    with pytest.warns(CompileCacheWarning, match=f"ignoring entry {entry}, which {reason}.*captured again"):
        printed = format_program(captured)
    assert not ran
    assert printed == format_program(cold.history[0].program)
    assert captured.num_ops() == cold.history[0].program.num_ops() and captured == cold.history[0].program
    assert not entry.exists()  # the next compile captures again and stores a good entry
    torch.testing.assert_close(warm.step(torch.ones(2, 8)), cold.step(torch.ones(2, 8)))
    again = _compile()
    assert _outcome(again)["capture"] == "miss" and "stored" in again.report().cache[0]
    assert json.loads(entry.read_text())["payload"]["ops"] == cold.history[0].program.num_ops()


def test_a_deferred_program_without_rebuild_raises_naming_the_entry():
    program = Program()
    text = program_to_json(program)
    with pytest.raises(CompileCacheError, match="entry.json is inconsistent"):
        DeferredProgram(text, program.num_ops() + 1, "entry.json").decoded()


@pytest.mark.parametrize("text", ["[1]", '{"fleetc_program": 2, "metadata": {}}',
                                  '{"fleetc_program": 1, "metadata": {}, "blocks": []}',
                                  '{"fleetc_program": 2 "metadata": {}}'])
def test_program_header_refuses_text_not_laid_out_as_written(text):
    with pytest.raises(ValueError, match="Program text|format version"):
        DeferredProgram(text, 0, "entry")
