"""`fleetc explain`: which strategy presets compile a model's training step and train it exactly like eager PyTorch.

Each preset trains a compiled copy and an eager copy of the model side by side on the same batches and RNG seeds
and compares them (like torch._dynamo.explain, but for the whole training step):

- `default`, `fusion` (every fusion flag, auto fusion included), `recompute_auto`, `recompute_blocks` (the model's
  repeated blocks as checkpoints): the gradients of the first step, relative to the largest gradient of the model
  (read from SGD's momentum buffers, which hold the first step's gradients exactly), then the parameters after
  several SGD+momentum steps; `default` also the parameters after several AdamW steps (Adam magnifies float noise
  in gradients that are truly zero, so its parameters alone would mislead);
- `amp_bf16`: every loss finite and within 2% of the float32 eager loss;
- `gradient_merge`: k=2 against eager PyTorch accumulating over the same two micro-batches.

A failure names the construct (the error, or the worst mismatch), the user's file:line where torch recorded one,
and a workaround.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fleetc.capture.trace import is_user_file
from fleetc.compiler import compile as compile_step
from fleetc.errors import CaptureError
from fleetc.passes.order import fusion_flags
from fleetc.strategy import DistributedStrategy

GRAD_TOLERANCE = 1e-4  # of the largest gradient magnitude in the model
PARAM_TOLERANCE = 1e-4  # of the largest parameter magnitude in the model
AMP_LOSS_TOLERANCE = 0.02
STEPS = 3

Batch = tuple[tuple, dict]


@dataclass
class Outcome:
    """What one preset did: ok, or the construct that failed, where, and what to do."""

    preset: str
    ok: bool
    construct: str = ""
    location: str = ""
    workaround: str = ""
    capture_failed: bool = False  # capture is the same under every preset: the others need not try

    def cell(self) -> str:
        """The matrix cell: `pass`, or `fail: <construct>`."""
        return "pass" if self.ok else f"fail: {self.construct}"


def repeated_blocks(model: nn.Module) -> list[str]:
    """Module paths of the model's repeated blocks: the children of its first ModuleList of two or more modules."""
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            return [f"{path}.{i}" if path else str(i) for i in range(len(module))]
    return []


def _strategy(preset: str, model: nn.Module) -> DistributedStrategy:
    strategy = DistributedStrategy()
    if preset == "fusion":
        for flag in fusion_flags():
            setattr(strategy.build_strategy, flag, True)
        strategy.build_strategy.enable_auto_fusion = True
    elif preset == "recompute_auto":
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": "auto"}
    elif preset == "recompute_blocks":
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": repeated_blocks(model)}
    elif preset == "amp_bf16":
        strategy.amp = True
        strategy.amp_configs = {"dtype": "bfloat16"}
    elif preset == "gradient_merge":
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
    return strategy


PRESETS = ("default", "fusion", "recompute_auto", "recompute_blocks", "amp_bf16", "gradient_merge")
_WORKAROUNDS = {
    "fusion": "leave the fusion flags off (or disable the failing fusion pass with disable_passes=[...])",
    "recompute_auto": "give explicit checkpoints (recompute_configs={'checkpoints': [module paths]})",
    "recompute_blocks": "use recompute_configs={'checkpoints': 'auto'}, or other block paths",
    "amp_bf16": "add the op to amp_configs['custom_black_list'] so it stays in float32",
    "gradient_merge": "accumulate outside the step (call the trainer once per micro-batch with k_steps=1)",
    "default": "report it: the default strategy must train every model exactly like eager",
}


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _loss(model: nn.Module, loss_fn: Callable | None, batch: Batch) -> torch.Tensor:
    args, kwargs = batch
    if loss_fn is None:
        out = model(*args, **kwargs)
        return out["loss"] if isinstance(out, dict) else out
    return loss_fn(model(*args[:-1], **kwargs), args[-1])


