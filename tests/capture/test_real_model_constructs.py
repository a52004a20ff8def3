"""What real models do in forward, on small models of the repo's own: result-less checks from `.to(...)`, lifted
tensor constants, complex rotary embeddings, bool/int buffers, SDPA, tied and frozen parameters, in-place buffer
updates, masks and position ids built in forward, views of non-contiguous tensors; and the CaptureError a user
gets for what is still unsupported."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import eager_step
from torch import nn

import fleetc
from fleetc.errors import CaptureError, VerificationError
from fleetc.ir.constants import CONSTANTS_KEY, add_constant
from fleetc.ir.program import Program, VarKind
from fleetc.ir.serialize import program_from_json, program_to_json
from fleetc.ir.verifier import verify
from fleetc.passes.cleanup.dce import DeadCodeElimination

VOCAB, SEQ, DIM, HEADS = 16, 6, 8, 2


class MiniLM(nn.Module):
    """A decoder block as Hugging Face writes one: complex rotary embeddings, a causal mask and position ids built
    in forward, SDPA, `.to(dtype)` casts, a constant table, bool and int buffers, an in-place step counter, tied
    input/output embeddings and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.norm_scale = nn.Parameter(torch.ones(DIM), requires_grad=False)  # frozen
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("keep", torch.tensor([True] * (VOCAB - 1) + [False]))  # bool buffer
        self.register_buffer("offset", torch.tensor(1, dtype=torch.int64))  # int buffer
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))  # updated in place

    def rotary(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        positions = torch.arange(x.shape[-2]) + self.offset  # position ids built in forward
        freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        rotation = torch.polar(torch.ones(x.shape[-2], half), positions[:, None].float() * freqs)
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], half, 2))
        return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        h = self.embed(tokens).to(torch.float32)
        q, k, v = self.qkv(h).view(*tokens.shape, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        a = F.scaled_dot_product_attention(self.rotary(q), self.rotary(k), v, attn_mask=causal)
        h = h + self.out(a.transpose(1, 2).reshape(*tokens.shape, DIM))
        scale = torch.tensor([0.5, 2.0]).repeat(DIM // 2)  # a lifted tensor constant
        logits = self.head(h * self.norm_scale * scale)
        return logits.masked_fill(~self.keep, -1e4)


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _train_both(make_model, loss_fn, make_batch, steps: int = 3, **compile_options):
    torch.manual_seed(0)
    eager = make_model()
    compiled = copy.deepcopy(eager)
    eager_opt = torch.optim.SGD([p for p in eager.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    compiled_opt = torch.optim.SGD([p for p in compiled.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    trainer = fleetc.compile(compiled, optimizer=compiled_opt, loss_fn=loss_fn, verify=True, **compile_options)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        args = make_batch(g)
        torch.manual_seed(100 + i)
        expected = eager_step(eager, eager_opt, loss_fn, args, {})
        torch.manual_seed(100 + i)
        torch.testing.assert_close(trainer.step(*args), expected)
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(b, a, msg=lambda m: f"{name}: {m}")
    return trainer, eager


def _tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g)


@pytest.fixture(scope="module")
def minilm():
    return _train_both(MiniLM, _lm_loss, _tokens)


def test_real_model_constructs_train_like_eager(minilm):
    trainer, eager = minilm
    assert int(eager.steps) == 3 and not eager.norm_scale.requires_grad
    program = trainer.history["capture"].program
    assert "norm_scale@GRAD" not in program.global_block.vars
    assert program.var("embed.weight").kind is VarKind.PARAM and "head.weight" not in program.global_block.vars
    assert program.var("keep").dtype == "bool" and program.var("offset").dtype == "int64"
    assert any(op.type.startswith("aten._scaled_dot_product") for op in program.global_block.ops)


def test_checks_without_a_result_are_dropped_and_counted():
    # A static step is traced without torch.export, which emits no such checks; a symbolic one still goes through
    # torch.export, which emits `_assert_tensor_metadata` for every `.to(dtype)`.
    trainer, _ = _train_both(MiniLM, _lm_loss, _tokens, steps=1, dynamic_dims={"tokens": {0: "batch"}})
    program = trainer.history["capture"].program
    assert "dynamic" in program.metadata
    assert program.metadata["dropped_checks"]["aten._assert_tensor_metadata.default"] >= 1
    assert not any(op.type in ("aten._assert_tensor_metadata.default",) for op in program.global_block.ops)


def test_lifted_constants_are_program_variables(minilm):
    trainer, _ = minilm
    program = trainer.history["capture"].program
    constants = [v for v in program.all_vars() if v.kind is VarKind.CONSTANT]
    assert constants, "torch.tensor([...]) in forward must become a CONSTANT Var"
    name = constants[0].name
    assert program.metadata[CONSTANTS_KEY][name] == [0.5, 2.0]
    assert f"constant {name}: f32[2] cpu" in str(program)
    assert str(Program.parse(str(program))) == str(program)
    assert str(program_from_json(program_to_json(program))) == str(program)
    verify(program)


def test_verifier_checks_constant_values(minilm):
    program = minilm[0].history["capture"].program.clone()
    name = next(v.name for v in program.all_vars() if v.kind is VarKind.CONSTANT)
    program.metadata[CONSTANTS_KEY][name] = [1.0, 2.0, 3.0]
    with pytest.raises(VerificationError, match=f"constant {name!r} is declared \\[2\\] but its value is \\[3\\]"):
        verify(program)
    del program.metadata[CONSTANTS_KEY][name]
    with pytest.raises(VerificationError, match="has no value"):
        verify(program)


def test_dead_code_elimination_drops_unread_constants(minilm):
    program = minilm[0].history["capture"].program.clone()
    used = next(v.name for v in program.all_vars() if v.kind is VarKind.CONSTANT)
    add_constant(program, "const.unread", torch.ones(3))
    verify(program)
    program, report = DeadCodeElimination().run(program, None)
    assert "const.unread" not in program.global_block.vars and "const.unread" not in program.metadata[CONSTANTS_KEY]
    assert used in program.global_block.vars and report.stats["vars_removed"] == 1
    verify(program)


class _TensorAttributes(nn.Module):
    """Tensors held as plain attributes (neither parameter nor buffer) and read in forward: a scalar and a table."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = torch.tensor(2.0)
        self.class_bias = torch.tensor([0.5, -0.25, 0.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale + self.class_bias


def _classes(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def _constant_values(program: Program) -> list:
    return [program.metadata[CONSTANTS_KEY][v.name] for v in program.all_vars() if v.kind is VarKind.CONSTANT]


@pytest.mark.parametrize("dynamic_dims", [None, {"x": {0: "batch"}}], ids=["static", "symbolic"])
def test_plain_tensor_attributes_are_lifted_constants(dynamic_dims):
    trainer, _ = _train_both(_TensorAttributes, nn.CrossEntropyLoss(), _classes, dynamic_dims=dynamic_dims)
    program = trainer.history["capture"].program
    assert sorted(map(str, _constant_values(program))) == ["2.0", "[0.5, -0.25, 0.0]"]
    assert not any(v.kind is VarKind.BUFFER for v in program.all_vars())
    verify(program)


@pytest.mark.parametrize("dynamic_dims", [None, {"x": {0: "batch"}}], ids=["static", "symbolic"])
def test_loss_module_buffers_are_lifted_constants(dynamic_dims):
    # nn.CrossEntropyLoss(weight=...) holds its class weights as a buffer of the loss module, not of the model.
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0, 0.5]))
    dynamic_dims = dynamic_dims and {"input": dynamic_dims["x"]}  # nn.Linear.forward(input)
    trainer, _ = _train_both(lambda: nn.Linear(4, 3), loss_fn, _classes, dynamic_dims=dynamic_dims)
    program = trainer.history["capture"].program
    assert [1.0, 3.0, 0.5] in _constant_values(program)
    assert not any(name.startswith("loss_fn") for name in program.global_block.vars)
    verify(program)


def test_a_tensor_the_loss_function_closes_over_is_a_lifted_constant():
    weight = torch.tensor([2.0, 1.0, 0.25])
    trainer, _ = _train_both(lambda: nn.Linear(4, 3), lambda out, y: F.cross_entropy(out, y, weight=weight), _classes)
    assert [2.0, 1.0, 0.25] in _constant_values(trainer.history["capture"].program)


class _StridedViews(nn.Module):
    """Views of non-contiguous tensors: a transposed tensor flattened (`reshape` copies), `as_strided` and
    `unfold` windows, and a narrow slice viewed (`view` is legal on it), as relative-position attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)                                     # (B, T, 8)
        t = h.transpose(1, 2)                                # non-contiguous
        flat = t.reshape(h.shape[0], -1)                     # copy: not viewable
        windows = h.unfold(1, 2, 1)                          # (B, T-1, 8, 2) overlapping view
        band = t[:, 2:6].view(h.shape[0], 2, 2, -1)          # view of a narrow, strided slice
        shifted = torch.as_strided(h, (h.shape[0], 3, 4), (h.stride(0), 8, 1), 2)
        return flat.sum(1) + windows.mean((1, 2, 3)) + band.square().sum((1, 2, 3)) + shifted.sum((1, 2))


def test_views_of_non_contiguous_tensors_match_eager():
    _train_both(_StridedViews, lambda out, y: F.mse_loss(out, y),
                lambda g: (torch.randn(4, 5, 8, generator=g), torch.randn(4, generator=g)))


class _ComplexConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase = torch.tensor([1j, 1.0, -1j, 1.0])
        return torch.view_as_real(self.fc(x) * phase).sum(-1)


def test_unsupported_constant_names_construct_file_line_and_hint():
    model = _ComplexConstant()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss)
    with pytest.raises(CaptureError) as info:
        trainer.step(torch.randn(2, 4), torch.randn(2, 4))
    message = str(info.value)
    line = _ComplexConstant.forward.__code__.co_firstlineno + 1  # where the constant is made
    assert "tensor constant" in message and "complex64" in message
    assert f"test_real_model_constructs.py:{line}" in message
    assert "hint: make it a registered buffer" in message
    assert "_tensor_constant" not in message


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


@torch.library.custom_op("fleetc_test::scale", mutates_args=())
def _scale(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


@_scale.register_fake
def _(x: torch.Tensor, k: float) -> torch.Tensor:
    return torch.empty_like(x)


def _scale_setup(ctx, inputs, output) -> None:
    ctx.k = inputs[1]


_scale.register_autograd(lambda ctx, grad: (grad * ctx.k, None), setup_context=_scale_setup)


class _CustomOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scale(_Square.apply(self.fc(x)), 3.0)


def test_autograd_functions_and_library_custom_ops_train_like_eager():
    trainer, _ = _train_both(_CustomOps, F.mse_loss,
                             lambda g: (torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)))
    types = {op.type for op in trainer.history["capture"].program.global_block.ops}
    assert "fleetc_test.scale.default" in types  # the custom op stays one op, its backward is the registered one


class _Cond(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.cond(h.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (h,))


def test_higher_order_op_names_construct_file_line_and_hint():
    model = _Cond()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss)
    with pytest.raises(CaptureError) as info:
        trainer.step(torch.randn(2, 4), torch.randn(2, 4))
    message = str(info.value)
    assert f"'cond' at {__file__}:{_Cond.forward.__code__.co_firstlineno + 2}" in message
    assert "hint: compute both branches and pick with torch.where" in message
    assert "true_graph" not in message and "eval_with_key" not in message
