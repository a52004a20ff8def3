"""Dynamic shapes: one Program serves many batch sizes and sequence lengths, with shape guards (docs/dynamic_shapes.md)."""
from __future__ import annotations

import copy
import random
import types

import pytest
import sympy
import torch
import torch.nn.functional as F
from helpers.gradient_merge import merge_strategy
from zoo import MLP, TinyGPT, _lm_loss

import fleetc
from fleetc.capture.dim_bounds import config_bounds
from fleetc.errors import GuardError, StrategyError
from fleetc.fleet.inference import save_inference_model
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.parser import parse_program
from fleetc.ir.serialize import program_from_json, program_to_json
from fleetc.ir.verifier import verify
from fleetc.passes.order import fusion_flags

MAX_SEQ = 16  # TinyGPT's position table
FUSION_FLAGS = tuple(fusion_flags())


def _gpt(**kwargs) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(dropout=0.0, **kwargs)


def _batch(batch: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _eager_step(model, optimizer, x, y) -> torch.Tensor:
    optimizer.zero_grad()
    loss = _lm_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _assert_same_params(model, reference) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_one_program_serves_batch_1_to_64_and_seq_1_to_max_and_matches_eager():
    model = _gpt()
    reference = copy.deepcopy(model)
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=_lm_loss,
                             dynamic=True, verify=True)
    eager_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    # The extremes and random sizes between; seq >= 2 first: that part is served by the first Program alone.
    shapes = [(4, 8), (64, MAX_SEQ), (1, MAX_SEQ), (1, 2), (64, 2)]
    shapes += [(rng.randint(1, 64), rng.randint(2, MAX_SEQ)) for _ in range(6)]
    for batch, seq in shapes:
        x, y = _batch(batch, seq, g)
        torch.testing.assert_close(trainer.step(x, y), _eager_step(reference, eager_opt, x, y), rtol=1e-5, atol=1e-6)
    assert trainer.report().compiles == 1, trainer.report().recompiles
    program = trainer.program
    assert [str(d) for d in program.var("idx").shape] == ["batch", "seq"]
    # Sequence length 1: the model's attention branches on it (a guard `Ne(seq, 1)`): one specialisation.
    for batch, seq in [(5, 1), (64, 1), (rng.randint(2, 63), 1)]:
        x, y = _batch(batch, seq, g)
        torch.testing.assert_close(trainer.step(x, y), _eager_step(reference, eager_opt, x, y), rtol=1e-5, atol=1e-6)
    report = trainer.report()
    assert report.compiles == 2, report.recompiles
    assert "shape guard failed" in report.recompiles[0] and "seq=1" in report.recompiles[0]
    x, y = _batch(9, 13, g)  # back to the first Program
    torch.testing.assert_close(trainer.step(x, y), _eager_step(reference, eager_opt, x, y), rtol=1e-5, atol=1e-6)
    assert trainer.program is program and trainer.report().compiles == 2
    _assert_same_params(model, reference)


def test_the_ir_of_a_dynamic_program_prints_parses_serialises_and_estimates_memory_as_a_formula():
    model = _gpt(layers=1)
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=_lm_loss,
                             dynamic=True)
    g = torch.Generator().manual_seed(0)
    trainer.step(*_batch(4, 8, g))
    program = trainer.program
    assert "idx: i64[batch,seq]" in str(program)
    for copy_ in (parse_program(str(program)), program_from_json(program_to_json(program))):
        assert copy_.var("idx").shape == program.var("idx").shape
        assert copy_.metadata["dynamic"] == program.metadata["dynamic"]
        verify(copy_)
    small = estimate_memory(program)  # at the traced sizes
    assert small.sizes == {"batch": 4, "seq": 8}  # the target's dims are the input's
    assert {"batch", "seq"} <= {s.name for s in sympy.sympify(small.formula).free_symbols}
    assert _evaluate(small.formula, small.sizes) == small.peak_bytes
    trainer.step(*_batch(32, 16, g))
    stats = trainer.memory_stats()  # for the last step's sizes
    assert stats["estimated_for_sizes"] == {"batch": 32, "seq": 16}
    assert _evaluate(stats["estimated_peak_formula"], stats["estimated_for_sizes"]) == stats["estimated_peak_bytes"]
    assert stats["estimated_peak_bytes"] > small.peak_bytes
    assert trainer.report().compiles == 1
    for batch, seq in [(3, 5), (6, 12)]:  # the eval step: one dynamic Program too
        x, _ = _batch(batch, seq, g)
        with torch.no_grad():
            expected = model.eval()(x)
        model.train()
        torch.testing.assert_close(trainer(x), expected, rtol=1e-5, atol=1e-6)
    assert [str(d) for d in trainer.eval_program.var("idx").shape] == ["batch", "seq"]
    assert trainer.report().compiles == 2


