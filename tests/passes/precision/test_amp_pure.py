"""AMP use_pure_fp16: low-precision parameters, float32 master weights in the optimizer state."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import run_side_by_side
from helpers.amp import amp_strategy, poisoned, pure_strategy, pure_trainer
from torch.utils._python_dispatch import TorchDispatchMode
from zoo import MLP as ZOO_MLP
from zoo import OPTIMIZERS

import fleetc
from fleetc.ir.program import OpRole, VarKind


class _RecordParamDtypes(TorchDispatchMode):
    """The dtypes of the parameters' storages as every matmul reads them, while the step runs."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in params}
        self.seen: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages:
                self.seen.add(a.dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_params_are_bf16_during_the_step_and_masters_are_fp32_optimizer_state(optimizer):
    trainer, entry = pure_trainer("cnn", optimizer)
    g = torch.Generator().manual_seed(1)
    fp32_initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.step(*entry.make_batch(g)[0])
    program = trainer.program
    params = [v for v in program.persistables() if v.kind is VarKind.PARAM]
    assert params and all(v.dtype == "bfloat16" for v in params)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert all(b.dtype == torch.float32 for b in trainer.model.buffers() if b.is_floating_point())
    masters = {v.name: v for v in program.persistables() if v.name.endswith("@master_weight")}
    assert len(masters) == len(params) and all(v.kind is VarKind.OPTIMIZER_STATE and v.dtype == "float32"
                                               for v in masters.values())
    for name, param in trainer.model.named_parameters():
        master = trainer.optimizer.state[param]["master_weight"]
        assert master.dtype == torch.float32
        assert torch.equal(param, master.to(torch.bfloat16)), f"{name} is its master, rounded"
        assert not torch.equal(master, fp32_initial[name]), f"{name}'s master was updated in float32"
    updates = [op for _, op in program.walk_ops() if op.type in ("fleetc.sgd", "fleetc.adam")]
    assert updates and all(op.args[0].name.endswith("@master_weight") for op in updates)
    assert all(program.var(op.args[1].name).dtype == "float32" for op in updates), "fp32 gradients"
    params_live = list(trainer.model.parameters())
    with _RecordParamDtypes(params_live) as recorded:
        trainer.step(*entry.make_batch(g)[0])
    assert recorded.seen == {torch.bfloat16}, "the step reads the parameters in bf16"
    assert "use_pure_fp16" not in trainer.report().skipped


def test_master_is_seeded_from_the_fp32_parameter_not_its_rounding():
    trainer, entry = pure_trainer("mlp", "sgd")
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer.param_groups[0]["lr"] = 0.0  # lr is fed each step: this step leaves the weights alone
    trainer.step(*entry.make_batch(torch.Generator().manual_seed(1))[0])
    for name, param in trainer.model.named_parameters():
        master = trainer.optimizer.state[param]["master_weight"]
        assert torch.equal(master, initial[name]), f"{name}: the master keeps every fp32 bit"
        assert torch.equal(param, initial[name].to(torch.bfloat16))
    assert any(not torch.equal(initial[n], p.float()) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("zoo_name", ["mlp", "cnn"])
def test_pure_bf16_training_tracks_fp32_eager_losses_for_30_steps(zoo_name):
    """Tolerance: every step's loss within 8% of eager fp32, the last 10 steps' mean within 2%. Pure bf16 also
    rounds what mixed AMP keeps fp32 (BatchNorm's affine weights): measured worst steps 5.3% (cnn), 0.9% (mlp)."""
    run = run_side_by_side(zoo_name, "adam", steps=30, strategy=pure_strategy())
    fp32, pure = torch.stack(run.eager_losses), torch.stack(run.compiled_losses)
    relative = (pure - fp32).abs() / fp32.abs()
    assert relative.max() < 0.08, f"worst step {int(relative.argmax())}: {pure[relative.argmax()]} vs fp32"
    assert abs(pure[-10:].mean() - fp32[-10:].mean()) / fp32[-10:].mean() < 0.02
    assert all(p.dtype == torch.bfloat16 for p in run.compiled_model.parameters())
    assert int(run.trainer.counters["num_good_steps"]) == 30, "no step overflowed"


def test_pure_mlp_computes_exactly_what_mixed_amp_computes():
    """Every mlp parameter feeds only bf16 matmuls, so rounding it once per update (pure) or once per use (mixed)
    gives the same values, and the fp32 masters take the mixed run's fp32 weights' place bit for bit."""
    pure = run_side_by_side("mlp", "adam", steps=5, strategy=pure_strategy())
    mixed_strategy = fleetc.DistributedStrategy()
    mixed_strategy.amp = True
    mixed = run_side_by_side("mlp", "adam", steps=5, strategy=mixed_strategy)
    assert torch.equal(torch.stack(pure.compiled_losses), torch.stack(mixed.compiled_losses))
    for name, param in pure.compiled_model.named_parameters():
        master = pure.trainer.optimizer.state[param]["master_weight"]
        assert torch.equal(master, dict(mixed.compiled_model.named_parameters())[name]), name


def test_injected_inf_leaves_params_masters_and_optimizer_state_unchanged():
    trainer, entry = pure_trainer("mlp", "adam")
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        trainer.step(*entry.make_batch(g)[0])
    params = copy.deepcopy(trainer.model.state_dict())
    opt_state = copy.deepcopy(trainer.optimizer.state_dict())
    assert all("master_weight" in s for s in opt_state["state"].values())
    loss = trainer.step(*poisoned(entry.make_batch(g)[0]))
    assert not torch.isfinite(loss)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, params[name]), name
    for key, state in trainer.optimizer.state_dict()["state"].items():
        for slot, value in state.items():
            assert torch.equal(value, opt_state["state"][key][slot]), (key, slot)
    assert int(trainer.counters["num_bad_steps"]) == 1
    trainer.step(*entry.make_batch(g)[0])
    assert not torch.equal(trainer.model.state_dict()["fc1.weight"], params["fc1.weight"]), "training goes on"


def test_state_dict_round_trip_resumes_exactly():
    """Checkpoint model, optimizer (with the masters) and trainer; a fresh fp32 model that loads them before its
    first step continues bit for bit like the uninterrupted run."""
    trainer, entry = pure_trainer("mlp", "adamw")
    g = torch.Generator().manual_seed(1)
    batches = [entry.make_batch(g)[0] for _ in range(5)]
    for args in batches[:3]:
        trainer.step(*args)
    model_sd = copy.deepcopy(trainer.model.state_dict())
    opt_sd = copy.deepcopy(trainer.optimizer.state_dict())
    counters = trainer.state_dict()
    assert {v.dtype for s in opt_sd["state"].values() for k, v in s.items() if k == "master_weight"} == {torch.float32}

    torch.manual_seed(0)
    model = entry.make_model()
    opt = OPTIMIZERS["adamw"](model.parameters())
    opt.load_state_dict(opt_sd)  # while the module is still fp32: torch keeps the loaded state's fp32
    model.load_state_dict(model_sd)
    resumed = fleetc.compile(model, pure_strategy(), optimizer=opt, loss_fn=entry.loss_fn, verify=True)
    resumed.load_state_dict(counters)
    for args in batches[3:]:
        torch.testing.assert_close(resumed.step(*args), trainer.step(*args), rtol=0, atol=0)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    for (key, state), resumed_state in zip(trainer.optimizer.state_dict()["state"].items(),
                                           resumed.optimizer.state_dict()["state"].values()):
        assert torch.equal(state["master_weight"], resumed_state["master_weight"]), key


def test_loading_optimizer_state_after_the_params_went_bf16_is_a_clear_error():
    trainer, entry = pure_trainer("mlp", "adam")
    batch = entry.make_batch(torch.Generator().manual_seed(1))[0]
    trainer.step(*batch)
    trainer.optimizer.load_state_dict(trainer.optimizer.state_dict())  # torch casts the masters to bf16
    with pytest.raises(fleetc.CheckpointError, match="before the first step"):
        trainer.step(*batch)


class _HalfGuarded(torch.nn.Module):
    """fc1 inside an fp16_guard region, fc2 outside it."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 16)
        self.fc2 = torch.nn.Linear(16, 10)

    def forward(self, x):
        with fleetc.fp16_guard():
            h = torch.relu(self.fc1(x))
        return self.fc2(h)


def _guarded_trainer(model: torch.nn.Module, **configs):
    torch.manual_seed(0)
    trainer = fleetc.compile(model, pure_strategy(**configs), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=torch.nn.functional.cross_entropy, verify=True)
    g = torch.Generator().manual_seed(1)
    losses = [trainer.step(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
              for _ in range(2)]
    return trainer, losses


def test_use_fp16_guard_casts_only_the_guarded_region():
    trainer, _ = _guarded_trainer(_HalfGuarded(), use_fp16_guard=True)
    model, program = trainer.model, trainer.program
    assert model.fc1.weight.dtype == torch.bfloat16 and model.fc2.weight.dtype == torch.float32
    matmuls = [op for op in program.global_block.ops if op.type == "aten.addmm.default"]
    assert {op.module_path: program.var(op.outputs[0]).dtype for op in matmuls} == {"fc1": "bfloat16",
                                                                                    "fc2": "float32"}
    guarded = [op for op in program.global_block.ops if op.attrs.get("fp16_guard")]
    assert any(OpRole.BACKWARD in op.role for op in guarded), "backward ops of the region are guarded too"
    assert any("only the" in note and "fp16_guard" in note for note in trainer.report().notes["amp"])


def test_use_fp16_guard_false_casts_the_whole_model():
    trainer, _ = _guarded_trainer(_HalfGuarded(), use_fp16_guard=False)
    assert trainer.model.fc2.weight.dtype == torch.bfloat16


def test_use_fp16_guard_without_a_region_trains_float32_and_says_so():
    model = ZOO_MLP()
    eager = copy.deepcopy(model)
    trainer, losses = _guarded_trainer(model, use_fp16_guard=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert "no fleetc.fp16_guard region" in trainer.report().skipped["amp"]
    assert "no fleetc.fp16_guard region" in str(trainer.report())
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for loss in losses:
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        expected = torch.nn.functional.cross_entropy(eager(x), y)
        expected.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, expected.detach())


def test_use_fp16_guard_under_o1_is_reported_not_applicable_and_changes_nothing():
    def program(**configs):
        torch.manual_seed(0)
        model = _HalfGuarded()
        trainer = fleetc.compile(model, amp_strategy(**configs), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 loss_fn=torch.nn.functional.cross_entropy)
        trainer.step(torch.randn(8, 32), torch.randint(0, 10, (8,)))
        return trainer
    default, off = program(), program(use_fp16_guard=False)
    assert str(default.program) == str(off.program)
    for trainer in (default, off):
        assert any("not applicable without use_pure_fp16" in n for n in trainer.report().notes["amp"])
