"""The real-architecture zoo's text models train with dynamic batch and sequence sizes (docs/dynamic_shapes.md).

One Program serves batch 1..64 and sequence 2..max_position_embeddings, plus one specialisation for sequence 1
(the models branch on `q_len > 1`); the number of compiles is asserted, every step's loss and the final parameters
match eager PyTorch, and a sequence past the config's position table is refused by its shape guard.
"""
from __future__ import annotations

import copy
import os
import random

import pytest
import torch
from factories import ARCHITECTURES, VOCAB

import fleetc
from fleetc.errors import GuardError

MAX = 64  # the factories' max_position_embeddings / n_positions
# How each architecture's batch is built: next-token targets, one class per sequence, or seq2seq labels.
KINDS = {"gpt2": "lm", "llama": "lm", "bert": "class", "t5": "seq2seq"}
FAST = ["gpt2", "llama", "bert"]  # T5: two symbolic captures of 1-4 min each on 2 loaded cores: FLEETC_FULL=1


def _batch(kind: str, batch: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=g)
    if kind == "class":
        return tokens, torch.randint(0, 3, (batch,), generator=g)
    if kind == "seq2seq":  # the decoder's length is its own dim
        labels = torch.randint(0, VOCAB, (batch, random.Random(batch * seq).randint(2, MAX)), generator=g)
        return tokens, labels.roll(1, dims=1), labels
    return tokens, torch.randint(0, VOCAB, (batch, seq), generator=g)


def _eager_step(model, optimizer, loss_fn, args) -> torch.Tensor:
    optimizer.zero_grad()
    loss = loss_fn(model(*args[:-1]), args[-1])
    loss.backward()
    optimizer.step()
    return loss.detach()


def _shapes(first_seq_one: bool) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(the sizes served by the symbolic Program: extremes and random ones between, those of sequence 1)."""
    rng = random.Random(0)
    general = [(4, 8), (64, MAX), (1, MAX), (1, 2), (64, 2)] + [(rng.randint(1, 64), rng.randint(2, MAX))
                                                                   for _ in range(3)]
    ones = [(5, 1), (1, 1), (rng.randint(2, 63), 1)]
    return (ones[:1] + general + ones[1:], []) if first_seq_one else (general, ones)


def _check(name: str, first_seq_one: bool = False) -> None:
    case, kind = ARCHITECTURES[name](), KINDS[name]
    torch.manual_seed(0)
    model = case.make_model()
    reference = copy.deepcopy(model)
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=case.loss_fn,
                             dynamic=True)
    eager_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)

    def step(batch: int, seq: int) -> None:
        args = _batch(kind, batch, seq, g)
        torch.manual_seed(batch * 1000 + seq)  # dropout draws the same masks in both
        loss = trainer.step(*args)
        torch.manual_seed(batch * 1000 + seq)
        torch.testing.assert_close(loss, _eager_step(reference, eager_opt, case.loss_fn, args), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{name} at batch {batch}, seq {seq}: {m}")

    general, ones = _shapes(first_seq_one)
    for batch, seq in general:
        step(batch, seq)
    # Sequence 1 first: the size-oblivious trace fails on `q_len > 1`, so that Program is traced at seq 1; the
    # next size compiles the symbolic one.
    assert trainer.report().compiles == 1 + first_seq_one, trainer.report().recompiles
    for batch, seq in ones:
        step(batch, seq)
    report = trainer.report()
    assert report.compiles == 2, report.recompiles
    step(9, 13)  # back on the symbolic Program
    assert trainer.report().compiles == 2
    assert [str(d) for d in trainer.program.var("input_ids").shape] == ["batch", "seq"]
    for (param, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, param=param: f"{name} {param}: {m}")
    if kind != "seq2seq":  # T5's relative positions have no table: no bound
        assert any("<= seq <= 64 (the bound is " in line for line in trainer.report().guards), trainer.report().guards
        with pytest.raises(GuardError, match=rf"dim 1 of input_ids \(seq\) is {MAX + 1}, above its bound {MAX} "
                                             r"\(config\.(max_position_embeddings|n_positions)\)"):
            trainer.step(*_batch(kind, 2, MAX + 1, g))
        assert trainer.report().compiles == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", FAST)
def test_text_model_trains_dynamic_batch_and_sequence_with_one_program_and_one_size_1_specialisation(name):
    _check(name, first_seq_one=name == "gpt2")


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="T5's symbolic captures take minutes: "
                                                               "FLEETC_FULL=1 runs it")
def test_t5_trains_dynamic_encoder_and_decoder_lengths():
    _check("t5")
