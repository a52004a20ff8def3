"""Capture: standard op attributes, loss conventions, errors users can act on."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo import MLP, ZOO, TinyGPT

import fleetc
from fleetc.ir.program import OpRole, VarKind


def _compile_mlp(**kwargs):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=F.cross_entropy, verify=True, **kwargs)
    x, y = torch.randn(4, 32), torch.randint(0, 10, (4,))
    trainer.step(x, y)
    return trainer, model, opt, x, y


def test_ops_carry_role_module_path_source_and_forward_op():
    trainer, *_ = _compile_mlp()
    program = trainer.history["capture"].program
    ops = program.global_block.ops
    fc1 = [op for op in ops if op.module_path == "fc1"]
    assert {OpRole(op.role) for op in fc1} == {OpRole.FORWARD, OpRole.BACKWARD, OpRole.OPTIMIZE}
    forward_mm = next(op for op in fc1 if op.type == "aten.addmm.default")
    assert forward_mm.attrs["source"].endswith(f"zoo.py:{MLP.forward.__code__.co_firstlineno + 1}")
    backward = [op for op in fc1 if OpRole.BACKWARD in op.role]
    assert backward and all(op.attrs.get("forward_op") for op in backward)
    names = {op.name for op in ops}
    assert all(op.attrs["forward_op"] in names for op in backward)
    loss_ops = [op for op in ops if OpRole.LOSS in op.role]
    assert any(op.type == "aten.nll_loss_forward.default" for op in loss_ops)
    # relu runs in MLP.forward itself (module path ""), which is the model's, not the loss function's.
    relus = [op for op in ops if op.type == "aten.relu.default"]
    assert relus and all(OpRole(op.role) is OpRole.FORWARD for op in relus)
    assert [OpRole(op.role) for op in ops if OpRole.OPTIMIZE in op.role] == [OpRole.OPTIMIZE] * 6
    assert program.fetches == {"loss": "loss"}
    assert "fc1.weight@GRAD" in program.global_block.vars


def test_var_kinds_and_feeds():
    trainer, *_ = _compile_mlp()
    program = trainer.program
    assert program.feeds == ["x", "target", "lr@group0"]
    assert program.var("fc1.weight").kind is VarKind.PARAM
    assert program.var("x").kind is VarKind.DATA and program.var("x").shape == (4, 32)
    assert program.var("lr@group0").kind is VarKind.HYPER


class _Guarded(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        with fleetc.device_guard("stage:1"):
            h = torch.relu(self.a(x))
        return self.b(h)


def test_device_guard_marks_forward_and_backward_ops():
    model = _Guarded()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy)
    trainer.step(torch.randn(4, 8), torch.randint(0, 2, (4,)))
    ops = trainer.history["capture"].program.global_block.ops
    guarded = [op for op in ops if op.attrs.get("op_device") == "stage:1"]
    assert {op.module_path for op in guarded} >= {"a"}
    assert any(OpRole.BACKWARD in op.role for op in guarded) and any(OpRole.FORWARD in op.role for op in guarded)
    assert not any(op.attrs.get("op_device") for op in ops if op.module_path == "b")
    assert "op_device=stage:1" in str(trainer.program)
    with pytest.raises(ValueError, match="stage:N"):
        with fleetc.device_guard("tpu"):
            pass


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent control flow
            return h * 2
        return h


def test_data_dependent_control_flow_is_a_capture_error_with_file_and_line():
    model = _Branchy()
    trainer = fleetc.compile(model, loss_fn=F.mse_loss)
    with pytest.raises(fleetc.CaptureError) as info:
        trainer.step(torch.randn(2, 4), torch.randn(2, 4))
    message = str(info.value)
    line = _Branchy.forward.__code__.co_firstlineno + 2
    assert f"test_capture.py:{line}" in message
    assert "data-dependent" in message and "hint:" in message


def test_closure_optimizer_is_refused_with_the_reason():
    model = MLP()
    trainer = fleetc.compile(model, optimizer=torch.optim.LBFGS(model.parameters()), loss_fn=F.cross_entropy)
    with pytest.raises(fleetc.UnsupportedOptimizerError, match=r"LBFGS.step\(closure\) needs a closure"):
        trainer.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))


class _ReturnsObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x, y):
        return SimpleNamespace(loss=F.mse_loss(self.fc(x), y), logits=None)


class _ReturnsTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x, y):
        return F.mse_loss(self.fc(x), y)


@pytest.mark.parametrize("make_model,loss_of", [(_ReturnsObject, lambda out: out.loss),
                                                (_ReturnsTensor, lambda out: out)], ids=["attribute", "plain_tensor"])
def test_loss_from_attribute_and_plain_tensor(make_model, loss_of):
    torch.manual_seed(0)
    model = make_model()
    args = (torch.randn(3, 4), torch.randn(3, 1))
    reference = copy.deepcopy(model)
    loss = fleetc.compile(model).step(*args)
    torch.testing.assert_close(loss, loss_of(reference(*args)).detach())


class _WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x)


def test_an_in_place_write_to_a_step_input_is_a_capture_error_with_the_line():
    model = _WritesItsInput()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss)
    with pytest.raises(fleetc.CaptureError) as info:
        trainer.step(torch.randn(3, 4), torch.randn(3, 2))
    line = _WritesItsInput.forward.__code__.co_firstlineno + 1
    assert "writes its input 'x' in place" in str(info.value) and f"test_capture.py:{line}" in str(info.value)


def test_model_returning_wrong_type_without_loss_fn_is_explained():
    trainer = fleetc.compile(MLP())
    with pytest.raises(fleetc.CaptureError, match="loss_fn=None"):
        trainer.step(torch.randn(2, 32))


def test_without_optimizer_gradients_accumulate_in_p_grad_like_backward():
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    trainer = fleetc.compile(model, loss_fn=F.cross_entropy)
    x, y = torch.randn(4, 32), torch.randint(0, 10, (4,))
    for _ in range(2):
        trainer.step(x, y)
        F.cross_entropy(reference(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert all(p.grad is not None for p in model.parameters())


def test_lr_change_takes_effect_without_recompiling():
    trainer, model, opt, x, y = _compile_mlp()
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0 if epoch == 0 else 1.0)
    before = model.fc1.weight.detach().clone()
    trainer.step(x, y)  # lr is 0 now: nothing moves
    torch.testing.assert_close(model.fc1.weight, before)
    scheduler.step()  # back to 0.1
    trainer.step(x, y)
    assert not torch.equal(model.fc1.weight, before)
    opt.param_groups[0]["lr"] = 0.0  # by hand
    moved = model.fc1.weight.detach().clone()
    trainer.step(x, y)
    torch.testing.assert_close(model.fc1.weight, moved)
    assert trainer.report().recompiles == []


def test_new_shapes_recompile_same_shapes_reuse():
    trainer, model, opt, x, y = _compile_mlp()
    first = trainer.program
    trainer.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert trainer.program is first
    trainer.step(torch.randn(6, 32), torch.randint(0, 10, (6,)))
    # The default policy (dynamic=None): the recompile is symbolic in the dim that changed, and serves size 5 too.
    assert trainer.program is not first and str(trainer.program.var("x").shape) == "(batch, 32)"
    (recompile,) = trainer.report().recompiles
    assert "args[0]" in recompile and "[4, 32]" in recompile and "[6, 32]" in recompile
    assert "traced symbolic in batch (x dim 0)" in recompile
    second = trainer.program
    trainer.step(torch.randn(5, 32), torch.randint(0, 10, (5,)))
    assert trainer.program is second and trainer.report().compiles == 2


def test_eval_call_matches_eager_eval_and_keeps_training_mode():
    entry = ZOO["cnn"]
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=entry.loss_fn)
    (x, y), _ = entry.make_batch(torch.Generator().manual_seed(0))
    trainer.step(x, y)  # updates BatchNorm running stats through the Program
    out = trainer(x)
    assert model.training
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    assert float(model.bn.num_batches_tracked) == 1


def test_eval_call_returns_the_models_output_structure():
    entry = ZOO["loss_dict"]
    model = entry.make_model()
    trainer = fleetc.compile(model)
    (x,), kwargs = entry.make_batch(torch.Generator().manual_seed(0))
    trainer.step(x, **kwargs)
    out = trainer(x)
    assert set(out) == {"logits"} and out["logits"].shape == (8, 5)


def test_tied_weights_update_once_under_their_first_name():
    model = TinyGPT(layers=1, dropout=0.0)
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=ZOO["gpt"].loss_fn)
    (idx, tgt), _ = ZOO["gpt"].make_batch(torch.Generator().manual_seed(0))
    trainer.step(idx, tgt)
    sgd_ops = [op.name for op in trainer.program.global_block.ops if op.type == "fleetc.sgd"]
    assert "tok.weight.sgd" in sgd_ops and not any(name.startswith("lm_head") for name in sgd_ops)
    assert model.lm_head.weight is model.tok.weight
