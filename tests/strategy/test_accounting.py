"""Every strategy field is accounted for: a non-default value changes the compiled Program or what the compile
reports (a pass report, a strategy decision, a 'not applied' line, a mesh note or a clear error), never nothing.

The check runs the pass pipeline on captured zoo Programs stamped as one of two data-parallel ranks (so the
allreduce settings have gradients to act on), with the field's switch on where it has one.
"""
from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from helpers.data_parallel import captured_program
from strategy.fieldcases import FIELDS, PATHS, good_value, set_path
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.comm.mesh import resolve_mesh
from fleetc.errors import FleetcError
from fleetc.fleet.trainer import sharding_metadata
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Program
from fleetc.passes.base import PassReport
from fleetc.passes.manager import History, PassManager, PassRecord
from fleetc.passes.order import ordered_passes, strategy_requests_without_pass
from fleetc.runtime.execution import ExecutionPlan
from fleetc.strategy import resolve_conflicts, resolve_strategy
from fleetc.strategy.distributed import DISTRIBUTED_SCHEMA

# A non-default value that asks for exactly what fleetc does anyway: (field → why that is the behaviour asked for).
AS_ASKED = {
    "a_sync": "False asks for collective training, the only kind fleetc runs (True is reported when set)",
}

# Values where the table's generic sample is the default's effective value (None means bfloat16 on CPU).
SAMPLES = {"amp_configs.dtype": "float16", "recompute_configs.checkpoints": ["fc1"],
           "sharding_configs.segment_broadcast_MB": 0.001}  # small enough to split the mlp's gathers

# Switch-like settings a field only matters under, beyond its own section's switch.
CONTEXT = {
    "recompute_configs": {"recompute_configs.checkpoints": "auto"},
    "gradient_merge_configs": {"gradient_merge_configs.k_steps": 2},
    "amp_configs.use_fp16_guard": {"amp_configs.use_pure_fp16": True},
    "last_comm_group_size_MB": {"fuse_grad_size_in_MB": 1},
    "hierarchical_allreduce_inter_nranks": {"use_hierarchical_allreduce": True},
    # the mlp has no device_guard stages: cut it in two; the captured batch (16 samples) is one micro-batch
    "pipeline_configs": {"hybrid_configs.pp_degree": 2, "pipeline_configs.micro_batch_size": 16},
}


@cache
def _captured(optimizer: str) -> Program:
    return captured_program("mlp") if optimizer == "momentum" else _captured_with(optimizer)


def _captured_with(optimizer: str) -> Program:
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, optimizer=OPTIMIZERS[optimizer](model.parameters()), loss_fn=entry.loss_fn)
    trainer.step(*entry.make_batch(torch.Generator().manual_seed(1))[0])
    return trainer.history["remove_noop_views"].program


def _strategy(path: str, value: Any = None) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    section = path.partition(".")[0]
    switch = section.removesuffix("_configs")
    if "." in path and switch != section and switch in DISTRIBUTED_SCHEMA.fields:
        setattr(strategy, switch, True)
    for key in (section, path):
        for field, setting in CONTEXT.get(key, {}).items():
            if field != path:
                set_path(strategy, field, setting)
    if value is not None:
        set_path(strategy, path, value)
    return strategy


def _outcome(strategy: fleetc.DistributedStrategy, optimizer: str) -> tuple:
    """Everything a compile shows for `strategy`: the final Program, each pass's report, the decisions, the
    'not applied' lines, the two-rank mesh notes and how the runtime runs the steps, or the error it stops with."""
    try:
        config, decisions = resolve_conflicts(resolve_strategy(strategy))
        mesh, mesh_notes = resolve_mesh(config, 2)
        program = _captured(optimizer).clone()
        program.metadata["data_parallel"] = {"world_size": 2 // mesh.pp}  # as the Fleet trainer stamps it
        if config.sharding:  # what the Fleet trainer stamps on rank 0 of two
            program.metadata["sharding"] = sharding_metadata(mesh, 0)
        history = History([PassRecord("start", program, PassReport("start"), 0.0, estimate_memory(program))])
        passes = [p for p in ordered_passes(config) if p.name != "remove_noop_views"]
        final = PassManager(passes).run(program, config, history)
    except FleetcError as exc:
        return ("error", f"{type(exc).__name__}: {exc}")
    reports = [(r.name, r.report.changed, r.report.skipped_reason, tuple(r.report.notes), sorted(r.report.stats.items()))
               for r in history[1:]]
    return (str(final), reports, [str(d) for d in decisions], strategy_requests_without_pass(config), mesh_notes,
            ExecutionPlan.from_config(config).lines())


def _optimizer_for(path: str) -> str:
    return "adam" if path.startswith("lamb") else "momentum"


@pytest.mark.parametrize("path", PATHS)
def test_a_non_default_value_changes_the_program_or_the_report(path):
    if path in AS_ASKED:
        pytest.skip(f"{path}: {AS_ASKED[path]}")
    value = SAMPLES.get(path, good_value(FIELDS[path]))
    optimizer = _optimizer_for(path)
    baseline = _outcome(_strategy(path), optimizer)
    changed = _outcome(_strategy(path, value), optimizer)
    assert changed != baseline, f"{path} = {value!r} changed neither the Program nor the compile report"


def test_the_table_of_as_asked_fields_names_real_fields_at_a_non_default_value():
    for path in AS_ASKED:
        assert good_value(FIELDS[path]) != FIELDS[path].default
