"""Triton kernels of fused add+activation (and its gradient) against the ops' references, under TRITON_INTERPRET=1."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_triton_kernels import LOW_PRECISION
from torch import nn

from fleetc.cli import main
from fleetc.codegen.triton import add_act
from fleetc.codegen.triton.launch import cache_dir, kernel_for
from fleetc.ir.program import Op, Ref, Var
from fleetc.ir.registry import resolve_callable
from fleetc.ops import fused_add_act

# (activation, its constant): every activation the pass fuses
ACTS = [("relu", None), ("gelu", "none"), ("gelu", "tanh"), ("silu", None), ("sigmoid", None),
        ("tanh", None), ("leaky_relu", 0.1), ("scale", 0.5)]
ACT_IDS = [f"{a}-{p}" if p is not None else a for a, p in ACTS]
# (x shape, y shape): same shapes, a bias broadcast over rows, the other addend broadcast, odd sizes throughout
SHAPES = [((5, 37), (5, 37)), ((5, 37), (37,)), ((37,), (3, 5, 37)), ((2, 3, 7), (3, 1))]


def _assert_matches(got: tuple, want: tuple, dtype: torch.dtype, what: str) -> None:
    """Kernel = reference run in fp32 and rounded once (the kernel computes in fp32 and rounds on store)."""
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == dtype, f"{what} output {i}: {a.shape} {a.dtype} vs {b.shape} {dtype}"
        torch.testing.assert_close(a, b.to(dtype), **LOW_PRECISION.get(dtype, dict(rtol=1e-5, atol=1e-6)),
                                   msg=lambda m: f"{what} output {i}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act,param", ACTS, ids=ACT_IDS)
def test_forward_kernel_matches_reference(interpret, act, param, dtype):
    g = torch.Generator().manual_seed(0)
    for act_first in (False, True):
        for x_shape, y_shape in SHAPES:
            x, y = (torch.randn(s, generator=g).to(dtype) for s in (x_shape, y_shape))
            got = add_act.fused_elemwise_add_act(x, y, act_first, act, param)
            want = fused_add_act.fused_elemwise_add_act(x.float(), y.float(), act_first, act, param)
            _assert_matches(got, want, dtype, f"{act} act_first={act_first} {x_shape}+{y_shape}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act,param", ACTS, ids=ACT_IDS)
def test_grad_kernel_matches_reference(interpret, act, param, dtype):
    g = torch.Generator().manual_seed(1)
    for shape in [(5, 37), (2, 3, 7)]:
        dout = torch.randn(shape, generator=g).to(dtype)
        saved = None if act == "scale" else torch.randn(shape, generator=g).to(dtype)
        if saved is not None:
            saved.view(-1)[:3] = 0.0  # the relu/leaky_relu edge
        got = add_act.fused_elemwise_add_act_grad(dout, saved, act, param)
        want = fused_add_act.fused_elemwise_add_act_grad(dout.float(), None if saved is None else saved.float(),
                                                         act, param)
        _assert_matches((got,), (want,), dtype, f"{act} grad {shape}")


def test_kernel_names_say_what_they_fuse():
    assert [k.name for k in (add_act.forward_launches((4, 8), (8,), False, "gelu", "tanh"))] == ["fused_add_gelu_tanh"]
    assert [k.name for k in add_act.forward_launches((4, 8), (4, 8), True, "relu", None)] == ["fused_relu_add"]
    # x + act(bias): act(bias) is smaller than the output, so it is stored by a kernel of its own
    assert [k.name for k in add_act.forward_launches((4, 8), (8,), True, "silu", None)] == \
        ["fused_silu_add", "fused_silu_add_inter"]
    assert add_act.grad_launch(True, "leaky_relu", 0.2).name == "fused_add_leaky_relu_grad"


@pytest.mark.parametrize("act_first", [False, True])
def test_dump_ir_lists_the_sources_the_runtime_generates(act_first):
    x, y = torch.randn(4, 6), torch.randn(6, dtype=torch.bfloat16)
    op = Op("fused_elemwise_add_act", "fleetc.fused_elemwise_add_act", (Ref("x"), Ref("y"), act_first, "silu", None),
            outputs=["out", "inter"])
    listed = add_act.add_act_sources(op, [Var("x", [4, 6], "float32"), Var("y", [6], "bfloat16"), None, None, None])
    launched = [kernel_for(k.name, k.steps, k.results, tuple((x, y)[i] for i in k.inputs))
                for k in add_act.forward_launches((4, 6), (6,), act_first, "silu", None)]
    assert listed == launched and len(listed) == 1 + act_first
    grad = Op("g", "fleetc.fused_elemwise_add_act_grad", (Ref("d"), None, "scale", 0.5), outputs=["dx"])
    [source] = add_act.add_act_grad_sources(grad, [Var("d", [4, 6], "float32"), None, None, None])
    assert source == kernel_for("fused_add_scale_grad", add_act.grad_launch(False, "scale", 0.5).steps, (1,), (x,))


def test_cpu_tensors_take_the_reference_path(interpret):
    x, y = torch.randn(3, 4), torch.randn(4)
    out, inter = resolve_callable("fleetc.fused_elemwise_add_act")(x, y, False, "relu", None)
    assert torch.equal(out, torch.relu(x + y)) and torch.equal(inter, x + y)
    assert torch.equal(resolve_callable("fleetc.fused_elemwise_add_act_grad")(x, out, "relu", None),
                       torch.where(out <= 0, 0.0, x))
    assert not cache_dir().exists()


class BiasAddAct(nn.Module):
    """gelu(x + bias) and h + sigmoid(z): both add+act shapes, the first with a broadcast addend."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) * 0.3)
        self.bias = nn.Parameter(torch.randn(6) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(x @ self.w + self.bias)
        return (h + torch.sigmoid(h @ self.w)).square().mean()


def bias_add_act() -> dict:
    """A `fleetc dump-ir` factory (see tests/cli_factories.py)."""
    torch.manual_seed(0)
    return {"model": BiasAddAct(), "args": (torch.randn(4, 6),), "loss_fn": None}


def test_dump_ir_lists_the_add_act_kernels(capsys, tmp_path):
    strategy_file = tmp_path / "strategy.json"
    strategy_file.write_text('{"build_strategy": {"fuse_elewise_add_act_ops": true}}')
    code = main(["dump-ir", "test_triton_add_act:bias_add_act", "--strategy", str(strategy_file), "--kernels"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    program_text, _, kernels = out.partition("# kernel ")
    assert program_text.count("fleetc.fused_elemwise_add_act(") == 2
    assert program_text.count("fleetc.fused_elemwise_add_act_grad(") == 2
    names = sorted(line.split()[2] for line in out.splitlines() if line.startswith("# kernel "))
    assert names == ["fused_add_gelu", "fused_add_gelu_grad", "fused_add_sigmoid_grad", "fused_sigmoid_add"]
    assert "def fused_add_gelu(" in kernels and "source sha256:" in kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("act,param", ACTS, ids=ACT_IDS)
def test_cuda_tensors_run_the_triton_kernels(act, param, monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)
    x, y, dout = torch.randn(64, 33, generator=g), torch.randn(33, generator=g), torch.randn(64, 33, generator=g)
    for act_first in (False, True):
        got = resolve_callable("fleetc.fused_elemwise_add_act")(x.cuda(), y.cuda(), act_first, act, param)
        want = fused_add_act.fused_elemwise_add_act(x, y, act_first, act, param)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)
    saved = None if act == "scale" else x
    got = resolve_callable("fleetc.fused_elemwise_add_act_grad")(dout.cuda(), None if saved is None else saved.cuda(),
                                                                  act, param)
    torch.testing.assert_close(got.cpu(), fused_add_act.fused_elemwise_add_act_grad(dout, saved, act, param),
                               rtol=1e-5, atol=1e-5)
    assert list(tmp_path.glob("triton/fused_*add*.py")), "no kernel source was written to the cache"
