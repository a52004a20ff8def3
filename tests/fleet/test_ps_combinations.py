"""Parameter-server mode with gradient merge, gradient clipping and AMP: what is built (gradient merge in every mode;
clipping and AMP in geo mode, where the worker runs its own update) equals single-process training, and what is
not built (clipping and AMP in sync / async mode) is refused by name, saying why. Also geo's own local update, with
lazy table rows, against one process."""
from __future__ import annotations

import pytest
import torch
from zoo import CTR

import fleetc
from fleet.ps_jobs import compiled_reference, ps_program, reference_run, run_jobs, worker_results
from fleetc.errors import PassError
from fleetc.ir.verifier import verify
from fleetc.passes.parameter_server import ParameterServerRewrite

ATOL = 1e-5
RTOL = 1e-4


def _strategy(**fields) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    for name, value in fields.items():
        setattr(strategy, name, value)
    return strategy


# ----- one process: the rewrite ------------------------------------------------------------------
def test_sync_push_carries_the_gradient_merge():
    program = ps_program(CTR(rows=50), "sync", merge_steps=4, merge_avg=True)
    rewritten, report = ParameterServerRewrite().run(program, None)
    verify(rewritten, after_pass="parameter_server")
    push = rewritten.global_block.ops[-1]
    assert push.type == "fleetc.ps_push" and push.kwargs == {"merge_steps": 4, "merge_avg": True}
    assert "merge_steps=4" in str(rewritten)
    assert "ps_push sends the mean of the gradients every 4 steps" in " ".join(report.notes)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("combination", ["clip", "amp"])
def test_sync_and_async_refuse_clipping_and_amp_by_name(mode, combination):
    program = (ps_program(CTR(rows=50), mode, grad_clip=fleetc.ClipGradByGlobalNorm(1.0)) if combination == "clip"
               else ps_program(CTR(rows=50), mode, strategy=_strategy(amp=True)))
    what = {"clip": r"gradient clipping: .* no server sees the whole gradient whose norm the clip needs",
            "amp": r"AMP \(strategy.amp\): .* loss-scaled gradients"}[combination]
    with pytest.raises(PassError, match=rf"parameter-server {mode} mode cannot be combined with {what}.*[Gg]eo mode "
                                        r"\(a_sync_configs.k_steps > 0\)"):
        ParameterServerRewrite().run(program, None)


def test_geo_keeps_clipping_amp_and_gradient_merge_in_the_local_update():
    strategy = _strategy(amp=True, gradient_merge=True, gradient_merge_configs={"k_steps": 2})
    program = ps_program(CTR(rows=50), "geo", strategy=strategy, grad_clip=fleetc.ClipGradByGlobalNorm(1.0))
    rewritten, _ = ParameterServerRewrite().run(program, None)
    verify(rewritten, after_pass="parameter_server")
    types = [op.type for _, op in rewritten.walk_ops()]
    assert {"fleetc.clip_by_global_norm", "fleetc.conditional_block", "fleetc.scale_loss_grad"} <= set(types)
    assert rewritten.global_block.ops[-1].type == "fleetc.ps_geo_sync"


def test_local_sgd_is_refused_in_every_mode():
    program = ps_program(CTR(rows=50), "geo")
    program.metadata["local_sgd"] = {"k_steps": 2}
    with pytest.raises(PassError, match="geo mode cannot be combined with local SGD: it averages parameters over "
                                        "collective data-parallel ranks"):
        ParameterServerRewrite().run(program, None)


# ----- jobs --------------------------------------------------------------------------------------
STEPS = 6
JOBS = {
    # sync, 2 servers x 2 workers: equal to eager gradient merge on the global batches
    "sync_merge": (2, 2, {"model": "ctr", "opt": "adagrad", "steps": STEPS, "gradient_merge": 2}),
    # geo with one worker and one server: its deltas come back unchanged, so it equals local training
    "geo_merge_clip": (1, 1, {"model": "ctr", "opt": "adagrad", "steps": STEPS, "a_sync": True, "k_steps": 3,
                              "gradient_merge": 2, "clip": 0.01}),
    "geo_amp": (1, 1, {"model": "mlp", "opt": "adam", "steps": STEPS, "a_sync": True, "k_steps": 3, "amp": True}),
    # geo alone: the table's rows are updated lazily on the worker (Adagrad: the same as the dense rule)
    "geo_rows": (1, 1, {"model": "ctr", "opt": "adagrad", "steps": STEPS, "a_sync": True, "k_steps": 3}),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ps_combinations")
    return tmp, run_jobs(tmp, JOBS, deadline_s=300, parallel=True)


@pytest.mark.slow
def test_sync_gradient_merge_equals_single_process_merge(jobs):
    tmp, ranks = jobs
    results = worker_results(tmp, "sync_merge", ranks["sync_merge"], 2)
    losses, params = reference_run(JOBS["sync_merge"][2], STEPS)
    torch.testing.assert_close([(a + b) / 2 for a, b in zip(*(r["losses"] for r in results))], losses,
                               atol=ATOL, rtol=RTOL)
    for result in results:
        for key, value in params.items():
            torch.testing.assert_close(result["params"][key], value, atol=ATOL, rtol=RTOL,
                                       msg=lambda m, key=key: f"{key}: {m}")
        assert result["stats"]["pull_dense_bytes"] > 0
    report = results[0]["report"]["text"]
    assert "gradient_merge: parameter-server sync mode: the servers run the update, so the worker's ps_push " \
           "merges the gradients and sends them every 2 steps" in report
    assert "merge_steps=2" in results[0]["program"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["geo_merge_clip", "geo_amp", "geo_rows"])
def test_geo_with_local_clipping_amp_and_merge_equals_one_process(jobs, name):
    tmp, ranks = jobs
    (result,) = worker_results(tmp, name, ranks[name], 1)
    losses, params = compiled_reference(JOBS[name][2], STEPS)
    torch.testing.assert_close(result["losses"], losses, atol=ATOL, rtol=RTOL)
    for key, value in params.items():
        torch.testing.assert_close(result["params"][key], value, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert "fleetc.ps_geo_sync(" in result["program"]
    assert ("fleetc.ps_geo_update_rows(" in result["program"]) == (name == "geo_rows")  # else the update stays dense
