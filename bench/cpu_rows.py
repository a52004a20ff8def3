"""The CPU backend's row-wise kernels against aten, op by op, on the shapes of a BERT-style step.

Each op's kernel and its aten reference run alternately on the same arguments (`--repeat` rounds of `--number`
calls each, best round kept), so machine load hits both alike; the table prints ms per call and the ratio.

    OMP_NUM_THREADS=1 PYTHONPATH=.:tests python bench/cpu_rows.py
"""
from __future__ import annotations

import argparse
import time

import torch
from helpers.cpu_kernels import cpu_kernel

from fleetc.ir.registry import resolve_callable


def cases(batch: int, seq: int, d: int, heads: int, vocab: int, dtype: torch.dtype) -> list[tuple[str, str, tuple]]:
    """(label, op type, arguments) for each row-wise op of one step at these sizes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq, d, generator=g).to(dtype)
    w, b = torch.randn(d, generator=g), torch.randn(d, generator=g)
    if dtype != torch.float32:
        w, b = w.to(dtype), b.to(dtype)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [d], w, b, 1e-5)
    scores = torch.randn(batch, heads, seq, seq, generator=g).to(dtype)
    probs = torch.softmax(scores, -1)
    logits = torch.randn(batch * seq, vocab, generator=g).to(dtype)
    logp = torch.log_softmax(logits, -1)
    return [
        (f"layer_norm {tuple(x.shape)}", "aten.native_layer_norm.default", (x, [d], w, b, 1e-5)),
        ("layer_norm_backward", "aten.native_layer_norm_backward.default",
         (torch.randn_like(x), x, [d], mean, rstd, w, b, [True, True, True])),
        (f"softmax {tuple(scores.shape)}", "aten._softmax.default", (scores, -1, False)),
        ("softmax_backward", "aten._softmax_backward_data.default", (torch.randn_like(probs), probs, 3, dtype)),
        (f"log_softmax {tuple(logits.shape)}", "aten._log_softmax.default", (logits, -1, False)),
        ("log_softmax_backward", "aten._log_softmax_backward_data.default", (torch.randn_like(logp), logp, 1, dtype)),
    ]


def best_ms(fn, args: tuple, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn(*args)
    return (time.perf_counter() - start) / number * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--number", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}")
    print("| op | dtype | aten ms | kernel ms | kernel/aten |\n|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for label, op_type, op_args in cases(args.batch, args.seq, args.d, args.heads, args.vocab, dtype):
            kernel, reference = cpu_kernel(op_type, op_args), resolve_callable(op_type)
            kernel(*op_args), reference(*op_args)  # warm up both
            times = {"aten": [], "kernel": []}
            for _ in range(args.repeat):
                times["aten"].append(best_ms(reference, op_args, args.number))
                times["kernel"].append(best_ms(kernel, op_args, args.number))
            aten_ms, kernel_ms = min(times["aten"]), min(times["kernel"])
            print(f"| {label} | {str(dtype).removeprefix('torch.')} | {aten_ms:.3f} | {kernel_ms:.3f} | "
                  f"{kernel_ms / aten_ms:.2f}x |")


if __name__ == "__main__":
    main()
