"""Every Triton kernel the zoo produces, checked against its reference under TRITON_INTERPRET=1 (no GPU needed).

Triton 3.9 reads TRITON_INTERPRET when `@triton.jit` decorates a function. fleetc decorates a kernel when
it first loads the kernel's module (cached per interpret mode), and generated kernels call only Triton
builtins and helpers jitted in their own module, so setting the variable in the test is enough even
when triton was imported earlier (torch imports it during capture in a full run; this module imports it
up front to make that order certain).
"""
from __future__ import annotations

import functools
import json

import pytest
import torch
import triton.language  # noqa: F401  (imported before TRITON_INTERPRET is set: the worst case, on purpose)
from conftest import run_side_by_side
from zoo import ZOO

import fleetc
from fleetc.cli import main
from fleetc.codegen.triton import format_kernels, program_kernels
from fleetc.codegen.triton.kernel import generate_kernel
from fleetc.codegen.triton.launch import (
    cache_dir,
    launch_spec,
    load_kernel,
    run_fused_elementwise,
)
from fleetc.ir.program import OpRole
from fleetc.ir.registry import resolve_callable
from fleetc.ops import pointwise as lowering
from fleetc.ops.fused_elementwise import operand, reference

FUSED = "fleetc.fused_elementwise"
LOW_PRECISION = {torch.bfloat16: dict(rtol=2e-2, atol=2e-3), torch.float16: dict(rtol=2e-3, atol=1e-4)}


@functools.lru_cache(maxsize=None)
def zoo_program(zoo_name: str):
    """The zoo model's training Program compiled with auto fusion alone (no named bn+add+act fusion)."""
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.enable_auto_fusion = True
    strategy.build_strategy.fuse_bn_add_act_ops = False
    return run_side_by_side(zoo_name, "sgd", steps=1, strategy=strategy).trainer.program


def zoo_fused_ops(zoo_name: str) -> list[tuple]:
    """(op, [(shape, dtype) per input]) for every fused op of the zoo model's training Program."""
    program = zoo_program(zoo_name)
    return [(op, [(tuple(program.var(r.name).shape), program.var(r.name).dtype) for r in op.args])
            for _, op in program.walk_ops() if op.type == FUSED]


def make_input(shape: tuple, dtype: str, float_dtype: torch.dtype, strided: bool, g: torch.Generator):
    if dtype == "bool":
        return torch.rand(shape, generator=g) > 0.3
    if strided and len(shape) >= 2:  # same values seen through a permuted, non-contiguous layout
        reversed_dims = tuple(range(len(shape)))[::-1]
        return torch.randn(shape[::-1], generator=g).to(float_dtype).permute(reversed_dims)
    return torch.randn(shape, generator=g).to(float_dtype)


def as_tuple(value):
    return value if isinstance(value, tuple) else (value,)


def check_kernel(inputs: tuple, steps: tuple, results: tuple, name: str, tolerance: dict | None = None) -> None:
    """Kernel output = reference output: fp32 inputs exactly as the reference sees them; low precision against
    the fp32 reference rounded once (the kernel computes in fp32 and rounds on store)."""
    got = as_tuple(run_fused_elementwise(*inputs, steps=steps, results=results, name=name))
    upcast = tuple(t.float() if t.is_floating_point() else t for t in inputs)
    want = as_tuple(reference(*upcast, steps=steps, results=results))
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"{name} output {i}: shape {a.shape} != {b.shape}"
        expected = b.to(a.dtype) if b.is_floating_point() else b
        torch.testing.assert_close(a, expected, **(tolerance or dict(rtol=1e-5, atol=1e-5)),
                                   msg=lambda m: f"{name} output {i}: {m}")


@pytest.mark.parametrize("variant", ["float32", "float32-strided", "bfloat16", "float16"])
@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_every_zoo_kernel_matches_its_reference(interpret, zoo_name, variant):
    float_dtype = getattr(torch, variant.split("-")[0])
    g = torch.Generator().manual_seed(0)
    fused = zoo_fused_ops(zoo_name)
    assert fused, f"{zoo_name} produced no fused op"
    for op, input_specs in fused:
        inputs = tuple(make_input(shape, dtype, float_dtype, variant.endswith("strided"), g)
                       for shape, dtype in input_specs)
        check_kernel(inputs, op.kwargs["steps"], op.kwargs["results"], op.kwargs["name"],
                     LOW_PRECISION.get(float_dtype))


def test_zoo_kernels_cover_forward_and_backward_groups():
    roles = {op.role for name in ZOO for op, _ in zoo_fused_ops(name)}
    assert {OpRole.FORWARD, OpRole.BACKWARD} <= roles


def _step(op_type: str, *args, **kwargs) -> tuple:
    return (op_type, args, tuple(kwargs.items()))


