"""CPU step time before and after the channels_last pass: fleetc with fusion on the CPU backend, without and with
`build_strategy.conv_channels_last`, next to eager (NCHW, as users run it) and torch.compile, interleaved.

Run from the repository root: `PYTHONPATH=$PWD:$PWD/tests OMP_NUM_THREADS=1 python bench/cpu_layout.py [--models
resnet,cnn] [--precision fp32,bf16] [--steps N] [--no-torch-compile]`. Models, batches and the AMP setup are
bench/cpu_backend.py's, the options and the interleaving (every variant one step per batch, in a rotating order)
bench/cpu_steps.py's; "fleetc+cpu" is cpu_backend.py's column of that name (before), "fleetc+cpu+cl" the same
strategy with the pass on (after).
"""
from __future__ import annotations

import argparse
import copy
from typing import Callable

import torch
from cpu_backend import MODELS, fusion_strategy
from cpu_steps import add_step_options, baseline_runners, interleaved_ms, setup_line
from zoo import OPTIMIZERS, ZooEntry

import fleetc


def runners(entry: ZooEntry, optimizer: str, amp: bool,
            with_torch_compile: bool) -> tuple[dict[str, Callable], fleetc.CompiledTrainer]:
    torch.manual_seed(0)
    base = entry.make_model()
    made, _ = baseline_runners(base, entry, optimizer, amp, with_torch_compile)
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
    return interleaved_ms(made, batches[warmup:], stat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_options(parser, models="resnet,cnn", steps=10, warmup=2)
    opts = parser.parse_args()
    with_tc = not opts.no_torch_compile
    print(setup_line(opts))
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
