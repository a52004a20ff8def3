"""Ranks that disagree, die or hang make the others fail with a clear error within the timeout, never hang."""
from __future__ import annotations

import pytest

from distributed.spawn import spawn

TIMEOUT_S = 4.0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["die", "hang"])
def test_missing_rank_fails_the_survivor_within_the_timeout(tmp_path, mode):
    results = spawn(2, "faults", {"mode": mode, "hang_s": 10}, tmp_path, deadline_s=60,
                    collective_timeout_s=TIMEOUT_S)
    survivor, missing = results
    assert survivor.returncode == 0, survivor.output[-3000:]
    assert missing.returncode == 3
    outcome = survivor.result
    assert "different collectives" in outcome["mismatch"] and "rank(s) [1]" in outcome["mismatch"]
    assert "different collectives" in missing.result["mismatch"]
    assert "second_step" not in outcome
    assert "bucket0" in outcome["error"] and "rank(s) [1] did not reach it" in outcome["error"]
    # the timeout (hang) or the broken connection (death), plus the window for survivors to report
    assert outcome["seconds"] < TIMEOUT_S + 3.0 + 5.0
    if mode == "hang":
        assert outcome["seconds"] > TIMEOUT_S - 0.5  # it waited for the timeout, not less
