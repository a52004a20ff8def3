"""The pipeline pass in fleetc.compile: stage placement, validation errors that name the problem, the automatic
cut, report lines and `dump-ir --pipeline`."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from helpers.pipeline import StagedGPT, eager_accumulating_step
from torch import nn
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.cli import main
from fleetc.errors import PassError, StrategyError


def _strategy(accumulate_steps: int = 2, micro_batch_size: int = 2, **extra) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"micro_batch_size": micro_batch_size, "accumulate_steps": accumulate_steps, **extra}
    return strategy


class Guarded(nn.Module):
    """Two linear layers on the stages `order` names (in forward order)."""

    def __init__(self, order=(0, 1)):
        super().__init__()
        self.a, self.b, self.order = nn.Linear(4, 8), nn.Linear(8, 3), order

    def forward(self, x):
        with fleetc.device_guard(f"stage:{self.order[0]}"):
            h = F.relu(self.a(x))
        with fleetc.device_guard(f"stage:{self.order[1]}"):
            return self.b(h)


def _compile_step(model, strategy, batch: int = 4):
    trainer = fleetc.compile(model, strategy, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=F.cross_entropy, verify=True)
    loss = trainer.step(torch.randn(batch, 4), torch.randint(0, 3, (batch,)))
    return trainer, loss


def test_pass_annotates_every_op_and_reports_the_plan():
    trainer, _ = _compile_step(Guarded(), _strategy())
    report = trainer.report()
    assert "pipeline_split" in report.applied
    assert report.stats["pipeline_split"] == {"stages": 2, "microbatches": 2, "shared_params": 0,
                                              "boundary_values": 2}
    notes = "\n".join(report.notes["pipeline_split"])
    assert "stage 0: " in notes and "sends relu forward" in notes and "1F1B: step 9 time units" in notes
    assert "pipeline" not in report.skipped
    program = trainer.program
    devices = {op.attrs.get("op_device") for op in program.global_block.ops if op.role & 3}
    assert devices == {"stage:0", "stage:1"}   # the loss ops too, placed by data flow on the last stage
    assert program.metadata["pipeline"]["bubble_fraction"] == pytest.approx(1 / 3, abs=1e-4)


def test_fewer_microbatches_than_stages_is_valid_but_reported():
    trainer, _ = _compile_step(Guarded(), _strategy(accumulate_steps=1, micro_batch_size=4))
    assert any("valid but wasteful" in n for n in trainer.report().notes["pipeline_split"])


def test_stages_out_of_order_name_the_op():
    with pytest.raises(PassError, match=r"is on pipeline stage 0 but .*stage 1.*entered in increasing order"):
        _compile_step(Guarded(order=(1, 0)), _strategy())


def test_a_stage_with_no_ops_is_named():
    with pytest.raises(PassError, match="pipeline stage 1 has no ops: device_guard uses stages 0, 2"):
        _compile_step(Guarded(order=(0, 2)), _strategy())


def test_batch_that_does_not_divide_into_microbatches():
    with pytest.raises(StrategyError, match=r"batch size 5, which does not divide into "
                                            r"pipeline_configs.accumulate_steps=2"):
        _compile_step(Guarded(), _strategy(), batch=5)
    with pytest.raises(StrategyError, match=r"micro_batch_size × accumulate_steps = 2 × 2 = 4"):
        _compile_step(Guarded(), _strategy(), batch=6)


def test_stage_count_and_pp_degree_must_agree():
    strategy = _strategy()
    strategy.hybrid_configs = {"pp_degree": 3}
    with pytest.raises(StrategyError, match="pp_degree is 3 but the model's device_guard marks 2 stages"):
        _compile_step(Guarded(), strategy)


def test_vpp_needs_chunks_that_divide_the_stages():
    with pytest.raises(StrategyError, match="vpp_degree=2 chunks per rank does not divide the model's 3 stages"):
        class Three(Guarded):
            def forward(self, x):
                with fleetc.device_guard("stage:0"):
                    h = self.a(x)
                with fleetc.device_guard("stage:1"):
                    h = F.relu(h)
                with fleetc.device_guard("stage:2"):
                    return self.b(h)
        _compile_step(Three(), _strategy(schedule_mode="VPP", vpp_degree=2))


def test_automatic_cut_balances_cost_and_prints_it():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)], nn.Linear(16, 3))
    strategy = _strategy(accumulate_steps=2, micro_batch_size=2)
    strategy.hybrid_configs = {"pp_degree": 2}
    trainer = fleetc.compile(model, strategy, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=F.cross_entropy, verify=True)
    trainer.step(torch.randn(4, 16), torch.randint(0, 3, (4,)))
    notes = trainer.report().notes["pipeline_split"]
    assert notes[0] == "automatic cut into 2 stages (hybrid_configs.pp_degree; no device_guard):"
    assert notes[1].startswith("  stage 0: ops ") and "MiB parameters" in notes[1]
    stage_of = {op.name: op.attrs["op_device"] for op in trainer.program.global_block.ops
                if op.type == "aten.addmm.default"}
    assert sorted(stage_of.values()) == ["stage:0"] * 3 + ["stage:1"] * 2 or \
        sorted(stage_of.values()) == ["stage:0"] * 2 + ["stage:1"] * 3


def test_dump_ir_pipeline_prints_the_schedule_and_stage_programs(capsys):
    assert main(["dump-ir", "cli_factories:mlp_pipeline", "--verify", "--pipeline"]) == 0
    out = capsys.readouterr().out
    assert "schedule ZBH1: 2 rank(s), 4 micro-batch(es)" in out
    assert "ZBH1: step " in out and "bubble fraction" in out
    assert "-- stage 1 forward --" in out and "fleetc.pipeline_recv(0, 'activation'" in out
    assert "-- stage 0 optimizer --" in out


FULL_ONLY = pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="FLEETC_FULL=1 runs it; CI runs the "
                               "other case (one representative of each composition, to keep CI under 8 minutes)")


@pytest.mark.parametrize("mode", ["ZBH1", pytest.param("VPP", marks=FULL_ONLY)])
def test_compiled_step_runs_pipelined_and_matches_eager_accumulation(mode):
    """strategy.pipeline through fleetc.compile: step() runs the stage Programs per the schedule."""
    vpp = 2 if mode == "VPP" else 1
    torch.manual_seed(0)
    model = StagedGPT(2 * vpp)
    reference = copy.deepcopy(model)
    trainer = fleetc.compile(model, _strategy(accumulate_steps=2, micro_batch_size=2, schedule_mode=mode,
                                              vpp_degree=vpp),
                             optimizer=OPTIMIZERS["adam"](model.parameters()), loss_fn=ZOO["gpt"].loss_fn, verify=True)
    reference_optimizer = OPTIMIZERS["adam"](reference.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        args, _ = ZOO["gpt"].make_batch(g)
        loss = trainer.step(*args)
        expected = eager_accumulating_step(reference, reference_optimizer, ZOO["gpt"].loss_fn, args, 2)
        torch.testing.assert_close(loss, torch.tensor(expected))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")
    assert "pipeline" not in trainer.report().skipped


@pytest.mark.parametrize("avg", [True, pytest.param(False, marks=FULL_ONLY)])
def test_gradient_merge_multiplies_the_update_interval(avg):
    """gradient_merge k_steps=2 with accumulate_steps=2: one update every 2 step() calls, on the gradients of the
    4 micro-batches (averaged over the 2 calls with avg, summed without), as eager accumulation does."""
    k_steps, m = 2, 2
    torch.manual_seed(0)
    model = StagedGPT(2)
    reference = copy.deepcopy(model)
    strategy = _strategy(accumulate_steps=m, micro_batch_size=2)
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": k_steps, "avg": avg}
    trainer = fleetc.compile(model, strategy, optimizer=OPTIMIZERS["momentum"](model.parameters()),
                             loss_fn=ZOO["gpt"].loss_fn)
    reference_optimizer = OPTIMIZERS["momentum"](reference.parameters())
    g = torch.Generator().manual_seed(1)
    for step in range(2 * k_steps):
        before = [p.detach().clone() for p in model.parameters()]
        args, _ = ZOO["gpt"].make_batch(g)
        loss = trainer.step(*args)
        updates = (step + 1) % k_steps == 0
        expected = eager_accumulating_step(reference, reference_optimizer, ZOO["gpt"].loss_fn, args, m,
                                           update=updates, divide=k_steps if avg else 1)
        torch.testing.assert_close(loss, torch.tensor(expected), msg=lambda msg, step=step: f"step {step}: {msg}")
        assert updates != all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=lambda msg, name=name: f"{name}: {msg}")
    report = trainer.report()
    assert report.skipped["gradient_merge"].startswith("pipeline: each stage keeps its gradient sums over 2")
    assert any("gradient merge: one update every 2 step() calls" in n for n in report.notes["pipeline_split"])
    assert any(d.startswith("gradient_merge: merged by the pipeline") for d in report.decisions)


@pytest.mark.parametrize("clip", [fleetc.ClipGradByGlobalNorm(0.5),
                                  pytest.param(fleetc.ClipGradByNorm(0.05), marks=FULL_ONLY)],
                         ids=["global_norm", "norm"])
def test_gradient_clipping_across_stages_matches_eager(clip):
    """Each stage clips its own gradients; the global norm is summed over the stages (the tied embedding's gradient
    counted once), so every stage scales by the norm of all gradients, as eager clipping does."""
    torch.manual_seed(0)
    model = StagedGPT(2)
    reference = copy.deepcopy(model)
    trainer = fleetc.compile(model, _strategy(accumulate_steps=2, micro_batch_size=2, schedule_mode="ZBH1"),
                             optimizer=OPTIMIZERS["momentum"](model.parameters()), loss_fn=ZOO["gpt"].loss_fn,
                             grad_clip=clip, verify=True)
    reference_optimizer = OPTIMIZERS["momentum"](reference.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        args, _ = ZOO["gpt"].make_batch(g)
        trainer.step(*args)
        for micro in zip(*(a.chunk(2) for a in args)):
            (ZOO["gpt"].loss_fn(reference(micro[0]), micro[1]) / 2).backward()
        grads = [p.grad for p in reference.parameters()]
        if isinstance(clip, fleetc.ClipGradByGlobalNorm):
            norm = torch.stack([gr.norm() for gr in grads]).norm()
            assert norm > clip.clip_norm                                  # the clip really scales
            for gr in grads:
                gr.mul_(clip.clip_norm / torch.clamp_min(norm, clip.clip_norm))
        else:
            assert any(gr.norm() > clip.clip_norm for gr in grads)
            for gr in grads:
                gr.mul_(clip.clip_norm / torch.clamp_min(gr.norm(), clip.clip_norm))
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=lambda msg, name=name: f"{name}: {msg}")
    assert "pipeline_split" in trainer.report().applied


def test_global_norm_clipping_with_vpp_is_refused_by_name():
    model = StagedGPT(4)
    with pytest.raises(StrategyError, match="global-norm gradient clipping with schedule_mode VPP"):
        fleetc.compile(model, _strategy(accumulate_steps=2, micro_batch_size=2, schedule_mode="VPP", vpp_degree=2),
                       optimizer=OPTIMIZERS["sgd"](model.parameters()), loss_fn=ZOO["gpt"].loss_fn,
                       grad_clip=fleetc.ClipGradByGlobalNorm(1.0)).step(*ZOO["gpt"].make_batch(torch.Generator())[0])


class Skip(nn.Module):
    """Stage 2 reads a value of stage 0 (a skip connection): it must be relayed through stage 1."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        with fleetc.device_guard("stage:0"):
            h = torch.tanh(self.a(x))
        with fleetc.device_guard("stage:1"):
            g = torch.tanh(self.b(h))
        with fleetc.device_guard("stage:2"):
            return self.c(g + h)


