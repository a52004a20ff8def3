"""`fleetc shard-plan`'s measured ranks: the real trainer, one rank of 64 at a time, under torch's fake process group.

The static estimate (passes/sharding/estimate.py) and the trainer's measurement (memory_stats()["sharding"]) are
computed independently; for the ranks run, each of parameter, gradient and optimizer-state bytes must agree within
10%, at stages 1, 2 and 3.
"""
from __future__ import annotations

import contextlib
import io
import json
import pathlib

import pytest
import torch.distributed as dist
from cli_factories import mlp_adam

import fleetc
from fleetc.cli import main
from fleetc.comm.fake_group import fake_process_group, under_fake_group
from fleetc.errors import CollectiveError
from fleetc.fleet.sharding_estimate import (
    Measured,
    measure_ranks,
    measurement_notes,
    plan_for_world,
    representative_ranks,
)
from fleetc.fleet.trainer import DataParallelTrainer
from fleetc.passes.sharding.estimate import RankPlan

WORLD = 64
KINDS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "total_bytes")


def strategy(stage: int, dp: int = 1) -> fleetc.DistributedStrategy:
    s = fleetc.DistributedStrategy()
    s.sharding = True
    s.sharding_configs = {"stage": stage, "sharding_degree": WORLD // dp}
    if dp > 1:
        s.hybrid_configs = {"dp_degree": dp}
    return s


def rank_trainer(stage: int, dp: int):
    spec = mlp_adam()
    trainer = DataParallelTrainer(spec["model"], strategy(stage, dp), optimizer=spec["optimizer"],
                                  loss_fn=spec["loss_fn"])
    return trainer, spec["args"], {}


@pytest.mark.parametrize(("stage", "dp"), [(1, 1), (2, 1), (3, 1), (2, 2)])
def test_measured_bytes_of_64_ranks_under_the_fake_group_match_the_estimate(stage, dp):
    spec = mlp_adam()
    trainer = fleetc.compile(spec["model"], strategy(stage, dp), optimizer=spec["optimizer"],
                             loss_fn=spec["loss_fn"])
    trainer.step(*spec["args"])
    mesh, plans = plan_for_world(trainer, WORLD)
    assert (mesh.dp, mesh.sharding, len(plans)) == (dp, WORLD // dp, WORLD // dp)
    ranks = representative_ranks(plans)
    assert ranks[0] == 0 and ranks[-1] == WORLD // dp - 1
    measured = measure_ranks(lambda: rank_trainer(stage, dp), mesh, ranks)
    assert not dist.is_initialized()  # each rank's fake group is gone
    assert [m.rank for m in measured] == ranks
    for m in measured:
        assert m.stats["stage"] == stage and m.stats["degree"] == WORLD // dp
        estimate = plans[m.rank]
        for kind in KINDS:
            assert m.stats[kind] == pytest.approx(getattr(estimate, kind), rel=0.10, abs=0), (m.rank, kind)
        # the collective-answered checks were skipped and said so, not passed
        assert any(check.startswith("plan check") for check in m.skipped), m.skipped
    if stage == 3:  # and what is gathered in flight
        assert [m.stats["gathered_in_flight_bytes"] for m in measured] == \
            [plans[m.rank].gathered_in_flight_bytes for m in measured]


def test_shard_plan_prints_the_measured_column_and_names_the_fake_group(tmp_path):
    path = tmp_path / "stage2.json"
    path.write_text(json.dumps({"sharding": True, "sharding_configs": {"stage": 2}}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["shard-plan", "cli_factories:mlp_adam", "--world-size", str(WORLD), "--strategy", str(path),
                     "--measure-ranks", "0,5"]) == 0
    lines = out.getvalue().splitlines()
    assert lines[1].split()[-2:] == ["measured", "MB"]
    rows = {int(row[0]): row for line in lines if (row := line.split())[0].isdigit()}
    assert len(rows) == WORLD and rows[1][-1] == "-" and rows[63][-1] == "-"
    for rank in (0, 5):
        assert float(rows[rank][-1]) == pytest.approx(float(rows[rank][-2]), abs=1e-3)
    assert any("rank(s) 0, 5 ran the trainer's first step under torch's fake process group" in line
               for line in lines)
    assert "skipped under the fake process group (its collectives return no data): plan check" in out.getvalue()
    assert not any("differs from the estimate" in line for line in lines)
    assert main(["shard-plan", "cli_factories:mlp_adam", "--world-size", "4", "--strategy", str(path),
                 "--measure-ranks", "0,7"]) == 2  # outside the group: a one-line error


def test_the_fake_group_refuses_a_live_group_and_is_destroyed_on_error(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(CollectiveError, match="already initialized"), fake_process_group(0, WORLD):
            pass
        assert dist.get_backend() == "gloo"  # the real group is untouched
    finally:
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="factory failed"), fake_process_group(3, WORLD):
        assert under_fake_group() and dist.get_rank() == 3 and dist.get_world_size() == WORLD
        raise RuntimeError("factory failed")
    assert not dist.is_initialized() and not under_fake_group()


def test_the_docs_example_is_what_shard_plan_prints():
    """docs/sharding.md's shard-plan example: every line it shows (up to its '...') is a line of the real output."""
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "sharding.md").read_text()
    block = page.split("$ fleetc shard-plan cli_factories:gpt_sharded --world-size 64\n", 1)[1].split("```", 1)[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["shard-plan", "cli_factories:gpt_sharded", "--world-size", "64"]) == 0
    printed = out.getvalue().splitlines()
    shown = [line.removesuffix("...") for line in block.splitlines() if line.strip() != "..."]
    assert len(shown) == 9
    for line in shown:
        assert any(p.startswith(line) for p in printed), line


def test_a_measurement_more_than_10_percent_off_gets_a_line():
    plans = [RankPlan(0, 1, 1000, 1000, 0), RankPlan(1, 0, 1000, 0, 0, gathered_in_flight_bytes=4096)]
    stats = {"total_bytes": 2150, "gathered_in_flight_bytes": 0}  # rank 0: 7.5% over; rank 1: 115% over, none in flight
    measured = [Measured(0, 0, stats, ("plan check",)), Measured(1, 1, stats, ("plan check",))]
    notes = measurement_notes(plans, measured)
    assert [n for n in notes if "differs" in n] == [
        "rank 1: measured 0.002 MB differs from the estimate 0.001 MB by more than 10%",
        "rank 1: measured in flight 0.000 MB differs from the estimate 0.004 MB by more than 10%"]
    assert notes[-1] == "skipped under the fake process group (its collectives return no data): plan check"
