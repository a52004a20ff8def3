"""Every op with a CUDA kernel that the zoo produces, checked on the real inputs of a training step.

The zoo models are compiled with every fusion flag on (dropout in its Philox form, the one CUDA Programs get)
and trained one step on CPU tensors, recording the
arguments of each call to an op that has a CUDA kernel. Each recorded call is then run twice on copies of
those arguments: through the op's reference and through its kernel under TRITON_INTERPRET=1 (no GPU
needed). Outputs and in-place updated arguments must agree. Calls are de-duplicated by op and input
signature, so each distinct kernel specialisation runs once.
"""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.ir.registry import device_kernel, registered_ops
from fleetc.passes.fusion.dropout_rng import AlwaysPhilox, set_dropout_rng_choice
from fleetc.passes.order import fusion_flags
from fleetc.runtime import pycodegen

WITH_KERNELS = {name for name, d in registered_ops().items() if "cuda" in d.kernels}
FP32 = dict(rtol=1e-4, atol=1e-5)
# Fused ops that have no kernel of their own on CUDA, and why.
NO_KERNEL = {
    "fleetc.fused_sgd": "torch's _foreach_* ops: multi-tensor kernels already",
    "fleetc.fused_adam": "torch's _foreach_* ops: multi-tensor kernels already",
}


def every_fusion_flag() -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    for flag in fusion_flags():
        setattr(strategy.build_strategy, flag, True)
    strategy.build_strategy.enable_auto_fusion = True
    return strategy


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return repr(value)


def _tensors(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@functools.lru_cache(maxsize=None)
def recorded_calls(zoo_name: str) -> tuple:
    """(op type, args, kwargs) of every distinct call to an op with a CUDA kernel in one training step, and the
    op types of the training Program."""
    calls: dict[tuple, tuple] = {}
    resolve = pycodegen.resolve_callable

    def recording(op_type: str):
        fn = resolve(op_type)
        if op_type not in WITH_KERNELS:
            return fn

        def run(*args, **kwargs):
            key = (op_type, _signature(args), _signature(sorted(kwargs.items())))
            calls.setdefault(key, (op_type, _copy(args), _copy(kwargs)))
            return fn(*args, **kwargs)

        return run

    entry = ZOO[zoo_name]
    torch.manual_seed(0)
    model = entry.make_model()
    previous = set_dropout_rng_choice(AlwaysPhilox())
    try:
        trainer = fleetc.compile(model, every_fusion_flag(), optimizer=OPTIMIZERS["sgd"](model.parameters()),
                                 loss_fn=entry.loss_fn)
        args, kwargs = entry.make_batch(torch.Generator().manual_seed(1))
        pycodegen.resolve_callable = recording  # compilation is lazy: the step function is generated now
        trainer.step(*args, **kwargs)
    finally:
        pycodegen.resolve_callable = resolve
        set_dropout_rng_choice(previous)
    return tuple(calls.values()), {op.type for _, op in trainer.program.walk_ops()}


def _run(fn, args, kwargs) -> tuple[Any, list]:
    """Outputs of `fn` on copies of the arguments, and those copies (in-place updates show there)."""
    args, kwargs = _copy(args), _copy(kwargs)
    torch.manual_seed(0)  # ops that draw random numbers draw the same ones in both runs
    out = fn(*args, **kwargs)
    return out, _tensors((args, kwargs))


@pytest.mark.parametrize("zoo_name", ["mlp", "cnn", "gpt"])
def test_every_zoo_kernel_matches_its_reference_on_real_inputs(zoo_name, interpret):
    calls, op_types = recorded_calls(zoo_name)
    fused = {t for t in op_types if t.startswith("fleetc.fused")}
    assert fused - WITH_KERNELS <= set(NO_KERNEL), f"{zoo_name}: fused ops without a CUDA kernel"
    assert {op_type for op_type, _, _ in calls} == op_types & WITH_KERNELS  # every one of them ran
    for op_type, args, kwargs in calls:
        want, want_args = _run(registered_ops()[op_type].reference, args, kwargs)
        got, got_args = _run(device_kernel(op_type, "cuda"), args, kwargs)
        got_out, want_out = _tensors(got), _tensors(want)
        assert len(got_out) == len(want_out), op_type
        for g, w in zip(got_out + got_args, want_out + want_args):
            torch.testing.assert_close(g, w, **FP32, msg=lambda m: f"{op_type}: {m}")