def _evaluate(formula: str, sizes: dict[str, int]) -> int:
    expr = sympy.sympify(formula)
    return int(expr.subs({s: sizes[s.name] for s in expr.free_symbols}))


def test_default_policy_compiles_static_first_then_symbolic_in_the_dims_that_changed():
    model = _gpt(layers=1)
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=_lm_loss)
    g = torch.Generator().manual_seed(0)
    trainer.step(*_batch(4, 8, g))
    assert trainer.program.var("idx").shape == (4, 8) and "dynamic" not in trainer.program.metadata
    trainer.step(*_batch(4, 12, g))  # seq changed: symbolic in seq only
    assert [str(d) for d in trainer.program.var("idx").shape] == ["4", "seq"]
    trainer.step(*_batch(4, 5, g))
    assert trainer.report().compiles == 2
    trainer.step(*_batch(6, 5, g))  # now the batch changes too
    trainer.step(*_batch(3, 9, g))
    report = trainer.report()
    assert report.compiles == 3, report.recompiles
    assert "traced symbolic in seq (idx dim 1)" in report.recompiles[0]
    assert "batch (idx dim 0)" in report.recompiles[1]


def test_dynamic_false_recompiles_per_shape_and_dynamic_dims_names_dims():
    model = MLP()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy,
                             dynamic=False)
    for rows in (8, 6):
        trainer.step(torch.randn(rows, 32), torch.randint(0, 10, (rows,)))
    assert trainer.report().compiles == 2 and trainer.program.var("x").shape == (6, 32)
    model = MLP()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy,
                             dynamic=False, dynamic_dims={"x": {0: "rows"}, "target": {0: "rows"}})
    for rows in (8, 6, 17):
        trainer.step(torch.randn(rows, 32), torch.randint(0, 10, (rows,)))
    assert trainer.report().compiles == 1 and str(trainer.program.var("x").shape) == "(rows, 32)"
    assert any(line.startswith("shape: rows = x.size(0)") for line in trainer.report().guards)


def test_bad_dynamic_arguments_are_clear_errors():
    model = MLP()
    with pytest.raises(StrategyError, match="dynamic must be None, True or False"):
        fleetc.compile(model, dynamic="yes")
    with pytest.raises(StrategyError, match=r"dynamic_dims\['x'\] must map a dim index to a name"):
        fleetc.compile(model, dynamic_dims={"x": [0]})
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy,
                             dynamic_dims={"inputs": {0: "batch"}})
    with pytest.raises(StrategyError, match="'inputs', which is not a tensor input of the step; its tensor "
                                            "inputs: x, target"):
        trainer.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))


def test_a_shape_guard_violation_raises_naming_the_dim_and_guard_under_on_guard_failure_error():
    model = _gpt(layers=1)
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=_lm_loss,
                             dynamic=True, on_guard_failure="error")
    g = torch.Generator().manual_seed(0)
    trainer.step(*_batch(4, 8, g))
    trainer.step(*_batch(7, 3, g))
    with pytest.raises(GuardError, match=r"shape guard failed: the guard Ne\(seq, 1\) fails for seq=1"):
        trainer.step(*_batch(4, 1, g))
    assert trainer.report().compiles == 1
    shapes = trainer._last_train.shapes  # what a call of another rank or an unequal target would hear
    assert shapes.failure([(2, 3, 4), (2, 3)]) == "idx has 3 dims, the Program was compiled for 2"
    assert shapes.failure([(2, 3), (2, 5)]) == "dim 1 of target is 5, the guard says target.size(1) == seq"
    assert shapes.passes([(2, 3), (2, 3)]) and not shapes.passes([(2, 3), (3, 2)])  # the labels' dims are the input's


