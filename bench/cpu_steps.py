"""What the CPU step-time benches (bench/cpu_backend.py, bench/cpu_layout.py) share: their command-line options,
the eager and torch.compile step functions, and the interleaved timing.

Interleaving: per batch every variant runs one step, in an order that rotates by one per batch, so machine load
lands on all variants alike. Imported from the scripts' folder (on sys.path when a script runs), with tests/ on
PYTHONPATH for the zoo.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch
from torch import nn
from zoo import OPTIMIZERS, ZooEntry


def add_step_options(parser: argparse.ArgumentParser, models: str, steps: int, warmup: int) -> None:
    """The options both scripts take; `models`, `steps` and `warmup` are the script's defaults."""
    parser.add_argument("--models", default=models)
    parser.add_argument("--precision", default="fp32,bf16")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--stat", default="median", choices=["median", "min"])


def setup_line(opts: argparse.Namespace) -> str:
    """The first line both scripts print: versions, threads and how steps are timed."""
    return (f"torch {torch.__version__}, {torch.get_num_threads()} threads, optimizer {opts.optimizer}, "
            f"{opts.stat} of {opts.steps} interleaved steps after {opts.warmup} warmup")


def eager_step(model, optimizer, loss_fn, amp: bool, args, kwargs) -> torch.Tensor:
    """One eager training step; `amp` runs forward and loss under bf16 CPU autocast."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = loss_fn(model(*args[:-1], **kwargs), args[-1]) if loss_fn else model(*args, **kwargs)["loss"]
    loss.backward()
    optimizer.step()
    return loss.detach()


def baseline_runners(base: nn.Module, entry: ZooEntry, optimizer: str, amp: bool, with_torch_compile: bool,
                     ) -> tuple[dict[str, Callable], tuple]:
    """Step functions "eager" (and "torch.compile") on their own deep copies of `base`, and what holds eager's state
    across steps: (model, optimizer, {})."""
    model = copy.deepcopy(base)
    opt = OPTIMIZERS[optimizer](model.parameters())
    made: dict[str, Callable] = {"eager": lambda *a, **k: eager_step(model, opt, entry.loss_fn, amp, a, k)}
    if with_torch_compile:
        t_model = copy.deepcopy(base)
        t_opt = OPTIMIZERS[optimizer](t_model.parameters())
        compiled = torch.compile(t_model)
        made["torch.compile"] = lambda *a, **k: eager_step(compiled, t_opt, entry.loss_fn, amp, a, k)
    return made, (model, opt, {})


def interleaved_ms(made: dict[str, Callable], batches: list[tuple[tuple, dict]], stat: str) -> dict[str, float]:
    """ms per step of each variant over `batches`, interleaved; `stat` "median", or "min" for the fastest step."""
    times: dict[str, list[float]] = {name: [] for name in made}
    names = list(made)
    for i, (args, kwargs) in enumerate(batches):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            made[name](*args, **kwargs)
            times[name].append(time.perf_counter() - start)
    pick = statistics.median if stat == "median" else min
    return {k: 1e3 * pick(v) for k, v in times.items()}
