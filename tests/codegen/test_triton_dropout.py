"""Philox dropout: the torch reference against `tl.rand`, the Triton kernels against the reference (exact, under
TRITON_INTERPRET=1), the keep mask's statistics, and a real CUDA launch where a GPU exists."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton.language  # noqa: F401  (imported before TRITON_INTERPRET is set, as in test_triton_kernels.py)

from fleetc.codegen.triton import dropout, launch
from fleetc.codegen.triton.dropout import (
    FORWARD_KERNEL,
    MUL_KERNEL,
    run_fused_dropout_add_philox,
    run_philox_dropout_mul,
)
from fleetc.codegen.triton.launch import cache_dir, load_kernel
from fleetc.ir.registry import resolve_callable
from fleetc.ops.dropout_philox import (
    dropout_scale,
    fused_dropout_add_philox,
    keep_mask,
    philox_dropout_mul,
    philox_uniform,
)

RATES = [0.0, 0.1, 0.5, 0.999, 1.0]
LOW_PRECISION = {torch.bfloat16: dict(rtol=2e-2, atol=2e-3), torch.float16: dict(rtol=2e-3, atol=1e-4)}


def test_reference_draws_exactly_what_tl_rand_draws():
    """tl.rand itself only runs interpreted when TRITON_INTERPRET is set before triton is imported: a subprocess."""
    script = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch, triton, triton.language as tl
        from fleetc.ops.dropout_philox import philox_uniform

        @triton.jit
        def draw(state, out, N: tl.constexpr, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            u = tl.rand(tl.load(state), tl.load(state + 1) + offs.to(tl.int64))
            tl.store(out + offs, u, mask=offs < N)

        # a 63-bit seed, a counter crossing 2**32 (high word), a negative seed, seed 0
        for seed, offset in [(8_412_345_678_901_234_567, 7), (5, 2**32 - 100), (-3, 0), (0, 0)]:
            state, n = torch.tensor([seed, offset]), 3000
            out = torch.empty(n)
            draw[(3,)](state, out, N=n, BLOCK=1024)
            assert torch.equal(out, philox_uniform(state, n)), (seed, offset)
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def _forward_both(x, residual, p, train, seed=11):
    torch.manual_seed(seed)
    got = run_fused_dropout_add_philox(x, residual, p, train)
    torch.manual_seed(seed)
    return got, fused_dropout_add_philox(x, residual, p, train)


@pytest.mark.parametrize("p", RATES)
def test_forward_kernel_equals_the_reference_with_the_same_seed(interpret, p):
    x, residual = torch.randn(37, 53), torch.randn(37, 53)
    (out, state), (want, want_state) = _forward_both(x, residual, p, True)
    assert torch.equal(state, want_state) and state[1] == 0  # same draw from the generator
    assert torch.equal(out, want)
    # and the reference fed the same state: the mask the kernel used, applied by plain torch
    keep = keep_mask(state, x.shape, p)
    assert torch.equal(out, residual + torch.where(keep, x * dropout_scale(p), 0.0))


@pytest.mark.parametrize("p", RATES)
def test_backward_kernel_regenerates_the_forward_mask(interpret, p):
    """Dropping ones onto zeros shows the forward kernel's mask; the gradient kernel must keep exactly those."""
    shape = (3, 5, 67)
    (out, state), _ = _forward_both(torch.ones(shape), torch.zeros(shape), p, True)
    used = out != 0
    dout = torch.randn(shape)
    scale = dropout_scale(p)
    dx = run_philox_dropout_mul(dout, state, p, True, scale)
    assert torch.equal(dx, torch.where(used, dout * scale, 0.0))
    assert torch.equal(dx, philox_dropout_mul(dout, state, p, True, scale))
    if 0 < p < 1:
        assert 0 < used.sum() < used.numel()


def test_backward_equals_autograd_through_the_reference_given_the_same_state():
    x, residual = torch.randn(9, 31, requires_grad=True), torch.randn(9, 31)
    state = torch.tensor([123_456_789, 5])
    keep = keep_mask(state, x.shape, 0.3)
    out = residual + torch.where(keep, x * dropout_scale(0.3), 0.0)
    dout = torch.randn(9, 31)
    out.backward(dout)
    assert torch.equal(x.grad, philox_dropout_mul(dout, state, 0.3, True, dropout_scale(0.3)))


