"""Ranks that disagree, die or hang make the others fail with a clear error within the timeout, never hang."""
from __future__ import annotations

import pytest

from fleet.spawn import start

TIMEOUT_S = 4.0


@pytest.mark.slow
def test_a_dead_or_hung_rank_fails_the_survivor_within_the_timeout(tmp_path):
    # Both jobs run at once: the hung one spends most of its time asleep or waiting out the timeout.
    jobs = {mode: start(2, "faults", {"mode": mode, "hang_s": 30}, tmp_path / mode, deadline_s=90,
                        collective_timeout_s=TIMEOUT_S) for mode in ("die", "hang")}
    for mode, job in jobs.items():
        survivor, missing = job.collect()
        assert survivor.returncode == 0, f"{mode}: {survivor.output[-3000:]}"
        assert missing.returncode == 3, f"{mode}: {missing.output[-3000:]}"
        outcome = survivor.result
        assert "different collectives" in outcome["mismatch"] and "rank(s) [1]" in outcome["mismatch"]
        assert "different collectives" in missing.result["mismatch"]
        assert "second_step" not in outcome
        assert "bucket0" in outcome["error"] and "rank(s) [1] did not reach it" in outcome["error"], mode
        # the timeout (hang) or the broken connection (death), plus the window for survivors to report
        assert outcome["seconds"] < TIMEOUT_S + 3.0 + 5.0, mode
        if mode == "hang":
            assert outcome["seconds"] > TIMEOUT_S - 0.5  # it waited for the timeout, not less


@pytest.mark.slow
def test_ranks_that_disagree_or_die_early_fail_cleanly_and_checkpoints_keep_each_ranks_rng(tmp_path):
    survivor, dead = start(2, "disagreements", {}, tmp_path, deadline_s=120, collective_timeout_s=TIMEOUT_S).collect()
    assert survivor.returncode == 0, survivor.output[-3000:]
    assert dead.returncode == 3, dead.output[-3000:]
    for result in (survivor.result, dead.result):
        assert "ranks disagree on the model: rank(s) [1]" in result["model"]
        assert "ranks disagree on the optimizer's settings: rank(s) [1]" in result["optimizer"]
        assert "weight_decay" in result["optimizer"]
        first, again = result["resumed"]
        assert [float(x) for x in first] == [float(x) for x in again]  # same data, weights and dropout masks
        assert result["versions"] == ["LATEST", "v000001"]
    assert "DistStoreError" not in survivor.output
    assert "rank(s) [1] did not reach it" in survivor.result["after_death"] or \
        "plan check" in survivor.result["after_death"], survivor.result["after_death"]
