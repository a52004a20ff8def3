"""Parameter-server mode: roles, placement, server update rules and the worker Program rewrite in one process; then
real jobs on loopback (servers and workers as processes, torch.distributed.rpc) checked against single-process
training on the global batch, plus async / geo convergence, checkpoint resume and faults."""
from __future__ import annotations

import argparse
import os
import time

import pytest
import torch
from torch import nn
from zoo import CTR

import fleetc
from fleet.ps_jobs import ps_program, reference_run, run_jobs, worker_results
from fleet.ps_workers import PS_OPTIMIZERS, batches
from fleetc.comm.ps.placement import place
from fleetc.comm.ps.role import role_from_ps_environment
from fleetc.comm.ps.rules import dense_update, new_state, optimizer_spec, sparse_update
from fleetc.errors import FleetcError, PassError
from fleetc.fleet.launch import ps_environments
from fleetc.fleet.ps_trainer import embedding_tables, ps_mode
from fleetc.ir.verifier import verify
from fleetc.passes.parameter_server import ParameterServerRewrite

ATOL = 1e-5
RTOL = 1e-4


# ----- one process -------------------------------------------------------------------------------
def test_role_from_paddle_environment(monkeypatch):
    monkeypatch.setenv("PADDLE_PSERVERS_IP_PORT_LIST", "127.0.0.1:6001,127.0.0.1:6002")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "3")
    monkeypatch.setenv("TRAINING_ROLE", "TRAINER")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "2")
    role = role_from_ps_environment()
    assert (role.is_server, role.index, role.server_num, role.worker_num, role.name, role.rpc_rank) == \
        (False, 2, 2, 3, "worker2", 4)
    monkeypatch.setenv("TRAINING_ROLE", "PSERVER")
    monkeypatch.setenv("POD_IP", "127.0.0.1")
    monkeypatch.setenv("PADDLE_PORT", "6002")
    role = role_from_ps_environment()
    assert (role.is_server, role.index, role.name, role.rpc_rank) == (True, 1, "server1", 1)
    monkeypatch.setenv("PADDLE_PORT", "7000")
    with pytest.raises(FleetcError, match="127.0.0.1:7000 .* is not in PADDLE_PSERVERS_IP_PORT_LIST"):
        role_from_ps_environment()
    monkeypatch.setenv("TRAINING_ROLE", "TRAINER")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "3")
    with pytest.raises(FleetcError, match="worker index 3 is outside the job's 3 worker"):
        role_from_ps_environment()
    monkeypatch.setenv("TRAINING_ROLE", "HEAD")
    with pytest.raises(FleetcError, match="TRAINING_ROLE must be PSERVER or TRAINER"):
        role_from_ps_environment()