def test_offset_continues_the_seed_stream(interpret):
    seed, n, k = 987_654_321, 300, 37
    dout = torch.ones(n)
    from_zero = run_philox_dropout_mul(dout, torch.tensor([seed, 0]), 0.5, True, 2.0)
    from_k = run_philox_dropout_mul(dout[k:], torch.tensor([seed, k]), 0.5, True, 2.0)
    assert torch.equal(from_k, from_zero[k:])
    assert torch.equal(philox_uniform(torch.tensor([seed, k]), n - k), philox_uniform(torch.tensor([seed, 0]), n)[k:])


def test_eval_mode_draws_nothing_and_passes_through(interpret):
    x, residual = torch.randn(40), torch.randn(40)
    (out, state), (want, want_state) = _forward_both(x, residual, 0.5, False)
    after_eval = torch.rand(3)
    torch.manual_seed(11)  # the seed _forward_both set: no random number was drawn since
    assert torch.equal(after_eval, torch.rand(3))
    assert torch.equal(out, residual + x) and torch.equal(want, residual + x)
    assert state.tolist() == want_state.tolist() == [0, 0]
    dout = torch.randn(40)
    assert torch.equal(run_philox_dropout_mul(dout, state, 0.5, False, 1.0), dout)
    assert torch.equal(philox_dropout_mul(dout, state, 0.5, False, 1.0), dout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_kernels_round_the_fp32_result_once(interpret, dtype):
    x, residual, dout = torch.randn(17, 29).to(dtype), torch.randn(17, 29).to(dtype), torch.randn(17, 29).to(dtype)
    (out, state), _ = _forward_both(x, residual, 0.2, True)
    want, _ = _forward_both(x.float(), residual.float(), 0.2, True)[1]
    assert out.dtype == dtype
    torch.testing.assert_close(out, want.to(dtype), **LOW_PRECISION[dtype])
    dx = run_philox_dropout_mul(dout, state, 0.2, True, 1.25)
    torch.testing.assert_close(dx, philox_dropout_mul(dout.float(), state, 0.2, True, 1.25).to(dtype),
                               **LOW_PRECISION[dtype])


def test_float64_is_computed_in_float64(interpret):
    x, residual, dout = (torch.randn(11, 7, dtype=torch.float64) for _ in range(3))
    (out, state), (want, _) = _forward_both(x, residual, 0.3, True)
    assert out.dtype == torch.float64 and torch.equal(out, want)
    assert torch.equal(run_philox_dropout_mul(dout, state, 0.3, True, 1 / 0.7),
                       philox_dropout_mul(dout, state, 0.3, True, 1 / 0.7))


def test_non_contiguous_and_broadcast_inputs(interpret):
    x, residual = torch.randn(29, 13).t(), torch.randn(13, 29)
    (out, state), (want, _) = _forward_both(x, residual, 0.4, True)
    assert torch.equal(out, want)
    (broadcast_out, _), (want, _) = _forward_both(x, torch.randn(29), 0.4, True)
    assert torch.equal(broadcast_out, want)
    dout = torch.randn(29, 13).t()
    want_dx = philox_dropout_mul(dout, state, 0.4, True, 2.5)
    assert torch.equal(run_philox_dropout_mul(dout, state, 0.4, True, 2.5), want_dx)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_scaling_over_many_elements(interpret, p):
    """Kernel over 2**13 elements, reference over 2**19: keep rate 1 - p within 5 sigma, kept values scaled by
    exactly 1 / (1 - p), the mean unbiased."""
    for run, n in ((run_fused_dropout_add_philox, 2**13), (fused_dropout_add_philox, 2**19)):
        torch.manual_seed(0)
        out, _ = run(torch.ones(n), torch.zeros(n), p, True)
        kept = out != 0
        sigma = ((1 - p) * p / n) ** 0.5
        assert abs(kept.float().mean().item() - (1 - p)) < 5 * sigma, run
        assert torch.equal(out[kept], torch.full_like(out[kept], dropout_scale(p)))
        assert abs(out.mean().item() - 1.0) < 5 * sigma / (1 - p)


def test_uniform_draws_fill_unit_interval_evenly_and_seeds_are_independent():
    n, bins = 2**19, 16
    u = philox_uniform(torch.tensor([42, 0]), n)
    assert 0.0 <= u.min().item() and u.max().item() < 1.0
    counts = torch.histc(u, bins=bins, min=0.0, max=1.0)
    sigma = (n / bins * (1 - 1 / bins)) ** 0.5
    assert (counts - n / bins).abs().max().item() < 5 * sigma
    other = philox_uniform(torch.tensor([43, 0]), n)
    both_kept = ((u >= 0.5) & (other >= 0.5)).float().mean().item()
    assert abs(both_kept - 0.25) < 5 * (0.25 * 0.75 / n) ** 0.5  # a neighbouring seed draws an independent mask


def test_cpu_tensors_run_the_reference_and_kernels_are_cached_by_hash(interpret, monkeypatch):
    monkeypatch.setattr(launch, "_MODULES", {})  # forget kernels loaded by earlier tests (from other cache dirs)
    monkeypatch.setattr(dropout, "_LAUNCHERS", {})
    x, residual = torch.randn(8), torch.randn(8)
    torch.manual_seed(1)
    out, state = resolve_callable("fleetc.fused_dropout_add_philox")(x, residual, 0.5, True)
    assert not cache_dir().exists()  # CPU tensors: the reference, no kernel generated
    torch.manual_seed(1)
    assert torch.equal(run_fused_dropout_add_philox(x, residual, 0.5, True)[0], out)
    run_philox_dropout_mul(x, state, 0.5, True, 2.0)
    for kernel in (FORWARD_KERNEL, MUL_KERNEL):
        path = cache_dir() / f"{kernel.name}_{kernel.source_hash}.py"
        assert path.read_text() == kernel.source
        assert load_kernel(kernel) is load_kernel(kernel)


@pytest.mark.slow
def test_kernels_compile_to_cubin_without_a_gpu(monkeypatch, tmp_path):
    """The non-interpreted path: both kernels compile for sm_90 (constant typing of the Philox rounds included)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "bin"))
    constexprs = {"TRAIN": True, "NUMEL": 1000, "BLOCK": 1024}
    common = {"rng_state": "*i64", "out": "*bf16", "p": "fp32", "scale": "fp32"}
    common |= dict.fromkeys(constexprs, "constexpr")
    for kernel, tensors in ((FORWARD_KERNEL, {"x": "*bf16", "residual": "*bf16"}), (MUL_KERNEL, {"t": "*bf16"})):
        compiled = triton_compile(ASTSource(load_kernel(kernel), tensors | common, constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], kernel.name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_launch_matches_the_reference_on_the_same_state(monkeypatch, tmp_path, dtype):
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    shape, p = (64, 1000), 0.3
    x, residual = torch.randn(shape, device="cuda").to(dtype), torch.randn(shape, device="cuda").to(dtype)
    torch.manual_seed(5)
    out, state = resolve_callable("fleetc.fused_dropout_add_philox")(x, residual, p, True)
    assert state.is_cuda and state.dtype == torch.int64
    torch.manual_seed(5)
    _, again = resolve_callable("fleetc.fused_dropout_add_philox")(x, residual, p, True)
    assert torch.equal(state, again)  # torch.manual_seed reproduces the CUDA draw
    keep = keep_mask(state.cpu(), shape, p)
    want = residual.float().cpu() + torch.where(keep, x.float().cpu() * dropout_scale(p), 0.0)
    tolerance = LOW_PRECISION.get(dtype, dict(rtol=1e-6, atol=1e-6))
    torch.testing.assert_close(out.cpu(), want.to(dtype), **tolerance)
    ones = torch.ones(shape, device="cuda", dtype=dtype)
    regenerated = resolve_callable("fleetc.philox_dropout_mul")(ones, state, p, True, 1.0)
    assert torch.equal(regenerated.cpu() != 0, keep)  # the mask, bit for bit, on the GPU
    assert list(tmp_path.glob("triton/fused_dropout_add_philox_*.py")), "no kernel source was written to the cache"
