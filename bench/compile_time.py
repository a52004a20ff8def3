"""Cold compile time per Hugging Face architecture (tests/models/factories.py): fleetc vs torch.compile.

    PYTHONPATH=. python bench/compile_time.py [--models gpt2,bert,...] [--torch-compile]

For each architecture, in one process after a warm-up compile of a small model (so torch's one-time imports and
dispatcher warm-up are not charged to the first architecture):
- `fleetc s` is `trainer.report().compile_seconds` (capture + passes + code generation, wall time) of
  `fleetc.compile(...).step`;
- `fleetc cpu s` is the process's CPU time for the same compile. On a shared machine wall time grows with the load
  (waiting for a core) and CPU time hardly does, so `cpu s` is close to what the compile takes on an idle machine;
- `capture cpu s` is the CPU time of capture (`capture_train_program`) within it;
- `t.compile 1st s` / `t.compile cpu s` (with `--torch-compile`): the first forward + backward + optimizer step of
  `torch.compile(model)` (a compiled forward, eager backward: what most users run), with a fresh Inductor cache
  directory so nothing is reused from an earlier run; its CPU time includes Inductor's compile workers and compiler
  processes (children's CPU time).
The load average is printed: on a shared machine the wall figures scale with it.
"""
from __future__ import annotations

import argparse
import copy
import os
import pathlib
import resource
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))

from factories import ARCHITECTURES  # noqa: E402

import fleetc  # noqa: E402
import fleetc.compiler  # noqa: E402

_cpu = {"compile": 0.0, "capture": 0.0}  # CPU seconds spent in each since the last reset


def _cpu_timed(key, function):
    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            _cpu[key] += time.process_time() - start
    return timed


fleetc.compiler.capture_train_program = _cpu_timed("capture", fleetc.compiler.capture_train_program)
fleetc.compiler.CompiledTrainer._compile = _cpu_timed("compile", fleetc.compiler.CompiledTrainer._compile)


def _cpu_with_children() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _fleetc_seconds(model, batch, loss_fn) -> tuple[float, float, float]:
    """(compile wall s, compile CPU s, capture CPU s) of the first step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = fleetc.compile(model, optimizer=optimizer, loss_fn=loss_fn)
    _cpu.update(compile=0.0, capture=0.0)
    trainer.step(*batch[0], **batch[1])
    return trainer.report().compile_seconds, _cpu["compile"], _cpu["capture"]


def _torch_compile_seconds(model, batch, loss_fn) -> tuple[float, float]:
    """(wall s, CPU s with children) of torch.compile's first step."""
    torch._dynamo.reset()
    compiled = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    args, kwargs = batch
    start, cpu = time.perf_counter(), _cpu_with_children()
    loss_fn(compiled(*args[:-1], **kwargs), args[-1]).backward()
    optimizer.step()
    return time.perf_counter() - start, _cpu_with_children() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated architectures (default: all)")
    parser.add_argument("--torch-compile", action="store_true", help="also time torch.compile's first step")
    options = parser.parse_args()
    names = options.models.split(",") if options.models else list(ARCHITECTURES)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_cold_")
    warm = torch.nn.Linear(4, 2)
    _fleetc_seconds(warm, (((torch.randn(2, 4)), torch.randint(0, 2, (2,))), {}), F.cross_entropy)
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    header = "| architecture | fleetc s | fleetc cpu s | capture cpu s |"
    if options.torch_compile:
        header += " t.compile 1st s | t.compile cpu s |"
    print(header + "\n" + "|---" * header.count(" |") + "|")
    for name in names:
        case = ARCHITECTURES[name]()
        model, [batch] = case.build(1)
        total, cpu, capture = _fleetc_seconds(copy.deepcopy(model), batch, case.loss_fn)
        row = f"| {name} | {total:.2f} | {cpu:.2f} | {capture:.2f} |"
        if options.torch_compile:
            wall, cpu = _torch_compile_seconds(copy.deepcopy(model), batch, case.loss_fn)
            row += f" {wall:.1f} | {cpu:.1f} |"
        print(row, flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