def test_a_sequence_past_the_position_table_in_the_models_config_is_refused_by_its_shape_guard():
    model = _gpt(layers=1)
    model.config = types.SimpleNamespace(max_position_embeddings=MAX_SEQ)  # as a Hugging Face model carries it
    assert config_bounds(model) == {"seq": (MAX_SEQ, "config.max_position_embeddings")}
    assert config_bounds(torch.nn.Sequential(model)) == {"seq": (MAX_SEQ, "0.config.max_position_embeddings")}
    assert config_bounds(_gpt(layers=1)) == {}
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=_lm_loss,
                             dynamic=True)
    g = torch.Generator().manual_seed(0)
    for batch, seq in [(4, 8), (3, MAX_SEQ)]:  # the bound itself is served
        trainer.step(*_batch(batch, seq, g))
    assert trainer.report().compiles == 1
    assert any(line.startswith("shape: seq = idx.size(1), ") and line.endswith(
        f"<= seq <= {MAX_SEQ} (the bound is config.max_position_embeddings)") for line in trainer.report().guards)
    with pytest.raises(GuardError, match=rf"dim 1 of idx \(seq\) is {MAX_SEQ + 1}, above its bound {MAX_SEQ} "
                                         r"\(config.max_position_embeddings\): the model has no positions past it"):
        trainer.step(*_batch(2, MAX_SEQ + 1, g))
    assert trainer.report().compiles == 1


def test_dims_given_one_name_in_dynamic_dims_are_one_symbol_and_a_call_where_they_differ_recompiles():
    model = _gpt(layers=1)
    reference = copy.deepcopy(model)
    shared = {"idx": {0: "batch", 1: "seq"}, "target": {0: "batch", 1: "seq"}}  # the labels' seq is the input's
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=_lm_loss,
                             dynamic_dims=shared)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for batch, seq in [(4, 8), (3, 5), (7, MAX_SEQ)]:
        x, y = _batch(batch, seq, g)
        torch.testing.assert_close(trainer.step(x, y), _eager_step(reference, optimizer, x, y), rtol=1e-5, atol=1e-6)
    assert trainer.report().compiles == 1
    assert [str(d) for d in trainer.program.var("target").shape] == ["batch", "seq"]
    assert not [line for line in trainer.report().guards if "_2" in line]  # no second batch or seq symbol
    x, _ = _batch(4, 8, g)
    y = x.reshape(8, 4).contiguous()  # as many labels, in another shape: the tie's guard fails, and it recompiles
    torch.testing.assert_close(trainer.step(x, y), _eager_step(reference, optimizer, x, y), rtol=1e-5, atol=1e-6)
    report = trainer.report()
    assert report.compiles == 2 and "dim 0 of target is 8, the guard says target.size(0) == batch" in \
        report.recompiles[0]
    _assert_same_params(model, reference)


