"""The batch-norm fusion kernels (fleetc/codegen/triton/norm.py) against their references under TRITON_INTERPRET=1.

Forward (train and eval, with and without residual and affine weight) and backward (every output_mask) for every
activation, odd channel/spatial sizes and ranks 2-4; the running statistics must be updated like aten's.
Low-precision inputs are compared more loosely: the kernels reduce in a different order than aten.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import triton.language  # noqa: F401  (imported before TRITON_INTERPRET is set, as in test_triton_kernels.py)
from conftest import run_side_by_side

import fleetc
from fleetc.codegen.triton import format_kernels, launch, norm, program_kernels
from fleetc.codegen.triton.launch import cache_dir, load_kernel
from fleetc.ir.registry import resolve_callable
from fleetc.ops import fused_norm
from fleetc.ops.activations import ACTIVATIONS as ACTIVATION_TABLE

ACTIVATIONS = [("relu", None), ("gelu", "none"), ("gelu", "tanh"), ("silu", None), ("sigmoid", None),
               ("tanh", None), ("leaky_relu", 0.2), ("scale", 2.0)]
FP32 = dict(rtol=1e-5, atol=1e-5)
LOW_PRECISION = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def assert_close_all(got, want, **tol) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"output {i} should be None"
        else:
            torch.testing.assert_close(g, w, **tol, msg=lambda m: f"output {i}: {m}")


def make_inputs(shape: tuple, dtype=torch.float32, param_dtype=torch.float32, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    channels = shape[1]
    return dict(x=(torch.randn(shape, generator=g) * 1.5 + 0.7).to(dtype),
                residual=torch.randn(shape, generator=g).to(dtype),
                dout=torch.randn(shape, generator=g).to(dtype),
                weight=(torch.rand(channels, generator=g) + 0.5).to(param_dtype),
                bias=torch.randn(channels, generator=g).to(param_dtype),
                running_mean=torch.randn(channels, generator=g).to(param_dtype),
                running_var=(torch.rand(channels, generator=g) + 0.5).to(param_dtype))


def run_forward(impl, t: dict, training: bool, act: str, param, with_residual: bool, affine: bool):
    """(outputs, running_mean, running_var) of one forward on copies of the running statistics."""
    rm, rv = t["running_mean"].clone(), t["running_var"].clone()
    weight, bias = (t["weight"], t["bias"]) if affine else (None, None)
    if with_residual:
        out = impl.fused_bn_add_act(t["x"], t["residual"], weight, bias, rm, rv, training, 0.1, 1e-5, act, param)
    else:
        out = impl.fused_bn_act(t["x"], weight, bias, rm, rv, training, 0.1, 1e-5, act, param)
    return out, rm, rv


def saved_for_grad(act: str, out: torch.Tensor, pre: torch.Tensor) -> torch.Tensor | None:
    """What the activation's captured grad op reads: its output, its input, or nothing (scale)."""
    return {"output": out, "input": pre, None: None}[ACTIVATION_TABLE[act].saves]