@pytest.mark.parametrize("mode", ["FThenB", "1F1B", "ZBH1"])
def test_skip_connection_across_stages_is_relayed(mode):
    torch.manual_seed(0)
    model = Skip()
    reference = copy.deepcopy(model)
    trainer = fleetc.compile(model, _strategy(accumulate_steps=3, micro_batch_size=2, schedule_mode=mode),
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             loss_fn=F.cross_entropy, verify=True)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
        loss = trainer.step(x, y)
        expected = eager_accumulating_step(reference, reference_optimizer, F.cross_entropy, (x, y), 3)
        torch.testing.assert_close(loss, torch.tensor(expected))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")
    notes = trainer.report().notes["pipeline_split"]
    relay = next(n for n in notes if n.startswith("  stage 1:"))
    assert "tanh" in relay and "sends" in relay   # stage 1 forwards stage 0's h along with its own g


def test_pipeline_composes_with_recompute_per_stage():
    torch.manual_seed(0)
    model = StagedGPT(2)
    reference = copy.deepcopy(model)
    strategy = _strategy(accumulate_steps=2, micro_batch_size=2)
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ["layers.0", "layers.1"]}
    trainer = fleetc.compile(model, strategy, optimizer=OPTIMIZERS["adam"](model.parameters()),
                             loss_fn=ZOO["gpt"].loss_fn, verify=True)
    reference_optimizer = OPTIMIZERS["adam"](reference.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        args, _ = ZOO["gpt"].make_batch(g)
        loss = trainer.step(*args)
        expected = eager_accumulating_step(reference, reference_optimizer, ZOO["gpt"].loss_fn, args, 2)
        torch.testing.assert_close(loss, torch.tensor(expected))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")
    assert {"recompute", "pipeline_split"} <= set(trainer.report().applied)


def test_without_an_optimizer_the_program_runs_whole_with_the_reason():
    model = Guarded()
    trainer = fleetc.compile(model, _strategy(), loss_fn=F.cross_entropy)
    trainer.step(torch.randn(4, 4), torch.randint(0, 3, (4,)))
    assert "no optimizer update in the Program" in trainer.report().skipped["pipeline_split"]
    assert model.a.weight.grad is not None
