"""CPU step time: eager, torch.compile, fleetc without fusion and fleetc with fusion on the C++ CPU backend, interleaved.

Run from the repository root: `PYTHONPATH=$PWD:$PWD/tests python bench/cpu_backend.py [--models ...] [--precision
fp32,bf16] [--steps N] [--no-torch-compile]`. Every variant trains its own deep copy of one initialised model on the
same batches; per batch every variant runs one step, in a rotating order, so machine noise lands on all alike; the
median step is reported (`--stat min`: the fastest step, for a machine so oversubscribed that a small model's
steps are preempted more often than not).

fleetc+cpu runs the default `cpu_kernels="background"` mode, so what is timed is what a user gets: ops whose
kernel measured slower than their reference run the reference (fleetc/codegen/cpu/choice.py); "kernels kept"
counts the ops that kept their kernel. Each model and precision starts from an empty fleetc cache (a fresh
$FLEETC_CACHE_DIR): "first step s" is fleetc+cpu's cold first step in background mode (capture, passes, starting
the builds, and the step on the references), "kernels ready s" when its last kernel build finished (from the start
of that step), "sync first step s" the same cold first step in the "sync" mode, which waits for every build.
"peak MB" is each variant's held tensors (parameters, buffers, optimizer state, including fleetc's own, and the
batch) plus one step's allocation peak above them, from torch.profiler's allocator events
(fleetc/runtime/memory.py), after the timed steps.

bf16 is AMP: `torch.autocast("cpu", torch.bfloat16)` around eager/torch.compile's forward and loss,
`strategy.amp = True` for fleetc. `--onednn-isa` runs one bf16 matmul under ONEDNN_VERBOSE in a
subprocess and prints the ISA oneDNN dispatched it to (AMX shows as `avx512_core_amx`).

Models: the zoo (tests/zoo.py), `bert` (pre-LN encoder classifier, d=256, 4 layers, 4 heads, seq 128, batch 8) and
`resnet` (ResNet-style CNN, 3 stages of 2 residual blocks, 32-64-128 channels, 64x64 images, batch 16).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from cpu_steps import add_step_options, baseline_runners, interleaved_ms, setup_line
from torch import nn
from zoo import OPTIMIZERS, ZOO, ZooEntry

import fleetc
from fleetc.codegen.cpu import backend, choice
from fleetc.passes.order import fusion_flags
from fleetc.runtime.memory import allocation_peak_bytes, held_bytes


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class BertClassifier(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 256, layers: int = 4, heads: int = 4, seq: int = 128,
                 classes: int = 4, dropout: float = 0.1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x).mean(dim=1))


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None if stride == 1 and c_in == c_out else nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(32)
        self.stages = nn.Sequential(Block(32, 32, 1), Block(32, 32, 1), Block(32, 64, 2), Block(64, 64, 1),
                                    Block(64, 128, 2), Block(128, 128, 1))
        self.head = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(F.relu(self.bn(self.stem(x)))).mean(dim=(2, 3)))


LARGER = {
    "bert": ZooEntry("bert", BertClassifier,
                     lambda g: ((torch.randint(0, 1000, (8, 128), generator=g), torch.randint(0, 4, (8,), generator=g)),
                                {}), F.cross_entropy),
    "resnet": ZooEntry("resnet", ResNet,
                       lambda g: ((torch.randn(16, 3, 64, 64, generator=g), torch.randint(0, 10, (16,), generator=g)),
                                  {}), F.cross_entropy),
}
MODELS = {**ZOO, **LARGER}


def fusion_strategy(fused: bool, amp: bool) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    strategy.amp = amp
    for flag in fusion_flags():
        setattr(strategy.build_strategy, flag, fused)
    strategy.build_strategy.enable_auto_fusion = fused
    return strategy


def runners(entry: ZooEntry, optimizer: str, amp: bool, with_torch_compile: bool,
            cpu_mode: str = "background") -> tuple[dict[str, Callable], dict, dict]:
    """A step function per variant, the fleetc trainers, and per variant what holds its state across steps
    (model, optimizer, fleetc's counters), for the peak-memory column."""
    torch.manual_seed(0)
    base = entry.make_model()
    made, eager_holder = baseline_runners(base, entry, optimizer, amp, with_torch_compile)
    trainers = {}
    holders = {"eager": eager_holder}
    for name, fused in (("fleetc", False), ("fleetc+cpu", True)):
        f_model = copy.deepcopy(base)
        trainer = fleetc.compile(f_model, fusion_strategy(fused, amp),
                                 optimizer=OPTIMIZERS[optimizer](f_model.parameters()), loss_fn=entry.loss_fn,
                                 cpu_kernels=cpu_mode if fused else "off")
        made[name], trainers[name] = trainer.step, trainer
        holders[name] = (f_model, trainer.optimizer, trainer.counters)
    return made, trainers, holders


def peak_bytes(run: Callable, args: tuple, kwargs: dict, holder: tuple) -> int:
    """Tensors held across steps (each storage once) plus one step's allocation peak above them."""
    model, optimizer, counters = holder
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    held = [*model.parameters(), *model.buffers(), *state, *inputs]
    held += [v for v in counters.values() if isinstance(v, torch.Tensor)]
    return held_bytes(held) + allocation_peak_bytes(lambda: run(*args, **kwargs))


@contextlib.contextmanager
def cold_cache() -> Iterator[None]:
    """An empty fleetc cache (captures, passes, kernel libraries) for the block, and no in-process kernel build."""
    previous = os.environ.get("FLEETC_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["FLEETC_CACHE_DIR"] = cache
        backend._BUILDS.clear()  # the in-process build table would make the builds warm
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("FLEETC_CACHE_DIR")
            else:
                os.environ["FLEETC_CACHE_DIR"] = previous


def sync_first_step_s(entry: ZooEntry, optimizer: str, amp: bool, batch: tuple) -> float:
    """fleetc+cpu's cold first step in the "sync" mode (every kernel built before it runs), in a fresh cache."""
    with cold_cache():
        torch.manual_seed(0)
        model = entry.make_model()
        trainer = fleetc.compile(model, fusion_strategy(True, amp), optimizer=OPTIMIZERS[optimizer](model.parameters()),
                                 loss_fn=entry.loss_fn, cpu_kernels="sync")
        start = time.perf_counter()
        trainer.step(*batch[0], **batch[1])
        return time.perf_counter() - start


def bench(entry: ZooEntry, optimizer: str, amp: bool, steps: int, warmup: int, with_torch_compile: bool,
          stat: str = "median") -> dict:
    with cold_cache():
        made, trainers, holders = runners(entry, optimizer, amp, with_torch_compile)
        g = torch.Generator().manual_seed(1)
        batches = [entry.make_batch(g) for _ in range(warmup + steps)]
        first = {}
        for name, run in made.items():
            start = time.perf_counter()
            run(*batches[0][0], **batches[0][1])
            first[name] = time.perf_counter() - start
            if name == "fleetc+cpu":
                trainers[name]._require_train().executable.cpu.wait()
                ready_s = time.perf_counter() - start
        # fleetc+cpu alone until every op chose between its kernel and its reference (choice.py's trial calls)
        for i in range(2 * (choice.WARMUP + choice.TRIALS)):
            args, kwargs = batches[i % len(batches)]
            made["fleetc+cpu"](*args, **kwargs)
        for args, kwargs in batches[1:warmup]:
            for run in made.values():
                run(*args, **kwargs)
        ms = interleaved_ms(made, batches[warmup:], stat)
        args, kwargs = batches[-1]
        peak = {name: peak_bytes(made[name], args, kwargs, holders[name]) for name in holders}
    usage = trainers["fleetc+cpu"].report().kernels
    ran = [usage.implementation(n) for n in usage.ops]
    return {"ms": ms, "first_s": first["fleetc+cpu"], "ready_s": ready_s,
            "sync_s": sync_first_step_s(entry, optimizer, amp, batches[0]), "peak": peak,
            "kernels": f"{ran.count('kernel')}/{len(ran)}", "usage": usage}


def onednn_isa() -> str:
    """The oneDNN implementation a bf16 matmul (as AMP's addmm runs it) dispatches to, from ONEDNN_VERBOSE."""
    code = ("import torch; a = torch.randn(256, 256).bfloat16(); b = torch.randn(256, 256).bfloat16(); "
            "c = torch.randn(256).bfloat16(); torch.addmm(c, a, b); torch.mm(a, b)")
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout
    lines = [line for line in out.splitlines() if ",exec," in line and ("matmul" in line or "gemm" in line)]
    isa = [line for line in out.splitlines() if "cpu,runtime" in line or "isa:" in line]
    return "\n".join(isa[:2] + lines[:4]) or "no oneDNN primitive ran (the bf16 matmul went to another library)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_options(parser, models="mlp,cnn,gpt,bert,resnet", steps=20, warmup=3)
    parser.add_argument("--onednn-isa", action="store_true")
    parser.add_argument("--choices", action="store_true", help="list the ops whose kernel measured slower")
    opts = parser.parse_args()
    print(setup_line(opts))
    if opts.onednn_isa:
        print("oneDNN on a bf16 addmm/mm:\n" + onednn_isa())
    with_tc = not opts.no_torch_compile
    header = ["model", "precision", "eager ms", "fleetc ms", "fleetc+cpu ms", "fleetc+cpu/eager", "fleetc+cpu/fleetc"]
    header += ["t.compile ms", "fleetc+cpu/t.compile"] if with_tc else []
    header += ["kernels kept", "first step s", "kernels ready s", "sync first step s", "peak MB eager",
               "peak MB fleetc", "peak MB fleetc+cpu"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    for name in opts.models.split(","):
        for precision in opts.precision.split(","):
            r = bench(MODELS[name], opts.optimizer, precision == "bf16", opts.steps, max(1, opts.warmup), with_tc,
                      opts.stat)
            ms = r["ms"]
            row = [name, precision, f"{ms['eager']:.2f}", f"{ms['fleetc']:.2f}", f"{ms['fleetc+cpu']:.2f}",
                   f"{ms['fleetc+cpu'] / ms['eager']:.2f}x", f"{ms['fleetc+cpu'] / ms['fleetc']:.2f}x"]
            if with_tc:
                row += [f"{ms['torch.compile']:.2f}", f"{ms['fleetc+cpu'] / ms['torch.compile']:.2f}x"]
            row += [r["kernels"], f"{r['first_s']:.2f}", f"{r['ready_s']:.2f}", f"{r['sync_s']:.2f}"]
            row += [f"{r['peak'][v] / 2 ** 20:.2f}" for v in ("eager", "fleetc", "fleetc+cpu")]
            print("| " + " | ".join(row) + " |", flush=True)
            if opts.choices:
                chosen = [f"  {n}: {u.note}" for n, u in r["usage"].ops.items() if u.chosen == "reference"]
                print("\n".join(["  ops that kept the reference:"] + chosen), flush=True)


if __name__ == "__main__":
    main()
