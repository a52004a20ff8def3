"""The allocation-peak measurement (fleetc/runtime/memory.py) that the bench compares eager and fleetc with."""
from __future__ import annotations

import torch
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.runtime.memory import allocation_peak_bytes

KIB = 1024


def _transient(kib: int) -> None:
    torch.empty(kib * KIB // 4).fill_(1.0)


def test_peak_is_what_the_function_allocated_above_what_was_live():
    assert allocation_peak_bytes(lambda: _transient(64)) == 64 * KIB


def test_tensors_kept_from_an_earlier_measurement_do_not_count():
    kept = []
    assert allocation_peak_bytes(lambda: kept.append(torch.empty(256 * KIB // 4))) == 256 * KIB
    assert allocation_peak_bytes(lambda: _transient(64)) == 64 * KIB  # the 256 KiB still alive are not counted
    assert kept


def test_memory_stats_gives_eager_peak_for_the_last_batch_without_touching_the_model_or_the_draws():
    entry = ZOO["gpt"]  # dropout: the eager step draws masks, which must not shift the compiled steps' draws
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, optimizer=OPTIMIZERS["adam"](model.parameters()), loss_fn=entry.loss_fn,
                             measure_memory=True)
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(1))
    trainer.step(*args, **kwargs)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    rng = torch.get_rng_state()
    stats = trainer.memory_stats()
    assert torch.equal(rng, torch.get_rng_state())
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), name
    # eager holds parameters, Adam's two moments and every gradient at the update, at least
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stats["eager_peak_bytes"] >= 4 * state
    assert 0.5 < stats["measured_peak_bytes"] / stats["eager_peak_bytes"] < 2