def _trainable(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _worst(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[str, float, float]:
    """(name, largest absolute difference, largest magnitude over all of `expected`)."""
    scale = max((float(t.abs().max()) for t in expected.values() if t.numel()), default=0.0)
    name, diff = "", 0.0
    for key, want in expected.items():
        got = actual[key]
        if not torch.isfinite(got).all():
            return key, float("inf"), scale
        d = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
        if d > diff:
            name, diff = key, d
    return name, diff, scale


class _Mismatch(Exception):
    """Compiled training differs from eager training."""


def _check_close(what: str, actual: dict, expected: dict, tolerance: float) -> None:
    name, diff, scale = _worst(actual, expected)
    if diff > tolerance * max(scale, 1e-12):
        raise _Mismatch(f"{what} of {name!r} differ by {diff:.3g} (largest {what}: {scale:.3g})")


def _train_pair(model: nn.Module, batches: Sequence[Batch], loss_fn: Callable | None, preset: str, verify: bool,
                make_optimizer: Callable, micro_batches: int = 1):
    """Train eager and compiled copies; returns (eager, compiled, eager optimizer, compiled optimizer, losses)."""
    eager, compiled = copy.deepcopy(model), copy.deepcopy(model)
    eager_opt = make_optimizer([p for _, p in _trainable(eager)])
    compiled_opt = make_optimizer([p for _, p in _trainable(compiled)])
    trainer = compile_step(compiled, _strategy(preset, compiled), optimizer=compiled_opt, loss_fn=loss_fn,
                           verify=verify)
    eager_losses, compiled_losses = [], []
    for i, batch in enumerate(batches):
        torch.manual_seed(100 + i)
        loss = _loss(eager, loss_fn, batch)
        (loss / micro_batches).backward()
        if (i + 1) % micro_batches == 0:
            eager_opt.step()
            eager_opt.zero_grad(set_to_none=True)
        eager_losses.append(loss.detach())
        torch.manual_seed(100 + i)
        compiled_losses.append(trainer.step(*batch[0], **batch[1]).detach())
        if i == 0 and make_optimizer is _sgd and micro_batches == 1 and preset != "amp_bf16":
            _check_close("first-step gradients", _momentum(compiled, compiled_opt), _momentum(eager, eager_opt),
                         GRAD_TOLERANCE)
    return eager, compiled, eager_losses, compiled_losses


def _momentum(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """SGD's momentum buffers after its first step: exactly that step's gradients."""
    return {n: optimizer.state[p]["momentum_buffer"] for n, p in _trainable(model)}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in _trainable(model)}


def _run(model: nn.Module, batches: Sequence[Batch], loss_fn: Callable | None, preset: str, verify: bool) -> None:
    """Raise at the first way compiled training under `preset` differs from eager."""
    if preset == "amp_bf16":
        _, _, eager_losses, compiled_losses = _train_pair(model, batches, loss_fn, preset, verify, _sgd)
        for step, (want, got) in enumerate(zip(eager_losses, compiled_losses)):
            if not torch.isfinite(got) or abs(float(got) - float(want)) > AMP_LOSS_TOLERANCE * abs(float(want)):
                raise _Mismatch(f"bf16 loss of step {step} is {float(got):.5g}, float32 eager {float(want):.5g}")
        return
    if preset == "gradient_merge":
        merged = [b for batch in batches[:2] for b in (batch, batch)] if len(batches) < 4 else list(batches[:4])
        eager, compiled, _, _ = _train_pair(model, merged, loss_fn, preset, verify, _sgd, micro_batches=2)
        _check_close("parameters after 2 merged steps", _params(compiled), _params(eager), PARAM_TOLERANCE)
        return
    eager, compiled, _, _ = _train_pair(model, batches, loss_fn, preset, verify, _sgd)
    _check_close(f"parameters after {len(batches)} SGD steps", _params(compiled), _params(eager), PARAM_TOLERANCE)
    if preset == "default":
        eager, compiled, _, _ = _train_pair(model, batches, loss_fn, preset, verify, _adamw)
        _check_close(f"parameters after {len(batches)} AdamW steps", _params(compiled), _params(eager),
                     PARAM_TOLERANCE)


def _construct(exc: BaseException) -> str:
    """What failed, in a few words: a CaptureError's construct, else the error's type and first line."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, CaptureError) and first.startswith("cannot capture ") and " at " in first:
        return first.split(": ", 1)[-1].rsplit(" at ", 1)[0]
    return f"{type(exc).__name__}: {first[:160]}"


def _location(exc: BaseException) -> str:
    """The user's file:line in a CaptureError's message, else the innermost user frame of the traceback."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, CaptureError) and " at " in first:
        return first.rsplit(" at ", 1)[1].split("  (")[0]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _hint(exc: BaseException, preset: str) -> str:
    for line in str(exc).splitlines():
        if line.strip().startswith("hint:"):
            return line.strip().removeprefix("hint:").strip()
    return _WORKAROUNDS[preset]


def check_preset(model: nn.Module, batches: Sequence[Batch], loss_fn: Callable | None, preset: str, *,
                 verify: bool = False) -> Outcome:
    """Train `model` (left untouched: copies are trained) compiled under `preset` and eagerly, on `batches`
    ((args, kwargs) each, the target last in args when `loss_fn` is given); `verify` runs the IR verifier after
    every pass."""
    try:
        _run(model, batches, loss_fn, preset, verify)
    except _Mismatch as exc:
        return Outcome(preset, False, f"mismatch: {exc}", "", _WORKAROUNDS[preset])
    except Exception as exc:  # any failure of compile or step is what explain reports
        return Outcome(preset, False, _construct(exc), _location(exc), _hint(exc, preset),
                       isinstance(exc, CaptureError))
    return Outcome(preset, True)


def explain(model: nn.Module, batches: Sequence[Batch], loss_fn: Callable | None,
            presets: Sequence[str] = PRESETS, *, verify: bool = False) -> list[Outcome]:
    """Every preset's outcome, in order; after a capture failure the remaining presets report it too, untried."""
    outcomes: list[Outcome] = []
    for preset in presets:
        if outcomes and outcomes[-1].capture_failed:
            outcomes.append(dataclasses.replace(outcomes[-1], preset=preset))
        else:
            outcomes.append(check_preset(model, batches, loss_fn, preset, verify=verify))
    return outcomes


def format_outcomes(name: str, outcomes: Sequence[Outcome]) -> str:
    """One table row per preset, then each failure's construct, location and workaround."""
    width = max(len(o.preset) for o in outcomes)
    lines = [f"{name}: {sum(o.ok for o in outcomes)}/{len(outcomes)} presets train like eager"]
    for o in outcomes:
        lines.append(f"  {o.preset:<{width}}  {'pass' if o.ok else 'FAIL'}")
    failures: dict[tuple[str, str, str], list[str]] = {}  # one paragraph per distinct failure
    for o in outcomes:
        if not o.ok:
            failures.setdefault((o.construct, o.location, o.workaround), []).append(o.preset)
    for (construct, location, workaround), presets in failures.items():
        lines.append(f"\n{', '.join(presets)}: {construct}")
        if location:
            lines.append(f"  at {location}")
        lines.append(f"  workaround: {workaround}")
    return "\n".join(lines)


DESCRIPTION = """\
Try a model's training step under each strategy preset and print what trains exactly like eager PyTorch.

FACTORY is package.module:function returning a dict with 'model', 'args' (the target last when 'loss_fn' is
given), optionally 'kwargs' and 'loss_fn' (as for `fleetc dump-ir`). Each preset trains a compiled copy and an eager
copy of the model for a few steps on the factory's batch and compares gradients and parameters; each failure is
printed with the construct, the user's file:line and a workaround. Exit status 1 when any preset fails.
"""


def add_explain_command(commands: Any, load_step: Callable[[str], Any]) -> None:
    """Add `explain` to the `fleetc` command line; `load_step(factory)` gives the factory's model, args, kwargs and
    loss_fn (the command line's factory loading, with its errors)."""
    parser = commands.add_parser("explain", help="which strategy presets train a model exactly like eager",
                                 description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("factory", metavar="FACTORY", help="package.module:function returning the model and inputs")
    parser.add_argument("--preset", metavar="NAME", action="append", choices=PRESETS, default=[],
                        help="try only this preset (repeatable); presets: " + ", ".join(PRESETS))
    parser.add_argument("--verify", action="store_true", help="run the IR verifier after every compiler pass")

    def handler(options: argparse.Namespace) -> int:
        step = load_step(options.factory)
        outcomes = explain(step.model, [(step.args, step.kwargs)] * STEPS, step.loss_fn,
                           options.preset or PRESETS, verify=options.verify)
        print(format_outcomes(options.factory, outcomes))
        return 0 if all(o.ok for o in outcomes) else 1
    parser.set_defaults(handler=handler)
