"""The multi-threaded scheduler and the memory planner, per model: step time for num_threads 1 (the straight-line
function), 2 and 4 against eager; peak live tensor bytes and process peak RSS with the planner (enable_inplace and
memory_optimize) off and on against eager. See bench/README.md ("execution") for how to read the figures."""
from __future__ import annotations

import argparse
import copy
import json
import math
import pathlib
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from conftest import eager_step
from cpu_steps import interleaved_ms
from zoo import OPTIMIZERS, ZOO, ZooEntry

import fleetc
from fleetc.runtime.memory import allocation_peak_bytes, held_bytes


class EncoderLayer(nn.Module):
    """A BERT layer: bidirectional self-attention and a GELU MLP, post-LayerNorm, dropout 0.1."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        att = self.drop(((q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)).softmax(dim=-1))
        x = self.ln1(x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, c))))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class Encoder(nn.Module):
    """A 4-layer BERT-style encoder with a classification head on the first token."""

    def __init__(self, vocab: int = 1000, dim: int = 128, heads: int = 4, layers: int = 4, seq: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        self.layers = nn.Sequential(*[EncoderLayer(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.tok(idx) + self.pos)[:, 0])


def _encoder_batch(g: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randint(0, 1000, (16, 64), generator=g), torch.randint(0, 2, (16,), generator=g)), {}


MODELS = {**ZOO, "encoder": ZooEntry("encoder", Encoder, _encoder_batch, F.cross_entropy)}


def trainer_for(entry: ZooEntry, model: nn.Module, optimizer: str, planner: bool = False,
                **execution) -> fleetc.CompiledTrainer:
    """A trainer with `execution` as its execution_strategy and the memory planner's two passes on or off."""
    strategy = fleetc.DistributedStrategy()
    strategy.execution_strategy = execution
    strategy.build_strategy.enable_inplace = strategy.build_strategy.memory_optimize = planner
    return fleetc.compile(model, strategy, optimizer=OPTIMIZERS[optimizer](model.parameters()), loss_fn=entry.loss_fn)


def runners(entry: ZooEntry, optimizer: str) -> dict:
    base = entry.make_model()
    model = copy.deepcopy(base)
    opt = OPTIMIZERS[optimizer](model.parameters())
    out = {"eager": lambda *a, **k: eager_step(model, opt, entry.loss_fn, a, k)}
    for threads in (1, 2, 4):
        out[f"threads={threads}"] = trainer_for(entry, copy.deepcopy(base), optimizer, num_threads=threads).step
    out["planner on"] = trainer_for(entry, copy.deepcopy(base), optimizer, planner=True).step
    return out


def step_times(entry: ZooEntry, args: argparse.Namespace) -> dict[str, float]:
    """Median ms per step of each variant, interleaved in rotating order."""
    g = torch.Generator().manual_seed(0)
    batches = [entry.make_batch(g) for _ in range(args.steps + args.warmup + 1)]
    variants = runners(entry, args.optimizer)
    for a, k in batches[:args.warmup + 1]:
        for step in variants.values():
            step(*a, **k)
    return interleaved_ms(variants, batches[args.warmup + 1:], "median")


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes held between steps: parameters, buffers and optimizer state."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return held_bytes(tensors)


def memory(entry: ZooEntry, optimizer: str) -> dict[str, int]:
    """Peak live tensor bytes of one step (held state + the step's allocation peak, both measured from the
    allocator), for eager and fleetc with the planner off and on; and fleetc's planned peak with it on."""
    g = torch.Generator().manual_seed(0)
    batches = [entry.make_batch(g) for _ in range(3)]
    base = entry.make_model()
    out = {}
    model = copy.deepcopy(base)
    opt = OPTIMIZERS[optimizer](model.parameters())
    for a, k in batches[:2]:
        eager_step(model, opt, entry.loss_fn, a, k)
    a, k = batches[2]
    out["eager"] = state_bytes(model, opt) + allocation_peak_bytes(lambda: eager_step(model, opt, entry.loss_fn, a, k))
    for planner in (False, True):
        model = copy.deepcopy(base)
        trainer = trainer_for(entry, model, optimizer, planner=planner)
        for a, k in batches[:2]:
            trainer.step(*a, **k)
        a, k = batches[2]
        key = "planner on" if planner else "planner off"
        out[key] = state_bytes(model, trainer.optimizer) + allocation_peak_bytes(
            lambda trainer=trainer, a=a, k=k: trainer.step(*a, **k))
        out[f"planned ({key})"] = trainer.memory_stats()["estimated_peak_bytes"]
    return out


def rss_child(model_name: str, variant: str, optimizer: str) -> None:
    """Run in a fresh process: 5 steps of one variant, then print the process peak RSS in KiB (VmHWM: getrusage's
    ru_maxrss would report the parent's peak when that is larger, as it is kept across fork and exec)."""
    entry = MODELS[model_name]
    torch.manual_seed(0)
    model = entry.make_model()
    g = torch.Generator().manual_seed(0)
    if variant == "eager":
        opt = OPTIMIZERS[optimizer](model.parameters())
        step = lambda *a, **k: eager_step(model, opt, entry.loss_fn, a, k)
    else:
        step = trainer_for(entry, model, optimizer, planner=variant == "planner on").step
    for _ in range(5):
        a, k = entry.make_batch(g)
        step(*a, **k)
    status = pathlib.Path("/proc/self/status").read_text()
    print(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))


def rss(model_name: str, optimizer: str) -> dict[str, int]:
    out = {}
    for variant in ("eager", "planner off", "planner on"):
        result = subprocess.run([sys.executable, __file__, "--rss-child", model_name, variant, "--optimizer", optimizer],
                                capture_output=True, text=True, check=True)
        out[variant] = int(result.stdout.split()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="mlp,cnn,gpt,encoder")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rss-child", nargs=2, metavar=("MODEL", "VARIANT"))
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if args.rss_child:
        rss_child(*args.rss_child, args.optimizer)
        return
    results = {}
    print(f"torch intra-op threads: {torch.get_num_threads()}")
    print("| model | eager ms | threads=1 ms | threads=2 ms | threads=4 ms | planner on ms "
          "| peak MiB eager / off / on (planned on) | on/eager | RSS MiB eager / off / on |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        entry = MODELS[name]
        times, mem, peak_rss = step_times(entry, args), memory(entry, args.optimizer), rss(name, args.optimizer)
        results[name] = {"ms": times, "bytes": mem, "rss_kib": peak_rss}
        mib = lambda b: f"{b / 2**20:.2f}"
        print(f"| {name} | {times['eager']:.2f} | {times['threads=1']:.2f} | {times['threads=2']:.2f} | "
              f"{times['threads=4']:.2f} | {times['planner on']:.2f} | {mib(mem['eager'])} / {mib(mem['planner off'])} / {mib(mem['planner on'])} "
              f"({mib(mem['planned (planner on)'])}) | {mem['planner on'] / mem['eager']:.2f}x | "
              f"{peak_rss['eager'] / 1024:.0f} / {peak_rss['planner off'] / 1024:.0f} / "
              f"{peak_rss['planner on'] / 1024:.0f} |", flush=True)
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