def check_forward(t: dict, training: bool, act: str, param, with_residual: bool, affine: bool, tol: dict) -> None:
    got, got_rm, got_rv = run_forward(norm, t, training, act, param, with_residual, affine)
    want, want_rm, want_rv = run_forward(fused_norm, t, training, act, param, with_residual, affine)
    assert [None if g is None else (g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    assert_close_all(got, want, **tol)
    assert_close_all((got_rm, got_rv), (want_rm, want_rv), **tol)
    if not training:
        assert torch.equal(got_rm, t["running_mean"]) and torch.equal(got_rv, t["running_var"])


def check_backward(t: dict, training: bool, act: str, param, affine: bool, output_mask: list, tol: dict) -> None:
    # saved values come from the reference forward, so both sides differentiate the same point
    (out, pre, mean, rstd), _, _ = run_forward(fused_norm, t, training, act, param, False, affine)
    args = (t["dout"], saved_for_grad(act, out, pre), t["x"], t["weight"] if affine else None,
            t["running_mean"], t["running_var"], mean if training else None, rstd if training else None,
            training, 1e-5, output_mask, act, param)
    got, want = norm.fused_bn_act_grad(*args), fused_norm.fused_bn_act_grad(*args)
    assert [None if g is None else (g.shape, g.dtype) for g in got] == \
           [None if w is None else (w.shape, w.dtype) for w in want]
    assert_close_all(got, want, **tol)


@pytest.mark.parametrize("act, param", ACTIVATIONS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_forward_every_activation(interpret, act, param, training):
    t = make_inputs((3, 5, 4, 3))
    check_forward(t, training, act, param, with_residual=False, affine=True, tol=FP32)
    check_forward(t, training, act, param, with_residual=True, affine=True, tol=FP32)


@pytest.mark.parametrize("shape", [(7, 3), (2, 5, 7), (3, 6, 5, 5), (2, 3, 2, 3, 2)], ids=str)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["", "residual"])
def test_forward_ranks_and_without_affine(interpret, shape, training, with_residual):
    t = make_inputs(shape, seed=len(shape))
    check_forward(t, training, "relu", None, with_residual, affine=False, tol=FP32)
    check_forward(t, training, "relu", None, with_residual, affine=True, tol=FP32)


@pytest.mark.parametrize("act, param", ACTIVATIONS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_backward_every_activation(interpret, act, param, training):
    check_backward(make_inputs((3, 5, 4, 3)), training, act, param, affine=True, output_mask=[True, True, True],
                   tol=FP32)


@pytest.mark.parametrize("output_mask", [[True, False, False], [False, True, True], [False, False, True],
                                         [True, True, False]], ids=str)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-weight"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_backward_output_masks_and_without_weight(interpret, output_mask, affine, training):
    check_backward(make_inputs((2, 7, 3)), training, "silu", None, affine, output_mask, FP32)


@pytest.mark.parametrize("min_blocks", [1, 2])
def test_channels_split_into_chunks(interpret, monkeypatch, min_blocks):
    """Small blocks force several chunks per channel (and a ragged last chunk): the partial statistics merge exactly."""
    monkeypatch.setattr(norm, "STATS_MAX_BLOCK", 16)
    monkeypatch.setattr(norm, "MIN_BLOCKS_PER_CHUNK", min_blocks)
    t = make_inputs((4, 3, 5, 5))
    assert norm._reduction_split(100)["SPLIT"] == {1: 7, 2: 4}[min_blocks]
    check_forward(t, True, "relu", None, with_residual=True, affine=True, tol=FP32)
    check_backward(t, True, "relu", None, affine=True, output_mask=[True, True, True], tol=FP32)


def test_inputs_the_kernels_cannot_take_are_named(interpret):
    rm, rv = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match=r"rank >= 2 with channels in dim 1, got shape \(3,\)"):
        norm.fused_bn_act(torch.randn(3), None, None, rm, rv, True, 0.1, 1e-5, "relu", None)
    with pytest.raises(ValueError, match=r"at least one element per channel, got shape \(0, 3, 4\)"):
        norm.fused_bn_act(torch.randn(0, 3, 4), None, None, rm, rv, True, 0.1, 1e-5, "relu", None)


def test_variance_of_values_far_from_zero(interpret):
    """Two-pass chunk statistics: a mean of 1000 does not cancel a variance of 1e-4 (sum of squares would)."""
    g = torch.Generator().manual_seed(1)
    x = 1000.0 + 0.01 * torch.randn(4, 3, 6, 6, generator=g, dtype=torch.float64)
    rm, rv = torch.zeros(3), torch.ones(3)
    _, _, mean, rstd = norm.fused_bn_act(x.float(), None, None, rm, rv, True, 0.1, 1e-8, "relu", None)
    want_var = x.var(dim=(0, 2, 3), unbiased=False)
    torch.testing.assert_close(rstd.double(), (want_var + 1e-8).rsqrt(), rtol=1e-2, atol=0)
    torch.testing.assert_close(rv.double(), 0.9 + 0.1 * x.var(dim=(0, 2, 3)), rtol=1e-3, atol=0)


@pytest.mark.parametrize("dtype, param_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.float32)], ids=str)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_low_precision_inputs(interpret, dtype, param_dtype, training):
    """Outputs in the input dtype; mean/rstd, dweight/dbias and running stats in aten's dtypes (fp32 when mixed)."""
    t = make_inputs((3, 6, 5, 5), dtype, param_dtype)
    tol = LOW_PRECISION[dtype]
    check_forward(t, training, "relu", None, with_residual=True, affine=True, tol=tol)
    check_forward(t, training, "gelu", "tanh", with_residual=False, affine=False, tol=tol)
    check_backward(t, training, "relu", None, affine=True, output_mask=[True, True, True], tol=tol)
    check_backward(t, training, "gelu", "tanh", affine=False, output_mask=[True, False, True], tol=tol)


@functools.lru_cache(maxsize=None)
def cnn_trainer() -> fleetc.CompiledTrainer:
    """The zoo CNN compiled with both batch-norm fusions (and no other fusion)."""
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.fuse_bn_act_ops = True
    strategy.build_strategy.fuse_bn_add_act_ops = True
    return run_side_by_side("cnn", "sgd", steps=1, strategy=strategy).trainer


def test_zoo_cnn_shapes_forward_and_backward(interpret):
    """Every fused batch-norm op of the zoo CNN's training step, on inputs of its shapes, forward and backward."""
    program = cnn_trainer().program
    fused = [op for _, op in program.walk_ops() if op.type.startswith("fleetc.fused_bn")]
    assert len(fused) == 10
    for op in fused:
        if op.type == "fleetc.fused_bn_act_grad":
            continue  # checked from its forward op below, on the values that forward saved
        with_residual = op.type == "fleetc.fused_bn_add_act"
        t = make_inputs(tuple(program.var(op.args[0].name).shape))
        act, param = op.args[-2], op.args[-1]
        check_forward(t, True, act, param, with_residual, affine=op.args[2 if with_residual else 1] is not None,
                      tol=FP32)
        check_backward(t, True, act, param, affine=True, output_mask=[True, True, True], tol=FP32)


def test_kernel_sources_name_each_kernel(interpret):
    """dump-ir --kernels lists three kernels per training bn op and per grad op, named after the fused pattern."""
    program = cnn_trainer().program
    names = [k.name for k in program_kernels(program) if k.name.startswith("fused_bn")]
    assert names.count("fused_bn_relu_fwd") == 3 and names.count("fused_bn_add_relu_fwd") == 2
    assert names.count("fused_bn_relu_fwd_stats") == 3 and names.count("fused_bn_add_relu_fwd_stats_finalize") == 2
    assert names.count("fused_bn_relu_grad_reduce") == names.count("fused_bn_relu_grad_dx") == 5
    assert len(names) == 30
    assert "def fused_bn_add_relu_fwd(" in format_kernels(program)
    trainer = cnn_trainer()
    trainer(torch.randn(2, 3, 8, 8))  # builds the eval Program
    eval_names = [k.name for k in program_kernels(trainer.eval_program)]
    assert sorted(set(eval_names)) == ["fused_bn_add_relu_fwd", "fused_bn_relu_fwd"] and len(eval_names) == 5


def test_sources_are_cached_on_disk_and_cpu_tensors_take_the_reference(interpret, monkeypatch):
    monkeypatch.setattr(launch, "_MODULES", {})  # as in a fresh process: kernels loaded by earlier tests are forgotten
    t = make_inputs((2, 3, 4))
    act = ("leaky_relu", 0.05)
    dispatched = SimpleNamespace(fused_bn_act=resolve_callable("fleetc.fused_bn_act"))
    out, rm, rv = run_forward(dispatched, t, True, *act, False, True)
    want, want_rm, want_rv = run_forward(fused_norm, t, True, *act, False, True)
    assert_close_all((*out, rm, rv), (*want, want_rm, want_rv), rtol=0, atol=0)
    assert not cache_dir().exists()  # CPU tensors: the reference ran, no kernel was generated
    run_forward(norm, t, True, *act, False, True)
    files = {p.name: p.read_text() for p in cache_dir().glob("fused_bn_leaky_relu_*.py")}
    assert files == {f"{k.name}_{k.source_hash}.py": k.source for k in norm.forward_kernels(*act, False, True)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_launch_matches_the_reference(monkeypatch, tmp_path, dtype):
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tol = LOW_PRECISION.get(dtype, FP32)
    for shape in [(8, 16, 7, 7), (64, 32), (4, 64, 40, 40)]:
        cpu = make_inputs(shape, dtype)
        cuda = {k: v.cuda() for k, v in cpu.items()}
        for training in (True, False):
            dispatched = SimpleNamespace(fused_bn_add_act=resolve_callable("fleetc.fused_bn_add_act"))
            got, got_rm, got_rv = run_forward(dispatched, cuda, training, "relu", None, True, True)
            want, want_rm, want_rv = run_forward(fused_norm, cpu, training, "relu", None, True, True)
            assert_close_all([g.cpu() for g in (*got, got_rm, got_rv)], (*want, want_rm, want_rv), **tol)
            out, _, mean, rstd = want
            args = [cuda["dout"], out.cuda(), cuda["x"], cuda["weight"], cuda["running_mean"], cuda["running_var"],
                    mean.cuda() if training else None, rstd.cuda() if training else None, training, 1e-5,
                    [True, True, True], "relu", None]
            got = resolve_callable("fleetc.fused_bn_act_grad")(*args)
            want = fused_norm.fused_bn_act_grad(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
            assert_close_all([g.cpu() for g in got], want, **tol)
    assert list(tmp_path.glob("triton/fused_bn_add_relu_fwd_*.py"))


def compile_for_sm90(kernel, args: dict, constexprs: dict) -> bytes:
    """The kernel compiled by Triton for a CUDA target (no GPU needed): catches what the interpreter lets pass."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**args, **dict.fromkeys(constexprs, "constexpr")}
    return triton_compile(ASTSource(load_kernel(kernel), signature, constexprs),
                          target=GPUTarget("cuda", 90, 32)).asm["cubin"]


@pytest.mark.slow
@pytest.mark.parametrize("pointer", ["*fp32", "*bf16"])
def test_kernels_compile_to_cubin_without_a_gpu(monkeypatch, tmp_path, pointer):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "bin"))
    f32 = "*fp32"
    shape = dict(C=16, S=49)
    split = dict(R=392, SPLIT=2, CHUNK=256)
    stats, finalize, forward = norm.forward_kernels("gelu", "tanh", True, True)
    compiled = [
        compile_for_sm90(stats, dict(x=pointer, part_mean=f32, part_m2=f32), {**shape, **split, "BLOCK": 128}),
        compile_for_sm90(finalize, dict(part_mean=f32, part_m2=f32, mean_out=f32, rstd_out=f32, running_mean=pointer,
                                        running_var=pointer, momentum="fp32", eps="fp32"),
                         {**split, "SPLIT_BLOCK": 2}),
        compile_for_sm90(forward, dict(x=pointer, residual=pointer, weight=pointer, bias=pointer, mean=f32, stat=f32,
                                       out=pointer, pre=pointer, eps="fp32"),
                         {**shape, "NUMEL": 784, "BLOCK": 1024, "HAS_WEIGHT": True, "HAS_BIAS": True,
                          "STAT_IS_VAR": False}),
    ]
    reduce, finalize_grad, dx = norm.backward_kernels("silu", None, True)
    compiled += [
        compile_for_sm90(reduce, dict(dout=pointer, saved=pointer, x=pointer, mean=pointer, dpre=pointer,
                                      part_sum=f32, part_dot=f32), {**shape, **split, "BLOCK": 128}),
        compile_for_sm90(finalize_grad, dict(part_sum=f32, part_dot=f32, stat=pointer, weight=pointer,
                                             dweight=pointer, dbias=pointer, mean=pointer, coef=f32, eps="fp32"),
                         {"R": 392, "SPLIT": 2, "SPLIT_BLOCK": 2, "HAS_WEIGHT": True, "STAT_IS_VAR": True,
                          "TRAINING": False, "WRITE_DWEIGHT": True, "WRITE_DBIAS": True}),
        compile_for_sm90(dx, dict(dpre=pointer, x=pointer, coef=f32, dx=pointer), {**shape, "NUMEL": 784,
                                                                                   "BLOCK": 1024}),
    ]
    assert all(compiled)