def test_launcher_gives_every_process_its_role(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    options = argparse.Namespace(server_num=2, worker_num=3, servers=None, nproc_per_node=None, gpus=None, ips=None,
                                 script=str(script))
    jobs = ps_environments(options)
    assert [name for name, _ in jobs] == ["server0", "server1", "worker0", "worker1", "worker2"]
    endpoints = jobs[0][1]["PADDLE_PSERVERS_IP_PORT_LIST"].split(",")
    assert len(set(endpoints)) == 2 and all(e.startswith("127.0.0.1:") for e in endpoints)
    assert jobs[1][1]["PADDLE_PORT"] == endpoints[1].rpartition(":")[2] and jobs[1][1]["TRAINING_ROLE"] == "PSERVER"
    assert jobs[4][1]["PADDLE_TRAINER_ID"] == "2" and jobs[4][1]["PADDLE_TRAINERS_NUM"] == "3"
    options.nproc_per_node = 2
    with pytest.raises(fleetc.errors.CommandError, match="--nproc_per_node, --gpus and --ips are for collective"):
        ps_environments(options)
    options.nproc_per_node, options.servers = None, "127.0.0.1:1,127.0.0.1:2"
    options.server_num = 3
    with pytest.raises(fleetc.errors.CommandError, match="--servers lists 2 endpoint"):
        ps_environments(options)


def test_placement_dense_by_size_tables_by_row():
    model = CTR(rows=101)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    placement = place(shapes, embedding_tables(model), 2)
    assert placement.tables == {"embedding.weight": (101, 16)}
    assert placement.dense == {"fc1.weight": 0, "fc1.bias": 1, "fc2.weight": 1, "fc2.bias": 1}
    assert (placement.local_rows(101, 0), placement.local_rows(101, 1)) == (51, 50)


def test_mode_follows_paddle_a_sync_semantics():
    strategy = fleetc.DistributedStrategy()
    config = fleetc.strategy.resolve_strategy(strategy)
    assert ps_mode(config) == ("async", 0)  # Paddle's defaults: a_sync=True, k_steps=-1
    strategy.a_sync_configs = {"k_steps": 4}
    assert ps_mode(fleetc.strategy.resolve_strategy(strategy)) == ("geo", 4)
    strategy.a_sync = False
    assert ps_mode(fleetc.strategy.resolve_strategy(strategy)) == ("sync", 0)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam", "momentum", "adamw"])
def test_server_dense_rule_is_torch_optim(kind):
    make = {**PS_OPTIMIZERS,
            "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2)}[kind]
    torch.manual_seed(0)
    reference = nn.Parameter(torch.randn(5, 3))
    optimizer = make([reference])
    spec = optimizer_spec(optimizer)
    mine = reference.detach().clone()
    state = new_state(spec, mine, table=False)
    for _ in range(3):
        grad = torch.randn(5, 3)
        reference.grad = grad.clone()
        optimizer.step()
        dense_update(spec, mine, grad, state, spec["lr"])
    torch.testing.assert_close(mine, reference.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_server_table_rule_is_lazy(kind):
    """Rows follow the sparse rule: SparseAdam for Adam; SGD and Adagrad equal their dense rule (zero gradient rows
    unchanged); untouched rows never move."""
    torch.manual_seed(0)
    table = nn.Embedding(10, 4, sparse=kind == "adam")
    reference = (torch.optim.SparseAdam(table.parameters(), lr=1e-2) if kind == "adam"
                 else PS_OPTIMIZERS[kind](table.parameters()))
    spec = optimizer_spec(PS_OPTIMIZERS[kind]([nn.Parameter(torch.zeros(1))]))
    mine = table.weight.detach().clone()
    state = new_state(spec, mine, table=True)
    untouched = mine[9].clone()
    for step in range(3):
        ids = torch.tensor([[1, 2, 2], [5, step, 1]])
        weights = torch.randn(2, 3, 4)
        reference.zero_grad()
        (table(ids) * weights).sum().backward()
        reference.step()
        rows, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        grads = torch.zeros(len(rows), 4).index_add_(0, inverse, weights.reshape(-1, 4))
        sparse_update(spec, mine, rows, grads, state, spec["lr"])
    torch.testing.assert_close(mine, table.weight.detach(), atol=1e-6, rtol=1e-5)
    assert torch.equal(mine[9], untouched)


def test_unsupported_optimizer_is_a_clear_error():
    with pytest.raises(FleetcError, match="supports SGD, Adam, AdamW, Adagrad; RMSprop is not one of them"):
        optimizer_spec(torch.optim.RMSprop([nn.Parameter(torch.zeros(1))]))


def test_rewrite_pulls_rows_and_pushes_gradients():
    program = ps_program(CTR(rows=50), "sync")
    rewritten, report = ParameterServerRewrite().run(program, None)
    verify(rewritten, after_pass="parameter_server")
    types = [op.type for op in rewritten.global_block.ops]
    assert types[0] == "fleetc.ps_pull_dense" and types[-1] == "fleetc.ps_push"
    assert types.count("fleetc.ps_pull_sparse") == 1
    assert not {"aten.embedding.default", "aten.embedding_dense_backward.default", "fleetc.sgd"} & set(types)
    assert "embedding.weight@GRAD" not in rewritten.global_block.vars
    assert report.stats == {"sparse_pulls": 1, "dense_pulled": 4, "optimizer_ops_moved_to_servers": 5,
                            "dense_grads_pushed": 4, "sparse_grads_pushed": 1}
    text = str(rewritten)
    assert "fleetc.ps_pull_sparse(ids, 'embedding.weight')" in text and "ps_push(lr@group0" in text


def test_geo_rewrite_keeps_local_training_and_syncs():
    program = ps_program(CTR(rows=50), "geo")
    rewritten, report = ParameterServerRewrite().run(program, None)
    verify(rewritten, after_pass="parameter_server")
    types = [op.type for op in rewritten.global_block.ops]
    assert "fleetc.sgd" in types and types[-1] == "fleetc.ps_geo_sync" and "fleetc.ps_geo_note_rows" in types
    assert report.stats["geo_synced_params"] == 5
    # the table's rows are updated lazily, as on the servers: no dense table gradient, no dense table update
    update = rewritten.global_block.ops[-2]
    assert update.type == "fleetc.ps_geo_update_rows" and update.outputs == ["embedding.weight"]
    assert "aten.embedding_dense_backward.default" not in types and "embedding.weight@GRAD" not in rewritten.global_block.vars
    assert [op.attrs["param"] for op in rewritten.global_block.ops if op.type == "fleetc.sgd"] == [
        "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert report.stats["tables_updated_lazily"] == 1


def test_table_read_outside_a_lookup_is_refused():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(50, 16)

        def forward(self, ids):
            return (self.embedding(ids) @ self.embedding.weight.t()).mean(dim=(1, 2))

    with pytest.raises(PassError, match=r"reads the embedding table 'embedding.weight'; .* only be used through "
                                        r"nn.Embedding lookups"):
        ParameterServerRewrite().run(ps_program(Tied(), "sync"), None)


# ----- jobs --------------------------------------------------------------------------------------
STEPS = 4
SYNC_JOBS = {
    "ctr_sgd": (2, 2, {"model": "ctr", "opt": "sgd", "steps": STEPS, "save": "CKPT"}),
    "ctr_adam": (2, 2, {"model": "ctr", "opt": "adam", "steps": STEPS}),
    "mlp_adagrad": (2, 2, {"model": "mlp", "opt": "adagrad", "steps": STEPS}),
    "bag_adagrad": (2, 2, {"model": "bag", "opt": "adagrad", "steps": STEPS}),  # nn.EmbeddingBag + nn.Embedding
}
if os.environ.get("FLEETC_FULL"):
    SYNC_JOBS["ctr_adagrad"] = (2, 2, {"model": "ctr", "opt": "adagrad", "steps": STEPS})


@pytest.fixture(scope="module")
def sync_jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ps_sync")
    jobs = {name: (s, w, {**c, "save": str(tmp / "ckpt")} if "save" in c else c) for name, (s, w, c) in SYNC_JOBS.items()}
    start = time.monotonic()
    ranks = run_jobs(tmp, jobs, deadline_s=300, parallel=True)
    return tmp, ranks, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SYNC_JOBS))
def test_sync_equals_single_process_on_the_global_batch(sync_jobs, name):
    tmp, ranks, _ = sync_jobs
    servers, workers, config = SYNC_JOBS[name]
    results = worker_results(tmp, name, ranks[name], workers)
    losses, params = reference_run(config, STEPS)
    mean_losses = [sum(r["losses"][i] for r in results) / workers for i in range(STEPS)]
    torch.testing.assert_close(mean_losses, losses, atol=ATOL, rtol=RTOL)
    for result in results:
        for key, value in params.items():
            torch.testing.assert_close(result["params"][key], value, atol=ATOL, rtol=RTOL, msg=lambda m: f"{key}: {m}")
    program = results[0]["program"]
    assert "fleetc.ps_pull_dense(" in program and "fleetc.ps_push(" in program
    assert ("fleetc.ps_pull_sparse(ids, 'embedding.weight')" in program) == (config["model"] == "ctr")


@pytest.mark.slow
def test_inference_export_reads_the_servers_weights(sync_jobs):
    tmp, ranks, _ = sync_jobs
    results = worker_results(tmp, "ctr_sgd", ranks["ctr_sgd"], 2)
    exported = fleetc.load_inference_model(str(tmp / "ctr_sgd" / "inference"))
    model = CTR()
    model.load_state_dict(results[0]["params"])
    ids = batches(SYNC_JOBS["ctr_sgd"][2], 1)[0][0].chunk(2)[0]  # the shape trained on (CTR flattens it)
    torch.testing.assert_close(exported(ids), model(ids).detach(), atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_sparse_pull_moves_only_the_batch_rows(sync_jobs):
    tmp, ranks, _ = sync_jobs
    results = worker_results(tmp, "ctr_sgd", ranks["ctr_sgd"], 2)
    for me, result in enumerate(results):
        unique_rows = sum(len(torch.unique(ids.chunk(2)[me])) for ids, _ in batches(SYNC_JOBS["ctr_sgd"][2], STEPS))
        stats = result["stats"]
        assert stats["pull_sparse_rows"] == unique_rows
        assert stats["pull_sparse_bytes"] == unique_rows * 16 * 4  # rows × dim × fp32, not the 100k-row table
        assert stats["push_sparse_bytes"] == unique_rows * 16 * 4
        dense_bytes = sum(p.numel() * 4 for n, p in CTR().named_parameters() if n != "embedding.weight")
        assert stats["pull_dense_bytes"] == STEPS * dense_bytes


@pytest.mark.slow
def test_checkpoint_from_the_servers_resumes_the_job(sync_jobs, tmp_path):
    tmp, _, _ = sync_jobs
    config = {**SYNC_JOBS["ctr_sgd"][2], "load": str(tmp / "ckpt"), "seed": 1}
    config.pop("save")
    config["start"] = STEPS
    results = worker_results(tmp_path, "resume", run_jobs(tmp_path, {"resume": (2, 2, config)})["resume"], 2)
    _, params = reference_run({**config, "steps": 2 * STEPS}, 2 * STEPS)
    for key, value in params.items():
        torch.testing.assert_close(results[0]["params"][key], value, atol=ATOL, rtol=RTOL)


CONVERGE_STEPS = 40
ASYNC_JOBS = {
    "async": (2, 2, {"model": "ctr", "opt": "adagrad", "steps": CONVERGE_STEPS, "a_sync": True, "k_steps": 0}),
    "geo": (2, 2, {"model": "ctr", "opt": "adagrad", "steps": CONVERGE_STEPS, "a_sync": True, "k_steps": 4,
                   "thread_barrier": True}),
    "dead_worker": (1, 2, {"model": "ctr", "opt": "sgd", "steps": 3, "die_at_step": 1, "timeout": 10}),
    "dead_server": (1, 1, {"model": "ctr", "opt": "sgd", "steps": 100_000, "server_dies": True, "timeout": 10}),
}


@pytest.fixture(scope="module")
def async_jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ps_async")
    start = time.monotonic()
    ranks = run_jobs(tmp, ASYNC_JOBS, deadline_s=300, parallel=True)
    return tmp, ranks, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "geo"])
def test_async_and_geo_converge_near_sync(async_jobs, mode):
    tmp, ranks, _ = async_jobs
    servers, workers, config = ASYNC_JOBS[mode]
    results = worker_results(tmp, mode, ranks[mode], workers)
    sync_losses, _ = reference_run(config, CONVERGE_STEPS)  # sync mode equals this (tested above)
    losses = [sum(r["losses"][i] for r in results) / workers for i in range(CONVERGE_STEPS)]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 0.01, f"{mode}: the loss did not decrease ({first:.4f} -> {last:.4f})"
    assert last < sum(sync_losses[-10:]) / 10 + 0.05, f"{mode}: {last:.4f} vs sync {sum(sync_losses[-10:]) / 10:.4f}"
    program = results[0]["program"]
    if mode == "geo":
        assert "fleetc.ps_geo_sync(" in program and "fleetc.adagrad" not in program.split("ps_geo_sync")[1]
        assert results[0]["stats"]["pull_dense_bytes"] > 0
    decisions = " ".join(results[0]["report"].get("decisions", []))
    expected = {"async": "async, each push is applied as it arrives",
                "geo": "geo, local updates and parameter deltas sent every 4 step(s); use_thread_barrier"}[mode]
    assert expected in decisions


@pytest.mark.slow
def test_dead_worker_is_a_clear_error_within_the_rpc_timeout(async_jobs):
    tmp, ranks, _ = async_jobs
    server, worker0, worker1 = ranks["dead_worker"]
    assert worker1.returncode == 3  # it died on purpose
    assert worker0.returncode == 1 and server.returncode == 1, "a process hung or succeeded"
    assert "ParameterServerError: parameter server server0 failed during the push of step 2" in worker0.output
    assert "another worker may have died" in worker0.output
    assert "worker 1 sent nothing for 10 s (the rpc timeout)" in server.output


@pytest.mark.slow
def test_dead_server_is_a_clear_error_on_the_workers(async_jobs):
    tmp, ranks, _ = async_jobs
    processes = ranks["dead_server"]
    servers = ASYNC_JOBS["dead_server"][0]
    assert processes[0].returncode == 4  # server 0 died on purpose
    for worker in processes[servers:]:
        assert worker.returncode == 1, f"worker {worker.rank} hung or succeeded:\n{worker.output[-2000:]}"
        assert "ParameterServerError: parameter server server" in worker.output