class _Crop(torch.nn.Module):
    """Reads an int argument as a size: `x[:, :keep]`."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, keep: int) -> torch.Tensor:
        return self.lin(x[:, :keep]).mean(1)


def test_an_int_argument_that_changes_is_traced_as_a_size_after_the_first_recompile():
    torch.manual_seed(0)
    model = _Crop()
    reference = copy.deepcopy(model)
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for keep in [3, 5, 7, 2, 9, 4]:
        x, y = torch.randn(4, 10, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(reference(x, keep), y)
        loss.backward()
        optimizer.step()
        torch.testing.assert_close(trainer.step(x, keep, y), loss.detach(), rtol=1e-5, atol=1e-6)
    report = trainer.report()
    assert report.compiles == 2, report.recompiles  # static at 3, then one Program for every other value
    assert report.recompiles[0].startswith("step 2: recompiled the train step: argument args[1] changed: 3 when "
                                           "compiled, now 5 (an int argument, now traced as a size)")
    assert "traced symbolic in keep" in report.recompiles[0]
    assert any(line.startswith("shape: keep = keep.size(0)") for line in report.guards), report.guards
    # keep=1 breaks the guard `Ne(Min(10, keep), 1)`: one Program at keep=1, then both serve their sizes.
    for keep in [1, 6, 1]:
        x, y = torch.randn(4, 10, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(reference(x, keep), y)
        loss.backward()
        optimizer.step()
        torch.testing.assert_close(trainer.step(x, keep, y), loss.detach(), rtol=1e-5, atol=1e-6)
    assert trainer.report().compiles == 3, trainer.report().recompiles
    _assert_same_params(model, reference)
    other = _Crop()
    still = fleetc.compile(other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1), loss_fn=F.cross_entropy,
                           dynamic=False)
    for keep in [3, 5, 7]:
        still.step(torch.randn(4, 10, 8), keep, torch.randint(0, 4, (4,)))
    assert still.report().compiles == 3  # dynamic=False: every value is its own Program


def test_gradient_merge_with_a_ragged_last_micro_batch_matches_eager():
    k_steps, sizes = 2, [(4, 8), (4, 8), (4, 6), (3, 6)]  # the last micro-batch is smaller
    model = _gpt(layers=1)
    reference = copy.deepcopy(model)
    trainer = fleetc.compile(model, merge_strategy(k_steps), optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                             loss_fn=_lm_loss, dynamic=True, verify=True)
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for i, (batch, seq) in enumerate(sizes):
        x, y = _batch(batch, seq, g)
        loss = _lm_loss(reference(x), y)
        (loss / k_steps).backward()
        if (i + 1) % k_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(trainer.step(x, y), loss.detach(), rtol=1e-5, atol=1e-6)
    assert "gradient_merge" in trainer.report().applied and trainer.report().compiles == 1
    _assert_same_params(model, reference)


def _strategy(kind: str) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    if kind == "fusion":
        for flag in FUSION_FLAGS:
            setattr(strategy.build_strategy, flag, True)
    elif kind == "auto_fusion":
        strategy.build_strategy.enable_auto_fusion = True
    elif kind == "recompute":
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": "auto"}
    elif kind == "amp":
        strategy.amp = True
    return strategy


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fusion", "auto_fusion", "recompute", "amp"])
def test_passes_on_a_dynamic_program_match_the_static_programs(kind):
    """Each pass on the symbolic Program gives what it gives on a Program specialised to each size."""
    shapes = [(4, 8), (9, 5), (2, 12)]
    dynamic, static = _gpt(layers=1), _gpt(layers=1)
    trainers = [fleetc.compile(model, _strategy(kind), optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                               loss_fn=_lm_loss, dynamic=flag, verify=True)
                for model, flag in ((dynamic, True), (static, False))]
    g = torch.Generator().manual_seed(0)
    for batch, seq in shapes:
        x, y = _batch(batch, seq, g)
        torch.testing.assert_close(trainers[0].step(x, y), trainers[1].step(x, y), rtol=1e-5, atol=1e-6)
    assert trainers[0].report().compiles == 1 and trainers[1].report().compiles == len(shapes)
    if kind == "auto_fusion":  # its kernels take constant sizes: it specialises, and says so
        assert "symbolic shapes" in trainers[0].report().skipped["auto_fusion"]
        assert "auto_fusion" in trainers[1].report().applied
    else:
        assert trainers[0].report().applied == trainers[1].report().applied
    _assert_same_params(dynamic, static)


def test_a_dynamic_eval_program_exports_and_the_export_serves_other_batch_sizes(tmp_path):
    model = MLP()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy,
                             dynamic=True)
    trainer.step(torch.randn(8, 32), torch.randint(0, 10, (8,)))
    trainer(torch.randn(5, 32))
    assert str(trainer.eval_program.var("x").shape) == "(batch, 32)"
    save_inference_model(trainer, str(tmp_path / "out"), ["x"])
    loaded = fleetc.load_inference_model(str(tmp_path / "out"))
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model.eval()(x), rtol=1e-5, atol=1e-6)
