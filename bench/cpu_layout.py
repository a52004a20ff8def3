"""CPU step time before and after the channels_last pass: fleetc with fusion on the CPU backend, without and with
`build_strategy.conv_channels_last`, next to eager (NCHW, as users run it) and torch.compile, interleaved.

Run from the repository root: `PYTHONPATH=$PWD:$PWD/tests OMP_NUM_THREADS=1 python bench/cpu_layout.py [--models
resnet,cnn] [--precision fp32,bf16] [--steps N] [--no-torch-compile]`. Models, batches, the AMP setup and the
interleaving (every variant one step per batch, in a rotating order) are bench/cpu_backend.py's; "fleetc+cpu" is its
column of that name (before), "fleetc+cpu+cl" the same strategy with the pass on (after).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch
from cpu_backend import MODELS, eager_step, fusion_strategy
from zoo import OPTIMIZERS, ZooEntry

import fleetc


def runners(entry: ZooEntry, optimizer: str, amp: bool,
            with_torch_compile: bool) -> tuple[dict[str, Callable], fleetc.CompiledTrainer]:
    torch.manual_seed(0)
    base = entry.make_model()
    made: dict[str, Callable] = {}
    model = copy.deepcopy(base)
    opt = OPTIMIZERS[optimizer](model.parameters())
    made["eager"] = lambda *a, **k: eager_step(model, opt, entry.loss_fn, amp, a, k)
    if with_torch_compile:
        t_model = copy.deepcopy(base)
        t_opt = OPTIMIZERS[optimizer](t_model.parameters())
        compiled = torch.compile(t_model)
        made["torch.compile"] = lambda *a, **k: eager_step(compiled, t_opt, entry.loss_fn, amp, a, k)
    for name, channels_last in (("fleetc+cpu", False), ("fleetc+cpu+cl", True)):
        f_model = copy.deepcopy(base)
        strategy = fusion_strategy(True, amp)
        strategy.build_strategy.conv_channels_last = channels_last
        trainer = fleetc.compile(f_model, strategy, optimizer=OPTIMIZERS[optimizer](f_model.parameters()),
                                 loss_fn=entry.loss_fn, cpu_kernels="sync")
        made[name] = trainer.step
    return made, trainer


def bench(entry: ZooEntry, optimizer: str, amp: bool, steps: int, warmup: int, with_torch_compile: bool,
          stat: str) -> dict[str, float]:
    made, with_pass = runners(entry, optimizer, amp, with_torch_compile)
    g = torch.Generator().manual_seed(1)
    batches = [entry.make_batch(g) for _ in range(warmup + steps)]
    for args, kwargs in batches[:warmup]:
        for run in made.values():
            run(*args, **kwargs)
    print(f"  {entry.name}: channels_last {with_pass.history['channels_last'].report.summary()}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in made}
    names = list(made)
    for i, (args, kwargs) in enumerate(batches[warmup:]):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            made[name](*args, **kwargs)
            times[name].append(time.perf_counter() - start)
    pick = statistics.median if stat == "median" else min
    return {k: 1e3 * pick(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet,cnn")
    parser.add_argument("--precision", default="fp32,bf16")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--stat", default="median", choices=["median", "min"])
    opts = parser.parse_args()
    with_tc = not opts.no_torch_compile
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, optimizer {opts.optimizer}, "
          f"{opts.stat} of {opts.steps} interleaved steps after {opts.warmup} warmup")
    header = ["model", "precision", "eager ms", "fleetc+cpu ms", "fleetc+cpu+cl ms", "cl/before", "cl/eager"]
    header += ["t.compile ms", "before/t.compile", "cl/t.compile"] if with_tc else []
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in opts.models.split(","):
        for precision in opts.precision.split(","):
            ms = bench(MODELS[name], opts.optimizer, precision == "bf16", opts.steps, max(1, opts.warmup), with_tc,
                       opts.stat)
            before, after = ms["fleetc+cpu"], ms["fleetc+cpu+cl"]
            row = [name, precision, f"{ms['eager']:.2f}", f"{before:.2f}", f"{after:.2f}", f"{after / before:.2f}x",
                   f"{after / ms['eager']:.2f}x"]
            if with_tc:
                tc = ms["torch.compile"]
                row += [f"{tc:.2f}", f"{before / tc:.2f}x", f"{after / tc:.2f}x"]
            rows.append("| " + " | ".join(row) + " |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
