"""Shared by the fusion tests: strategies with chosen fusion flags, pass statistics, captured Programs."""
from __future__ import annotations

import torch

import fleetc
from fleetc.passes.order import fusion_flags

FUSION_FLAGS = tuple(fusion_flags())


def fusion_strategy(*flags: str) -> fleetc.DistributedStrategy:
    """A strategy with exactly `flags` on among the fusion flags (fuse_bn_add_act_ops defaults to on)."""
    unknown = set(flags) - set(FUSION_FLAGS)
    assert not unknown, unknown
    strategy = fleetc.DistributedStrategy()
    for flag in FUSION_FLAGS:
        setattr(strategy.build_strategy, flag, flag in flags)
    return strategy


def stats(trainer: fleetc.CompiledTrainer, pass_name: str) -> dict:
    return trainer.report().stats.get(pass_name, {})


def op_types(program) -> list[str]:
    return [op.type for _, op in program.walk_ops()]


def assert_close_all(got, want, **tol) -> None:
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, **tol)