def test_broadcast_inputs_odd_sizes_and_several_outputs(interpret):
    """Inputs of shapes [13,1], [1,37] and [] broadcast to [13,37]: masking, stride-0 loads, two results."""
    steps = (_step("aten.add.Tensor", operand(0), operand(1)),
             _step("aten.gelu.default", operand(3), approximate="tanh"),
             _step("aten.mul.Tensor", operand(4), operand(2)))
    inputs = (torch.randn(13, 1), torch.randn(1, 37), torch.tensor(0.5))
    check_kernel(inputs, steps, (4, 5), "fused_add_gelu_mul_0")
    check_kernel((torch.randn(13, 37), torch.randn(37).expand(13, 37), torch.tensor(2.0)), steps, (4, 5),
                 "fused_add_gelu_mul_0")


def test_reduction_over_non_adjacent_dims_with_large_extents(interpret):
    """sub → exp → mean over dims (0, 2) of [5, 3, 140] (reduced extent 700 > one BLOCK_N), without keepdim."""
    steps = (_step("aten.sub.Tensor", operand(0), operand(1)),
             _step("aten.exp.default", operand(2)),
             _step("aten.mean.dim", operand(3), (0, -1)))
    check_kernel((torch.randn(5, 3, 140), torch.randn(140)), steps, (3, 4), "fused_sub_exp_mean_0")
    by_keyword = (*steps[:2], _step("aten.sum.dim_IntList", operand(3), dim=(1,), keepdim=True))
    check_kernel((torch.randn(5, 3, 140), torch.randn(140)), by_keyword, (4,), "fused_sub_exp_sum_0")


def test_bool_results_and_where(interpret):
    steps = (_step("aten.ge.Scalar", operand(0), 0.0),
             _step("aten.where.self", operand(2), operand(0), operand(1)),
             _step("aten.masked_fill.Scalar", operand(3), operand(2), float("-inf")))
    check_kernel((torch.randn(3000), torch.randn(3000)), steps, (2, 4), "fused_ge_where_masked_fill_0")


X, Y, POSITIVE, MASK = (operand(i) for i in range(4))
# One call of every op the Triton lowering table knows; the test checks the table is fully covered.
LOWERING_CASES = [
    ("aten.add.Tensor", (X, Y), {"alpha": 2.0}), ("aten.add.Scalar", (X, 1.5), {}),
    ("aten.sub.Tensor", (X, Y), {}), ("aten.sub.Scalar", (X, 1.5), {}), ("aten.rsub.Scalar", (X, 1.5), {}),
    ("aten.mul.Tensor", (X, Y), {}), ("aten.mul.Scalar", (X, 3.0), {}),
    ("aten.div.Tensor", (X, POSITIVE), {}), ("aten.div.Scalar", (X, 3.0), {}),
    ("aten.neg.default", (X,), {}), ("aten.reciprocal.default", (POSITIVE,), {}), ("aten.abs.default", (X,), {}),
    ("aten.exp.default", (X,), {}), ("aten.log.default", (POSITIVE,), {}), ("aten.sqrt.default", (POSITIVE,), {}),
    ("aten.rsqrt.default", (POSITIVE,), {}), ("aten.pow.Tensor_Scalar", (X, 2), {}),
    ("aten.pow.Tensor_Scalar", (POSITIVE, 0.5), {}), ("aten.pow.Tensor_Scalar", (POSITIVE, -1.0), {}),
    ("aten.relu.default", (X,), {}), ("aten.threshold_backward.default", (X, Y, 0.0), {}),
    ("aten.leaky_relu.default", (X, 0.2), {}), ("aten.leaky_relu_backward.default", (X, Y, 0.2, False), {}),
    ("aten.sigmoid.default", (X,), {}), ("aten.sigmoid_backward.default", (X, Y), {}),
    ("aten.tanh.default", (X,), {}), ("aten.tanh_backward.default", (X, Y), {}),
    ("aten.silu.default", (X,), {}), ("aten.silu_backward.default", (X, Y), {}),
    ("aten.gelu.default", (X,), {}), ("aten.gelu.default", (X,), {"approximate": "tanh"}),
    ("aten.gelu_backward.default", (X, Y), {}), ("aten.gelu_backward.default", (X, Y), {"approximate": "tanh"}),
    ("aten.native_dropout_backward.default", (X, MASK, 1.25), {}),
    ("aten.masked_fill.Scalar", (X, MASK, -1.0), {}), ("aten.where.self", (MASK, X, Y), {}),
    ("aten.bitwise_not.default", (MASK,), {}),
    ("aten.eq.Scalar", (X, 0.0), {}), ("aten.ne.Scalar", (X, 0.0), {}), ("aten.gt.Scalar", (X, 0.0), {}),
    ("aten.ge.Scalar", (X, 0.0), {}), ("aten.lt.Scalar", (X, 0.0), {}), ("aten.le.Scalar", (X, 0.0), {}),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked-off tail lanes divide by the zeros loaded there
def test_every_lowering_matches_its_aten_op(interpret):
    assert {case[0] for case in LOWERING_CASES} == set(lowering._LOWERINGS)
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(7, 5, generator=g), torch.randn(7, 5, generator=g),
              torch.rand(7, 5, generator=g) + 0.1, torch.rand(7, 5, generator=g) > 0.5)
    inputs[0][0, :2] = 0.0  # exact zeros: relu/threshold and comparison edges
    for i, (op_type, args, kwargs) in enumerate(LOWERING_CASES):
        name = f"fused_{op_type.split('.')[1]}_{i}"
        check_kernel(inputs, (_step(op_type, *args, **kwargs),), (4,), name, dict(rtol=1e-5, atol=1e-6))


