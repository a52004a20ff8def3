"""Recompute benchmark: peak activation memory (measured) and step time of a 12-layer GPT, side by side in one run.

Configurations: no recompute, a checkpoint after every layer, sqrt(n) checkpoints (every 3rd of 12 layers),
"auto" (min-cut), and memory budgets: the sqrt(n) plan's estimated peak, and points around it.
Activation memory = measured peak of live tensors − parameters − optimizer state − fed inputs
(gradients are temporaries, so they count as activations here).

    OMP_NUM_THREADS=1 PYTHONPATH=.:tests python bench/recompute.py [--rounds N]
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from zoo import ZOO, TinyGPT  # noqa: E402

import fleetc  # noqa: E402
from fleetc.passes.recompute import RecomputePolicy  # noqa: E402
from fleetc.passes.recompute.plan import forward_region  # noqa: E402

LAYERS = 12
SIZES = dict(vocab=256, dim=128, heads=4, layers=LAYERS, seq=256, dropout=0.1)
BATCH = 4


def _strategy(**configs) -> fleetc.DistributedStrategy | None:
    if not configs:
        return None
    strategy = fleetc.DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = configs
    return strategy


class Config:
    """One compiled trainer on its own copy of the model, with its step times."""

    def __init__(self, name: str, model: torch.nn.Module, batch: tuple, **configs):
        self.name = name
        self.model = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.trainer = fleetc.compile(self.model, _strategy(**configs), optimizer=optimizer, loss_fn=ZOO["gpt"].loss_fn,
                                      measure_memory=True)
        self.batch = batch
        self.times: list[float] = []
        self.step()  # compile
        self.step()  # optimizer state exists from here on

    def step(self) -> float:
        torch.manual_seed(0)
        start = time.perf_counter()
        self.trainer.step(*self.batch)
        elapsed = time.perf_counter() - start
        self.times.append(elapsed)
        return elapsed

    def memory(self) -> tuple[int, int, int]:
        """(estimated peak, measured peak, measured activation bytes)."""
        stats = self.trainer.memory_stats()
        state = sum(stats["persistable_bytes"].values()) + stats["feed_bytes"]
        return stats["estimated_peak_bytes"], stats["measured_peak_bytes"], stats["measured_peak_bytes"] - state

    def plan(self) -> tuple[float, str]:
        """(GFLOPs re-run per step, the plan a memory budget chose or how many ops are re-run)."""
        if "recompute" not in self.trainer.history.names():
            return 0.0, "-"
        report = self.trainer.history["recompute"].report
        chosen = [n.split("chose ")[1].split(" (")[0] for n in report.notes if "chose " in n]
        return report.stats["recompute_mflops"] / 1000, chosen[0] if chosen else f"{report.stats['ops_recomputed']} ops"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="timed steps per configuration (interleaved)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyGPT(**SIZES)
    tokens = torch.randint(0, SIZES["vocab"], (BATCH, SIZES["seq"] + 1), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    stride = round(math.sqrt(LAYERS))
    every = [f"layers.{i}" for i in range(LAYERS)]
    sqrt_n = every[stride - 1::stride]
    configs = [Config("no recompute", model, batch), Config("every layer", model, batch, checkpoints=every),
               Config(f"sqrt(n): {len(sqrt_n)} checkpoints", model, batch, checkpoints=sqrt_n),
               Config("auto (min-cut)", model, batch, checkpoints="auto")]
    off_peak, sqrt_peak, every_peak = (c.memory()[0] / 2**20 for c in (configs[0], configs[2], configs[1]))
    for label, budget in (("= sqrt(n) peak", sqrt_peak), ("midway sqrt(n)..off", (sqrt_peak + off_peak) / 2),
                          ("= every-layer peak", every_peak)):
        configs.append(Config(f"budget {budget:.1f} MiB {label}", model, batch, memory_budget_mb=budget))
    for _ in range(args.rounds):  # interleaved, so load changes on the shared machine hit every config alike
        for config in configs:
            config.step()
    base_time = statistics.median(configs[0].times[2:])
    base_act = configs[0].memory()[2]
    policy, program = RecomputePolicy(), configs[0].trainer.program
    forward_flops = sum(policy.cost(program, op) for op in forward_region(program, policy).ops)
    print(f"TinyGPT {SIZES}, batch {BATCH}, AdamW; torch threads {torch.get_num_threads()}; "
          f"median of {args.rounds} interleaved steps; forward pass ≈ {forward_flops / 1e9:.1f} GFLOPs (estimate)")
    print(f"{'configuration':<40} {'est. peak':>10} {'meas. peak':>10} {'activ.':>9} {'act. cut':>8} "
          f"{'step ms':>8} {'time':>6} {'re-run':>7}  plan")
    for config in configs:
        estimated, measured, activation = config.memory()
        median = statistics.median(config.times[2:])
        gflops, plan = config.plan()
        print(f"{config.name:<40} {estimated / 2**20:>9.1f}M {measured / 2**20:>9.1f}M {activation / 2**20:>8.1f}M "
              f"{base_act / activation:>7.2f}x {median * 1000:>8.0f} {median / base_time:>5.2f}x {gflops:>5.1f}GF  "
              f"{plan}")


if __name__ == "__main__":
    main()
