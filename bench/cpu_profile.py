"""Where a CPU step's time goes, per op family, for the variants of bench/cpu_backend.py, from torch.profiler.

Run from the repository root: `PYTHONPATH=$PWD:$PWD/tests python bench/cpu_profile.py --model resnet --precision bf16`.
Each variant (eager, fleetc without fusion, fleetc+cpu with fusion on the C++ backend, in the "sync" mode so
every kernel runs and shows, slower ones included; `--torch-compile` adds torch.compile) warms up, then `--steps`
steps of each run under torch.profiler, interleaved per batch in rotating order so machine load lands on all
alike; each profiled event's self time is added to its op family (convolution, matmul, batch norm, casts and
copies, ...). fleetc runs every op under a
`record_function` range named after it, so a fused op's C++ kernel shows as the self time of its range ("fleetc
op ranges": kernel plus call overhead). Prints one table, ms per step by family and variant. The variants are
bench/cpu_backend.py's (imported from this script's folder).
"""
from __future__ import annotations

import argparse
import copy
import re
from collections import defaultdict

import torch
from cpu_backend import MODELS, fusion_strategy, runners
from zoo import OPTIMIZERS

import fleetc

# (family, pattern on the aten op name), first match wins; events that are not aten ops are fleetc's op ranges.
FAMILIES = [
    ("convolution", r"conv|mkldnn_convolution"),
    ("attention", r"scaled_dot_product|_flash_attention|_efficient_attention"),
    ("matmul", r"::(mm|addmm|bmm|matmul|linear|baddbmm)$"),
    ("batch norm", r"batch_norm"),
    ("layer norm", r"layer_norm"),
    ("softmax", r"softmax"),
    ("casts and copies", r"::(copy_|_to_copy|to|clone|contiguous|_copy_from|empty_strided|as_strided_copy)$"),
    ("optimizer (foreach)", r"_foreach|_fused_adam|lerp|addcdiv|addcmul"),
    ("reductions", r"::(sum|mean|amax|max|var|std)$"),
    ("pointwise", (r"::(add|add_|mul|mul_|div|div_|sub|relu|relu_|threshold_backward|gelu|gelu_backward|silu|"
                   r"sigmoid|tanh|where|fill_|zero_|native_dropout|native_dropout_backward|neg|sqrt|rsqrt|exp|"
                   r"masked_fill|pow|clamp_min)$")),
    ("losses", r"nll_loss|cross_entropy"),
    ("view ops", (r"::(view|reshape|transpose|permute|t|expand|select|slice|unsqueeze|squeeze|split|"
                  r"split_with_sizes|as_strided|_unsafe_view|detach|alias|resolve_conj|resolve_neg)$")),
]


def family(name: str) -> str:
    if not name.startswith("aten::"):
        return "fleetc op ranges" if "/" in name or name.startswith(("fused", "fleetc")) else "other (Python ranges)"
    for label, pattern in FAMILIES:
        if re.search(pattern, name):
            return label
    return "other aten"


def profile_step(run, args: tuple, kwargs: dict, steps: int, totals: dict, events: dict) -> None:
    """Profile one step, adding each event's self time (ms, divided by `steps`) to its family and its name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(*args, **kwargs)
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / steps
        events[event.key] += ms
        totals[family(event.key)] += ms


def black_listed(entry, optimizer: str, names: list[str]) -> dict:
    """fleetc and fleetc+cpu step functions under bf16 AMP with `names` black-listed, on runners()'s initial model."""
    torch.manual_seed(0)  # as cpu_backend.runners: the same initial model
    base = entry.make_model()
    made = {}
    for label, fused in (("fleetc", False), ("fleetc+cpu", True)):
        model = copy.deepcopy(base)
        strategy = fusion_strategy(fused, amp=True)
        strategy.amp_configs = {"custom_black_list": names}
        trainer = fleetc.compile(model, strategy, optimizer=OPTIMIZERS[optimizer](model.parameters()),
                                 loss_fn=entry.loss_fn, cpu_kernels="sync" if fused else "off")
        made[f"{label} black={','.join(names)}"] = trainer.step
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet", choices=sorted(MODELS))
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--torch-compile", action="store_true")
    parser.add_argument("--top", type=int, default=0, help="also print each variant's N costliest events")
    parser.add_argument("--amp-black-list", default="",
                        help="comma-separated op names (bf16): also profile fleetc and fleetc+cpu with them in "
                             "amp_configs.custom_black_list, e.g. batch_norm for the float32 batch norm of before")
    opts = parser.parse_args()
    entry = MODELS[opts.model]
    made, _, _ = runners(entry, opts.optimizer, opts.precision == "bf16", opts.torch_compile, cpu_mode="sync")
    if opts.amp_black_list:
        made.update(black_listed(entry, opts.optimizer, opts.amp_black_list.split(",")))
    g = torch.Generator().manual_seed(1)
    batches = [entry.make_batch(g) for _ in range(opts.warmup + opts.steps)]
    names = list(made)
    results = {name: defaultdict(float) for name in names}
    events = {name: defaultdict(float) for name in names}
    for args, kwargs in batches[:opts.warmup]:
        for run in made.values():
            run(*args, **kwargs)
    for i, (args, kwargs) in enumerate(batches[opts.warmup:]):  # interleaved, in rotating order, as cpu_backend.py
        for name in names[i % len(names):] + names[:i % len(names)]:
            profile_step(made[name], args, kwargs, opts.steps, results[name], events[name])
    families = sorted({f for r in results.values() for f in r}, key=lambda f: -max(r.get(f, 0) for r in results.values()))
    print(f"{opts.model} {opts.precision}, {torch.get_num_threads()} threads, ms per step (self time) over "
          f"{opts.steps} profiled steps")
    print("| family | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for f in families:
        print(f"| {f} | " + " | ".join(f"{results[n].get(f, 0.0):.1f}" for n in names) + " |")
    print("| total | " + " | ".join(f"{sum(results[n].values()):.1f}" for n in names) + " |")
    for name in names if opts.top else ():
        top = sorted(events[name].items(), key=lambda kv: -kv[1])[:opts.top]
        print(f"\n{name}: " + ", ".join(f"{key} {ms:.1f}" for key, ms in top))


if __name__ == "__main__":
    main()