def test_kernel_sources_are_cached_on_disk_by_hash(interpret):
    steps = (_step("aten.add.Tensor", operand(0), operand(1)), _step("aten.relu.default", operand(2)))
    run_fused_elementwise(torch.randn(8), torch.randn(8), steps=steps, results=(3,), name="fused_add_relu_0")
    files = sorted(cache_dir().glob("fused_add_relu_0_*.py"))
    assert len(files) == 1
    kernel = generate_kernel("fused_add_relu_0", steps, (3,), ("float32", "float32"), 1)
    assert files[0].name == f"fused_add_relu_0_{kernel.source_hash}.py"
    assert files[0].read_text() == kernel.source
    assert load_kernel(kernel) is load_kernel(kernel)


def test_cpu_tensors_take_the_reference_path(interpret):
    steps = (_step("aten.add.Tensor", operand(0), operand(1)), _step("aten.relu.default", operand(2)))
    a, b = torch.randn(4), torch.randn(4)
    out = resolve_callable(FUSED)(a, b, steps=steps, results=(3,), name="fused_add_relu_0")
    assert torch.equal(out, torch.relu(a + b))
    assert not cache_dir().exists()  # no kernel was generated for CPU tensors


def test_dump_ir_prints_the_kernels(capsys, tmp_path):
    strategy_file = tmp_path / "strategy.json"
    strategy_file.write_text(json.dumps({"build_strategy": {"enable_auto_fusion": True}}))
    code = main(["dump-ir", "cli_factories:mlp", "--strategy", str(strategy_file), "--kernels"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    program_text, _, kernels = out.partition("# kernel ")
    assert "fleetc.fused_elementwise(" in program_text
    assert out.count("# kernel fused_") == 2 and out.count("import triton\n") == 2
    assert "def fused_threshold_backward_sum_0(" in kernels and "source sha256:" in kernels
    assert main(["dump-ir", "cli_factories:mlp", "--kernels", "--format", "json"]) == 2


def test_format_kernels_names_each_kernel_with_its_hash():
    program = zoo_program("mlp")
    kernels = program_kernels(program)
    assert [k.name for k in kernels] == [op.kwargs["name"] for op, _ in zoo_fused_ops("mlp")]
    text = format_kernels(program)
    assert text.startswith(f"# kernel fused_threshold_backward_sum_0  source sha256:{kernels[0].source_hash}\n")


_POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.bool: "*i1"}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_zoo_kernel_compiles_to_cubin_without_a_gpu(monkeypatch, tmp_path, dtype):
    """Triton compiles for a CUDA target (sm_90) on this CPU machine: the non-interpreted path is checked too."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "bin"))
    seen = set()
    for zoo_name in sorted(ZOO):
        for op, input_specs in zoo_fused_ops(zoo_name):
            inputs = tuple(torch.empty(shape, dtype=torch.bool if d == "bool" else dtype, device="meta")
                           for shape, d in input_specs)
            spec = launch_spec(op.kwargs["name"], op.kwargs["steps"], op.kwargs["results"], inputs)
            if spec.kernel.source.replace(spec.kernel.name, "K") in seen:
                continue  # same kernel under another name
            seen.add(spec.kernel.source.replace(spec.kernel.name, "K"))
            signature = {f"in{k}": _POINTER_TYPES[t.dtype] for k, t in enumerate(inputs)}
            signature |= {f"out{m}": _POINTER_TYPES[dt] for m, (_, dt) in enumerate(spec.outputs)}
            signature |= dict.fromkeys(spec.constexprs, "constexpr")
            compiled = triton_compile(ASTSource(load_kernel(spec.kernel), signature, spec.constexprs),
                                      target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"], f"{op.kwargs['name']}: no cubin"
    assert len(seen) >= 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("zoo_name", ["cnn", "gpt"])
def test_training_on_cuda_runs_the_triton_kernels(zoo_name, monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)
    for op, input_specs in zoo_fused_ops(zoo_name):
        inputs = tuple(make_input(shape, dtype, torch.float32, False, g).cuda() for shape, dtype in input_specs)
        got = as_tuple(resolve_callable(FUSED)(*inputs, steps=op.kwargs["steps"], results=op.kwargs["results"],
                                         name=op.kwargs["name"]))
        want = as_tuple(reference(*(t.cpu() for t in inputs), steps=op.kwargs["steps"],
                                  results=op.kwargs["results"]))
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)
    assert list(tmp_path.glob("triton/fused_*.py")), "no kernel source was written to the cache"
