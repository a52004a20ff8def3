"""Compile progress: a tqdm bar over capture, each pass and codegen, only for slow compiles on a terminal."""
from __future__ import annotations

import io
import re
import sys
import time
import types

import torch
import torch.nn.functional as F
from zoo import MLP

import fleetc
import fleetc.passes.progress as progress
from fleetc.passes.order import ordered_passes
from fleetc.strategy import resolve_strategy


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _compile_mlp() -> fleetc.CompiledTrainer:
    torch.manual_seed(0)
    model = MLP()
    train = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy)
    train.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    return train


def test_a_slow_compile_shows_each_stage_then_done(monkeypatch) -> None:
    terminal = Terminal()
    monkeypatch.setattr(progress, "DEFAULT_DELAY", 0.0)
    monkeypatch.setattr("sys.stderr", terminal)
    _compile_mlp()
    text = terminal.getvalue()
    stages = ["capture", *(p.name for p in ordered_passes(resolve_strategy(None))), "codegen"]
    assert f"fleetc: compiling the train step: {len(stages)} stages done" in text
    assert text.rstrip().endswith("done") and text.endswith("\n")


def test_stages_are_recorded_and_shown_as_they_start() -> None:
    terminal = Terminal()
    with progress.CompileProgress("compiling", delay=0.0, file=terminal) as bar:
        progress.progress_stage("capture")
        progress.progress_stage("kernel generation")
    assert bar.stages == ["capture", "kernel generation"]
    assert re.search(r"compiling: 1 stages done \[00:0\d\], kernel generation", terminal.getvalue())
    progress.progress_stage("outside a compile")  # no bar open: nothing happens
    assert bar.stages == ["capture", "kernel generation"]


def test_a_fast_compile_prints_nothing() -> None:
    terminal = Terminal()
    with progress.CompileProgress("compiling", delay=2.0, file=terminal):
        progress.progress_stage("capture")
    assert terminal.getvalue() == ""


def test_no_bar_when_stderr_is_not_a_terminal(capsys) -> None:
    with progress.CompileProgress("compiling", delay=0.0) as bar:
        progress.progress_stage("capture")
    assert bar.stages == ["capture"] and capsys.readouterr().err == ""


def test_a_long_stage_shows_up_while_it_runs() -> None:
    terminal = Terminal()
    with progress.CompileProgress("compiling", delay=0.05, file=terminal):
        progress.progress_stage("capture")
        deadline = time.monotonic() + 5
        while "capture" not in terminal.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        shown_while_running = terminal.getvalue()
    assert re.search(r"compiling: 0 stages done \[00:0\d\], capture", shown_while_running)


def test_a_jupyter_kernel_gets_the_bar_though_its_stream_is_no_terminal(monkeypatch) -> None:
    kernel_shell = types.SimpleNamespace(config={"IPKernelApp": {}})
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: kernel_shell))
    assert progress.wanted(io.StringIO())
    terminal_shell = types.SimpleNamespace(config={})  # plain IPython in a terminal: ask the stream
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: terminal_shell))
    assert not progress.wanted(io.StringIO()) and progress.wanted(Terminal())
