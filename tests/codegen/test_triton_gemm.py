"""The gemm epilogue's Triton kernels against the op references under TRITON_INTERPRET=1 (no GPU needed).

See test_triton_kernels.py for why setting TRITON_INTERPRET in a fixture is enough. Low-precision kernels
are compared with the fp32 reference rounded once, as they compute in fp32 and round on store.
"""
from __future__ import annotations

import functools
import itertools
import json

import pytest
import torch
import triton.language  # noqa: F401  (imported before TRITON_INTERPRET is set: the worst case, on purpose)
from conftest import run_side_by_side

import fleetc
from fleetc.cli import main
from fleetc.codegen.triton import gemm, program_kernels
from fleetc.codegen.triton.launch import cache_dir
from fleetc.ir.program import Ref
from fleetc.ir.registry import resolve_callable
from fleetc.ops import fused_gemm
from fleetc.ops.activations import ACTIVATIONS

FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=3e-2)
ACTS = [(None, None), ("relu", None), ("gelu", "none"), ("gelu", "tanh"), ("silu", None), ("sigmoid", None),
        ("tanh", None), ("leaky_relu", 0.2), ("scale", 0.5)]
MASKS = [list(mask) for mask in itertools.product([False, True], repeat=3) if any(mask)]


def gemm_operands(m: int, k: int, n: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """x [m,k], w_t [k,n] (the transposed view of a weight [n,k], as the captured Program passes it), bias [n]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype).t(),
            torch.randn(n, generator=g).to(dtype))


def saved_for(act: str | None, out: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
    """What the captured grad op reads: the activation's output or input (None: no act, or scale)."""
    saves = ACTIVATIONS[act].saves if act else None
    return {None: None, "output": out, "input": h}[saves]


def upcast(values):
    return tuple(v.float() if isinstance(v, torch.Tensor) else v for v in values)


def assert_matches_reference(got: tuple, want: tuple, dtype: torch.dtype, what: str) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None, f"{what} output {i}: expected None"
            continue
        assert (a.shape, a.dtype) == (b.shape, dtype), f"{what} output {i}: {a.shape} {a.dtype}"
        torch.testing.assert_close(a, b.to(dtype), **(FP32 if dtype == torch.float32 else BF16),
                                   msg=lambda m: f"{what} output {i}: {m}")


def check_forward(x, w_t, bias, out_shape, act, param, keep_pre_act=True) -> tuple:
    got = gemm.fused_gemm_epilogue(x, w_t, bias, out_shape, act, param, keep_pre_act)
    want = fused_gemm.fused_gemm_epilogue(*upcast((x, w_t, bias)), out_shape, act, param, keep_pre_act)
    assert_matches_reference(got, want, x.dtype, f"forward {act} {param}")
    return got


def check_backward(dout, saved, x, w_t, act, param, output_mask) -> None:
    got = gemm.fused_gemm_epilogue_grad(dout, saved, x, w_t, act, param, output_mask)
    want = fused_gemm.fused_gemm_epilogue_grad(*upcast((dout, saved, x, w_t)), act, param, output_mask)
    assert_matches_reference(got, want, x.dtype, f"backward {act} {param} {output_mask}")


@pytest.mark.parametrize("act, param", ACTS)
def test_forward_and_backward_match_the_reference_for_every_activation(interpret, act, param):
    """Odd sizes (M=5, K=7, N=3) inside one tile, then leading batch dims [2, 3, N] (M=6)."""
    for m, out_shape in ((5, None), (6, [2, 3, 3])):
        x, w_t, bias = gemm_operands(m, 7, 3)
        out, h = check_forward(x, w_t, bias, out_shape, act, param)
        if act is None:
            assert out is h  # as in the reference: no activation, one tensor
        dout = torch.randn(out.shape)
        check_backward(dout, saved_for(act, out, h), x, w_t, act, param, [True, True, True])


@pytest.mark.parametrize("act, param, name", [(None, None, "fused_gemm_bias"), ("relu", None, "fused_gemm_bias_relu"),
                                              ("gelu", "tanh", "fused_gemm_bias_gelu_tanh")])
def test_pre_activation_not_kept_is_neither_allocated_nor_stored(interpret, act, param, name):
    x, w_t, bias = gemm_operands(6, 7, 3)
    out, h = check_forward(x, w_t, bias, [2, 3, 3], act, param, keep_pre_act=False)
    assert h is None
    launcher = gemm.forward_launcher(x, w_t, bias, [2, 3, 3], act, param, False)
    assert launcher.outputs == [((2, 3, 3), torch.float32)]  # the one tensor the launch allocates
    kernel = gemm.forward_kernel(act, param, False)
    assert kernel.name == name and "h_out" not in kernel.source and kernel.source.count("tl.store(") == 1


def test_kept_pre_activation_has_a_kernel_of_its_own(interpret):
    kept, dropped = gemm.forward_kernel("gelu", "none", True), gemm.forward_kernel("gelu", "none", False)
    assert (kept.name, dropped.name) == ("fused_gemm_bias_gelu_keep_pre_act", "fused_gemm_bias_gelu")
    assert kept.source.count("tl.store(") == 2 and kept.source_hash != dropped.source_hash
    x, w_t, bias = gemm_operands(6, 7, 3)
    assert len(gemm.forward_launcher(x, w_t, bias, None, "gelu", "none", True).outputs) == 2
    # without an activation the pre-activation is the output itself: one store, one allocation, whether kept or not
    assert gemm.forward_kernel(None, None, True).source == gemm.forward_kernel(None, None, False).source
    out, h = check_forward(x, w_t, bias, None, None, None, keep_pre_act=True)
    assert out is h


@pytest.mark.parametrize("output_mask", MASKS, ids=lambda mask: "".join("1" if b else "0" for b in mask))
@pytest.mark.parametrize("act, param", [(None, None), ("gelu", "tanh"), ("relu", None)])
def test_backward_computes_exactly_the_masked_outputs(interpret, act, param, output_mask):
    x, w_t, bias = gemm_operands(5, 7, 3)
    out, h = fused_gemm.fused_gemm_epilogue(x, w_t, bias, [5, 1, 3], act, param, True)
    check_backward(torch.randn(out.shape), saved_for(act, out, h), x, w_t, act, param, output_mask)


def test_nothing_asked_launches_nothing(interpret):
    x, w_t, _ = gemm_operands(5, 7, 3)
    assert gemm.fused_gemm_epilogue_grad(torch.randn(5, 3), None, x, w_t, None, None, [False] * 3) == (None,) * 3
    assert not cache_dir().exists()


@pytest.mark.parametrize("act, param", [("gelu", "none"), ("relu", None)])
def test_sizes_spanning_several_tiles_in_every_dimension(interpret, act, param):
    """M, N > one output tile and K, N, M > one depth step: masks on partial tiles, the K loop, dBias over M blocks."""
    assert gemm.block_sizes(("M", 70), ("N", 66), ("K", 45)) == {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
    x, w_t, bias = gemm_operands(70, 45, 66, seed=1)
    out, h = check_forward(x, w_t, bias, [7, 10, 66], act, param)
    check_backward(torch.randn(out.shape), saved_for(act, out, h), x, w_t, act, param, [True, True, True])


@pytest.mark.parametrize("act, param", [(None, None), ("gelu", "none")])
def test_strided_operands(interpret, act, param):
    """x a column slice, w_t contiguous (not a transposed view), bias, dout and h every other element."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 20, generator=g)[:, 3:10]
    w_t, bias = torch.randn(7, 5, generator=g), torch.randn(10, generator=g)[::2]
    out, h = check_forward(x, w_t, bias, [3, 2, 5], act, param)
    dout = torch.randn(3, 2, 10, generator=g)[..., ::2]
    saved = torch.zeros(3, 2, 10)[..., ::2].copy_(h) if act else None
    check_backward(dout, saved, x, w_t, act, param, [True, True, True])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # tanh's exp overflows to inf for large |x|; the result is exact
@pytest.mark.parametrize("act, param", [(None, None), ("relu", None), ("gelu", "tanh"), ("sigmoid", None)])
def test_bfloat16(interpret, act, param):
    x, w_t, bias = gemm_operands(6, 24, 18, torch.bfloat16, seed=3)
    out, h = check_forward(x, w_t, bias, [2, 3, 18], act, param)
    dout = torch.randn(out.shape).to(torch.bfloat16)
    check_backward(dout, saved_for(act, out, h), x, w_t, act, param, [True, True, True])


@functools.lru_cache(maxsize=None)
def zoo_gemm_program(zoo_name: str):
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.fuse_gemm_epilogue = True
    return run_side_by_side(zoo_name, "sgd", steps=1, strategy=strategy).trainer.program


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # tanh's exp overflows to inf for large |x|; the result is exact
def test_zoo_gemm_ops_run_their_kernels(interpret):
    """Each fused gemm op of these training Programs (relu/none, gelu with batch dims, tanh with no dX), on random
    inputs of its recorded shapes; cnn and loss_dict have only the same kinds of Linear."""
    g = torch.Generator().manual_seed(4)
    checked = {}
    for zoo_name in ("mlp", "gpt", "unused_param"):
        program = zoo_gemm_program(zoo_name)

        def tensor(arg):
            return torch.randn(program.var(arg.name).shape, generator=g) if isinstance(arg, Ref) else arg

        for _, op in program.walk_ops():
            if op.type == "fleetc.fused_gemm_epilogue":
                check_forward(*(tensor(a) for a in op.args))
            elif op.type == "fleetc.fused_gemm_epilogue_grad":
                check_backward(*(tensor(a) for a in op.args))
            else:
                continue
            checked[zoo_name] = checked.get(zoo_name, 0) + 1
    assert checked == {"mlp": 6, "gpt": 16, "unused_param": 2}  # one forward and one backward op per Linear
    # gelu's grad reads the pre-activation; no other zoo activation's does
    assert {op.args[4::2] for zoo_name in ("mlp", "gpt", "unused_param")  # (act, keep_pre_act)
            for _, op in zoo_gemm_program(zoo_name).walk_ops() if op.type == "fleetc.fused_gemm_epilogue"} == {
        (None, False), ("relu", False), ("gelu", True), ("tanh", False)}


def test_kernel_names_and_sources_per_op(interpret):
    program = zoo_gemm_program("mlp")
    names = [k.name for k in program_kernels(program)]
    # forward fc1, fc2 (relu) and out; backward: fc1's input needs no dX
    assert sorted(names) == sorted(["fused_gemm_bias_relu", "fused_gemm_bias_relu", "fused_gemm_bias",
                                    "fused_gemm_bias_grad_dx", "fused_gemm_bias_grad_dw_dbias",
                                    "fused_gemm_bias_relu_grad_dx", "fused_gemm_bias_relu_grad_dw_dbias",
                                    "fused_gemm_bias_relu_grad_dw_dbias"])
    assert gemm.grad_dw_dbias_kernel("gelu", "tanh", False, True).name == "fused_gemm_bias_gelu_tanh_grad_dbias"
    assert (gemm.forward_kernel("leaky_relu", 0.2, False).source_hash
            != gemm.forward_kernel("leaky_relu", 0.1, False).source_hash)
    gpt_forward = [k.name for k in program_kernels(zoo_gemm_program("gpt")) if "_grad" not in k.name]
    assert sorted(gpt_forward) == ["fused_gemm_bias"] * 6 + ["fused_gemm_bias_gelu_keep_pre_act"] * 2


def test_kernels_are_cached_on_disk_by_source_hash(interpret):
    x, w_t, bias = gemm_operands(5, 7, 3)
    # a slope no other test loads in this process
    gemm.fused_gemm_epilogue(x, w_t, bias, None, "leaky_relu", 0.375, False)
    kernel = gemm.forward_kernel("leaky_relu", 0.375, False)
    files = sorted(cache_dir().glob("fused_gemm_*.py"))
    assert [f.name for f in files] == [f"fused_gemm_bias_leaky_relu_{kernel.source_hash}.py"]
    assert files[0].read_text() == kernel.source


def test_cpu_tensors_take_the_reference_path(interpret):
    x, w_t, bias = gemm_operands(5, 7, 3)
    out, h = resolve_callable("fleetc.fused_gemm_epilogue")(x, w_t, bias, None, "relu", None, False)
    assert torch.equal(out, torch.relu(torch.addmm(bias, x, w_t))) and h is None
    assert not cache_dir().exists()  # no kernel was generated for CPU tensors


def test_dump_ir_prints_the_gemm_kernels(capsys, tmp_path):
    strategy_file = tmp_path / "strategy.json"
    strategy_file.write_text(json.dumps({"build_strategy": {"fuse_gemm_epilogue": True}}))
    assert main(["dump-ir", "cli_factories:mlp", "--strategy", str(strategy_file), "--kernels"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.count("# kernel fused_gemm_bias") == 8 and "def fused_gemm_bias_relu_grad_dw_dbias(" in out


_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_gemm_kernel_compiles_to_cubin_without_a_gpu(monkeypatch, tmp_path, dtype):
    """Triton compiles each kernel for sm_90 on this CPU machine: what the interpreter does not check (tl.dot tile
    minimums, dtypes, the dBias branch) is checked by the real compiler."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "bin"))

    def compile_launcher(launcher, tensors):
        specs = [_POINTER_TYPES[t.dtype] for t in tensors] + [_POINTER_TYPES[d] for _, d in launcher.outputs]
        pointers = [name for name in launcher.fn.arg_names if name not in launcher.constexprs]
        signature = dict(zip(pointers, specs)) | dict.fromkeys(launcher.constexprs, "constexpr")
        compiled = triton_compile(ASTSource(launcher.fn, signature, launcher.constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"]

    x, w_t, bias = (t.to(device="meta") for t in gemm_operands(70, 45, 66, dtype))
    for act, param in [(None, None), ("gelu", "tanh"), ("relu", None)]:
        for keep_pre_act in (False, True) if act == "gelu" else (False,):
            compile_launcher(gemm.forward_launcher(x, w_t, bias, [7, 10, 66], act, param, keep_pre_act),
                             (x, w_t, bias))
        dout = torch.empty(70, 66, dtype=dtype, device="meta")
        g_inputs = (dout, dout) if act else (dout,)
        for mask in ((True, True, True), (False, False, True)):
            dx_launcher, dw_launcher = gemm.grad_launchers(g_inputs, x, w_t, act, param, mask)
            if dx_launcher:
                compile_launcher(dx_launcher, (*g_inputs, w_t))
            compile_launcher(dw_launcher, (*g_inputs, x) if mask[1] else g_inputs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_launch_matches_the_reference(monkeypatch, tmp_path, dtype):
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w_t, bias = (t.cuda() for t in gemm_operands(70, 45, 66, dtype))
    for act, param in ACTS:
        for keep_pre_act in (False, True):
            got = resolve_callable("fleetc.fused_gemm_epilogue")(x, w_t, bias, [7, 10, 66], act, param, keep_pre_act)
            want = fused_gemm.fused_gemm_epilogue(*upcast((x.cpu(), w_t.cpu(), bias.cpu())), [7, 10, 66], act,
                                                  param, keep_pre_act)
            assert_matches_reference(tuple(None if t is None else t.cpu() for t in got), want, dtype,
                                     f"cuda forward {act} keep_pre_act={keep_pre_act}")
        dout = torch.randn(7, 10, 66, device="cuda").to(dtype)
        saved = saved_for(act, *got)  # from the kept pre-activation (the last forward)
        got = resolve_callable("fleetc.fused_gemm_epilogue_grad")(dout, saved, x, w_t, act, param, [True] * 3)
        want = fused_gemm.fused_gemm_epilogue_grad(*upcast((dout.cpu(), None if saved is None else saved.cpu(),
                                                            x.cpu(), w_t.cpu())), act, param, [True] * 3)
        assert_matches_reference(tuple(t.cpu() for t in got), want, dtype, f"cuda backward {act}")
    assert list(tmp_path.glob("triton/fused_gemm_*.py")), "no kernel source was written to the cache"
