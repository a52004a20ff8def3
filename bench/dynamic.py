"""Dynamic shapes (issue 21): a training loop over batches padded to their own random length (HF-style dynamic
padding), run four ways, each in its own process (so its peak RSS is its own):

- `static`: fleetc.compile(..., dynamic=False): one Program per distinct length (cache_limit high enough to keep
  them all, so each length compiles once);
- `dynamic`: fleetc.compile(..., dynamic=True): one Program for every length;
- `eager`: zero_grad + forward + loss + backward + optimizer.step();
- `torch.compile`: the same eager step on torch.compile(model) (its default dynamic=None).

Reported: total wall time of the loop (compiles included), Programs compiled, peak RSS. `--fixed` instead times
the median step of fleetc static and dynamic at one fixed shape, interleaved in one process (the goal: dynamic
within 1.1x of static).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from zoo import TinyGPT, _lm_loss

import fleetc

VARIANTS = ("static", "dynamic", "eager", "torch.compile")


def batches(steps: int, batch: int, min_seq: int, max_seq: int, vocab: int) -> list[tuple[torch.Tensor, ...]]:
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, rng.randint(min_seq, max_seq) + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def make(args: argparse.Namespace) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=args.vocab, dim=args.dim, heads=4, layers=args.layers, seq=args.max_seq, dropout=0.0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def stepper(variant: str, model: TinyGPT, optimizer: torch.optim.Optimizer):
    if variant in ("static", "dynamic"):
        trainer = fleetc.compile(model, optimizer=optimizer, loss_fn=_lm_loss, dynamic=variant == "dynamic",
                                 cache_limit=1024)
        return trainer.step, lambda: trainer.report().compiles
    forward = torch.compile(model) if variant == "torch.compile" else model

    def step(x, y):
        optimizer.zero_grad()
        loss = _lm_loss(forward(x), y)
        loss.backward()
        optimizer.step()
        return loss
    return step, lambda: None


def run_loop(variant: str, args: argparse.Namespace) -> dict:
    data = batches(args.steps, args.batch, args.min_seq, args.max_seq, args.vocab)
    model, optimizer = make(args)
    step, compiles = stepper(variant, model, optimizer)
    start = time.perf_counter()
    for x, y in data:
        loss = step(x, y)
    wall = time.perf_counter() - start
    return {"variant": variant, "wall_s": wall, "compiles": compiles(), "final_loss": float(loss),
            "distinct_lengths": len({x.shape[1] for x, _ in data}),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_fixed(args: argparse.Namespace) -> list[dict]:
    """Median step of fleetc static and dynamic at one shape, in one process, steps interleaved (the order
    alternating) so that machine noise lands on both alike."""
    steps = {}
    for variant in ("static", "dynamic"):
        model, optimizer = make(args)
        steps[variant] = stepper(variant, model, optimizer)[0]
    x, y = batches(1, args.batch, args.max_seq, args.max_seq, args.vocab)[0]
    times: dict[str, list[float]] = {variant: [] for variant in steps}
    for i in range(5 + args.fixed_steps):
        for variant in (("static", "dynamic") if i % 2 else ("dynamic", "static")):
            start = time.perf_counter()
            steps[variant](x, y)
            if i >= 5:
                times[variant].append(time.perf_counter() - start)
    return [{"variant": v, "median_step_ms": 1e3 * statistics.median(t)} for v, t in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--min-seq", type=int, default=4)
    parser.add_argument("--max-seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--fixed", action="store_true", help="median step time at one shape: static vs dynamic")
    parser.add_argument("--fixed-steps", type=int, default=50)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one variant's loop in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_loop(args.one, args)))
        return
    results = run_fixed(args) if args.fixed else []
    for variant in [] if args.fixed else args.variants.split(","):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", variant], check=True,
                             capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args}")
    if args.fixed:
        print("| variant | median step ms |\n|---|---|")
        for r in results:
            print(f"| fleetc {r['variant']} | {r['median_step_ms']:.2f} |")
        return
    print("| variant | total wall s | Programs compiled | peak RSS MiB | final loss |\n|---|---|---|---|---|")
    for r in results:
        compiles = "-" if r["compiles"] is None else r["compiles"]
        print(f"| {r['variant']} | {r['wall_s']:.1f} | {compiles} | {r['peak_rss_mib']:.0f} | {r['final_loss']:.4f} |")
    print(f"distinct sequence lengths: {results[0]['distinct_lengths']}")


if __name__ == "__main__":
    main()
