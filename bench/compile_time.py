"""Cold compile time per Hugging Face architecture (tests/models/factories.py): fleetc vs torch.compile.

    python bench/compile_time.py [--models gpt2,bert,...] [--torch-compile]

For each architecture, in one process after a warm-up compile of a small model (so torch's one-time imports and
dispatcher warm-up are not charged to the first architecture): `fleetc s` is `trainer.report().compile_seconds`
(capture + passes + code generation) of `fleetc.compile(...).step`, and `capture s` the part of it spent in capture
(the `capture` record of the pass history). `t.compile 1st s` is the wall time of the first forward + backward +
optimizer step of `torch.compile(model)` (a compiled forward, eager backward: what most users run), with a fresh
Inductor cache directory so nothing is reused from an earlier run. The load average is printed: on a shared machine
the figures scale with it.
"""
from __future__ import annotations

import argparse
import copy
import os
import pathlib
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))

from factories import ARCHITECTURES  # noqa: E402

import fleetc  # noqa: E402


def _fleetc_seconds(model, batch, loss_fn) -> tuple[float, float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = fleetc.compile(model, optimizer=optimizer, loss_fn=loss_fn)
    trainer.step(*batch[0], **batch[1])
    capture = next((r.seconds for r in trainer.history if r.name == "capture"), float("nan"))
    return trainer.report().compile_seconds, capture


def _torch_compile_seconds(model, batch, loss_fn) -> float:
    torch._dynamo.reset()
    compiled = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    args, kwargs = batch
    start = time.perf_counter()
    loss_fn(compiled(*args[:-1], **kwargs), args[-1]).backward()
    optimizer.step()
    return time.perf_counter() - start


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
    header = "| architecture | fleetc s | capture s |" + (" t.compile 1st s |" if options.torch_compile else "")
    print(header + "\n" + "|---" * header.count(" |") + "|")
    for name in names:
        case = ARCHITECTURES[name]()
        model, [batch] = case.build(1)
        total, capture = _fleetc_seconds(copy.deepcopy(model), batch, case.loss_fn)
        row = f"| {name} | {total:.2f} | {capture:.2f} |"
        if options.torch_compile:
            row += f" {_torch_compile_seconds(copy.deepcopy(model), batch, case.loss_fn):.1f} |"
        print(row, flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
