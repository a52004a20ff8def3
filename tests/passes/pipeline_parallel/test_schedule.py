"""Pipeline schedules as data, run by the simulator with no processes: bubbles, memory, deadlocks, validation."""
from __future__ import annotations

import pytest

import fleetc
from fleetc.errors import StrategyError
from fleetc.passes.pipeline_parallel.schedule import (
    BACKWARD_WEIGHT,
    FORWARD,
    OPTIMIZER,
    SCHEDULE_MODES,
    Action,
    Schedule,
    build_schedule,
)
from fleetc.passes.pipeline_parallel.simulate import ScheduleError, simulate

SHAPES = [(2, 2), (2, 4), (4, 4), (4, 8), (3, 7), (4, 12)]


@pytest.mark.parametrize("mode", ["FThenB", "1F1B"])
@pytest.mark.parametrize("p,m", SHAPES)
def test_bubble_fraction_of_fthenb_and_1f1b(mode, p, m):
    sim = simulate(build_schedule(mode, p, m))
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (3, 6, 4)])
def test_bubble_fraction_of_interleaved_1f1b(p, m, v):
    sim = simulate(build_schedule("VPP", p, m, v))
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_1f1b_holds_at_most_p_microbatches_where_fthenb_holds_m(p, m):
    assert simulate(build_schedule("1F1B", p, m)).peak_in_flight[0] == p
    assert simulate(build_schedule("FThenB", p, m)).peak_in_flight[0] == m
    assert simulate(build_schedule("1F1B", p, m)).peak_in_flight == tuple(range(p, 0, -1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 7)])
def test_zbh1_has_fewer_bubbles_than_1f1b_and_the_same_activations(p, m):
    zb, ofob = simulate(build_schedule("ZBH1", p, m)), simulate(build_schedule("1F1B", p, m))
    assert sum(zb.idle) < sum(ofob.idle)
    assert zb.idle[0] == pytest.approx(p - 1)   # ZB-H1's (p-1)(F+B-W) with unit F, B, W
    assert zb.peak_in_flight == ofob.peak_in_flight
    assert max(zb.peak_until_weights) == max(ofob.peak_until_weights) == p   # deferred W keeps 1F1B's peak
    weights = [a for a in zb.schedule.actions[0] if a.kind == BACKWARD_WEIGHT]
    assert sorted(a.microbatch for a in weights) == list(range(m))


def test_schedule_prints_per_rank_actions():
    text = str(build_schedule("1F1B", 2, 3))
    assert text.splitlines() == [
        "schedule 1F1B: 2 rank(s), 3 micro-batch(es)",
        ("  rank 0: F0@s0 send_act0@s0->r1 F1@s0 send_act1@s0->r1 recv_grad0@s0<-r1 B0@s0 F2@s0 send_act2@s0->r1 "
         "recv_grad1@s0<-r1 B1@s0 recv_grad2@s0<-r1 B2@s0 opt"),
        ("  rank 1: recv_act0@s1<-r0 F0@s1 B0@s1 send_grad0@s1->r0 recv_act1@s1<-r0 F1@s1 B1@s1 send_grad1@s1->r0 "
         "recv_act2@s1<-r0 F2@s1 B2@s1 send_grad2@s1->r0 opt")]


@pytest.mark.parametrize("mode", SCHEDULE_MODES)
def test_every_mode_runs_every_chunk_once_per_microbatch(mode):
    v = 2 if mode == "VPP" else 1
    schedule = build_schedule(mode, 3, 6, v)
    simulate(schedule)
    for rank, actions in enumerate(schedule.actions):
        forwards = sorted((a.stage, a.microbatch) for a in actions if a.kind == FORWARD)
        assert forwards == sorted((s, i) for s in range(rank, 3 * v, 3) for i in range(6))
        assert actions[-1].kind == OPTIMIZER


def test_deadlock_is_reported_with_the_waiting_ranks():
    good = build_schedule("1F1B", 2, 2)
    # rank 0 waits for a gradient before sending the activation rank 1 needs to produce it
    rank0 = list(good.actions[0])
    send = rank0.pop(1)
    rank0.insert(rank0.index(Action("backward", 0, 0)) + 1, send)
    bad = Schedule("broken", 2, 2, 1, (tuple(rank0), good.actions[1]))
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 waits at recv_grad0@s0<-r1; rank 1 waits at "
                                            r"recv_act0@s1<-r0"):
        simulate(bad)


def test_action_before_its_input_is_reported():
    good = build_schedule("FThenB", 1, 2)
    bad = Schedule("broken", 1, 2, 1, ((Action("backward", 0, 0), *good.actions[0]),))
    with pytest.raises(ScheduleError, match="rank 0 runs B0@s0 before it has its own forward"):
        simulate(bad)


def test_unknown_schedule_mode_suggests_the_closest():
    with pytest.raises(StrategyError, match="did you mean 'ZBH1'"):
        build_schedule("ZB-H1", 2, 4)
    strategy = fleetc.DistributedStrategy()
    with pytest.raises(StrategyError, match="did you mean 'FThenB'"):
        strategy.pipeline_configs = {"schedule_mode": "FthenB"}
    strategy.pipeline_configs = {"schedule_mode": "VPP", "vpp_degree": 2}
    assert strategy.pipeline_configs["vpp_degree"] == 2


def test_settings_a_mode_cannot_use_are_errors():
    with pytest.raises(StrategyError, match="vpp_degree=2 needs schedule_mode 'VPP'"):
        build_schedule("1F1B", 2, 4, 2)
    with pytest.raises(StrategyError, match="multiple of the stage count 4"):
        build_schedule("VPP", 4, 6, 2)
