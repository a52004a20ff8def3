"""The Fleet API in one process (world size 1), the `fleetc run` command line, and checkpoints."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import eager_step
from zoo import OPTIMIZERS, ZOO

import fleetc
import fleetc.fleet as fleet
from fleet.spawn import ROOT
from fleetc.cli import build_parser, main
from fleetc.errors import FleetcError
from fleetc.fleet.launch import torchrun_arguments


@pytest.fixture
def single_fleet(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    fleet.init(is_collective=True)
    yield fleet
    fleet.stop_worker()


def test_single_process_role(single_fleet):
    assert (fleet.worker_index(), fleet.worker_num(), fleet.is_first_worker(), fleet.is_worker()) == (0, 1, True, True)
    assert fleet.worker_endpoints() == ["127.0.0.1:0"] and fleet.worker_endpoints(to_string=True) == "127.0.0.1:0"
    fleet.barrier_worker()
    fleet.init_worker()


def test_explicit_role_maker_is_checked():
    role = fleet.UserDefinedRoleMaker(current_id=1, worker_endpoints=["10.0.0.1:6170", "10.0.0.2:6170"]).role()
    assert (role.rank, role.world_size, role.endpoints[1]) == (1, 2, "10.0.0.2:6170")
    with pytest.raises(FleetcError, match="rank 2 is outside the world of 2"):
        fleet.UserDefinedRoleMaker(current_id=2, worker_endpoints=["a:1", "b:1"])


def test_parameter_server_calls_outside_a_ps_job_say_what_is_missing(monkeypatch):
    for call in (fleet.init_server, fleet.run_server, fleet.server_num, fleet.server_endpoints):
        with pytest.raises(FleetcError, match=r"is a parameter-server call: .*--server_num S --worker_num W"):
            call()
    for key in ("TRAINING_ROLE", "PADDLE_PSERVERS_IP_PORT_LIST", "PADDLE_TRAINERS_NUM"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(FleetcError, match=r"is_collective=False.*TRAINING_ROLE \(PSERVER or TRAINER\), "
                                          r"PADDLE_PSERVERS_IP_PORT_LIST .*PADDLE_TRAINERS_NUM .* is not set"):
        fleet.init(is_collective=False)


def test_uninitialized_fleet_is_an_error():
    with pytest.raises(FleetcError, match=r"call fleet.init\(is_collective=True\) first"):
        fleet.worker_num()


def test_distributed_model_in_one_process_trains_like_eager(single_fleet, tmp_path):
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    model = entry.make_model()
    eager = entry.make_model()
    eager.load_state_dict(model.state_dict())
    eager_opt = OPTIMIZERS["adamw"](eager.parameters())
    opt = fleet.distributed_optimizer(OPTIMIZERS["adamw"](model.parameters()), fleet.DistributedStrategy())
    trainer = fleet.distributed_model(model, loss_fn=entry.loss_fn, verify=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        args, _ = entry.make_batch(g)
        torch.testing.assert_close(trainer.step(*args), eager_step(eager, eager_opt, entry.loss_fn, args, {}))
    assert trainer.report().skipped["insert_allreduce"] == "single process: no collectives needed"
    opt.set_lr(0.5)
    assert opt.get_lr() == 0.5 and opt.param_groups[0]["lr"] == 0.5
    opt.set_state_dict(opt.state_dict())

    fleet.save_persistables(str(tmp_path / "ckpt"))
    fleet.save_persistables(str(tmp_path / "ckpt"))  # replaces the old checkpoint
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left behind
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    args, _ = entry.make_batch(g)
    trainer.step(*args)
    fleet.load_persistables(str(tmp_path / "ckpt"))
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    assert float(opt.state_dict()["state"][0]["step"]) == 2.0
    with pytest.raises(fleetc.CheckpointError, match="not a fleetc checkpoint"):
        fleet.load_persistables(str(tmp_path))


def test_compile_with_a_distributed_optimizer_gives_a_data_parallel_trainer(single_fleet):
    from fleetc.fleet.trainer import DataParallelTrainer

    model = ZOO["mlp"].make_model()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(fleetc.compile(model, optimizer=opt), DataParallelTrainer)


def _batches(count: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 32, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(count)]


def _eager_loop(opt, model, batches) -> None:
    for x, y in batches:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.clear_grad()


def test_eager_step_applies_gradient_merge(single_fleet):
    """Regression: the eager step() used to ignore the strategy and update every step."""
    strategy = fleet.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 4, "avg": True}
    torch.manual_seed(0)
    model = ZOO["mlp"].make_model()
    reference = ZOO["mlp"].make_model()
    reference.load_state_dict(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), strategy)
    batches = _batches(8)
    _eager_loop(opt, model, batches[:3])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "updated before the 4th step"
    _eager_loop(opt, model, batches[3:])
    # the reference: one update per 4 batches, on the mean of their gradients
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for start in (0, 4):
        for x, y in batches[start:start + 4]:
            (torch.nn.functional.cross_entropy(reference(x), y) / 4).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_eager_gradient_merge_resumes_mid_accumulation_from_state_dict(single_fleet, tmp_path):
    """Regression: the eager accumulators were not in state_dict(), so a run saved after 2 of 4 micro-steps and
    resumed updated with half the merged gradients. Resumed through a file, it equals the run never stopped."""
    strategy = fleet.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 4, "avg": True}
    batches = _batches(8)

    def fresh(state=None):
        torch.manual_seed(0)
        model = ZOO["mlp"].make_model()
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.01), strategy)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.set_state_dict(state["opt"])
        return model, opt

    model, opt = fresh()
    _eager_loop(opt, model, batches)
    model, opt = fresh()
    _eager_loop(opt, model, batches[:6])  # one update, then 2 of the next 4 micro-steps
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    _eager_loop(opt, model, batches[6:])  # the saving run goes on unchanged
    uninterrupted = model.state_dict()
    resumed_model, resumed_opt = fresh(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    _eager_loop(resumed_opt, resumed_model, batches[6:])
    for name, value in resumed_model.state_dict().items():
        assert torch.equal(value, uninterrupted[name]), name
    assert "fleetc_gradient_merge" not in resumed_opt.state_dict()  # k-th micro-step done: nothing under way
    plain = fleet.distributed_optimizer(torch.optim.Adam(ZOO["mlp"].make_model().parameters()), strategy)
    assert plain.state_dict().keys() == {"state", "param_groups"}  # no accumulation: torch's own format


def test_eager_step_refuses_amp_and_points_to_compile(single_fleet):
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    model = ZOO["mlp"].make_model()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fleetc.StrategyError, match=r"strategy.amp is on.*fleetc.compile"):
        _eager_loop(opt, model, _batches(1))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    trainer = fleet.distributed_model(model, loss_fn=ZOO["mlp"].loss_fn)  # the compiled path still takes it
    trainer.step(torch.randn(4, 32), torch.randint(0, 10, (4,)))


def _run_options(*argv):
    return build_parser().parse_args(["run", *argv])


def test_run_translates_to_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    assert torchrun_arguments(_run_options("--nproc_per_node", "2", str(script), "--lr", "3")) == [
        "--standalone", "--nproc_per_node", "2", "--max_restarts", "0", str(script), "--lr", "3"]
    assert torchrun_arguments(_run_options("--gpus", "0,1,2", "--ips", "h1,h2", str(script)))[:7] == [
        "--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h1:29500", "--nproc_per_node"]


def test_run_rejects_bad_input(capsys, tmp_path):
    assert main(["run", "--nproc_per_node", "2", str(tmp_path / "missing.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "t.py").write_text("")
    assert main(["run", "--gpus", "a,b", str(tmp_path / "t.py")]) == 2
    assert "--gpus" in capsys.readouterr().err
    assert main(["run", "--ips", "a,b", "--master_port", "99999", str(tmp_path / "t.py")]) == 2
    err = capsys.readouterr().err
    assert "--master_port 99999 is not a TCP port" in err and err.count("\n") == 1
    assert main(["run", "--ips", "no-such-host.invalid,b", str(tmp_path / "t.py")]) == 2
    assert "cannot resolve the rendezvous host 'no-such-host.invalid'" in capsys.readouterr().err


@pytest.mark.slow
def test_readme_example_runs_in_two_processes():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", FLEETC_COLLECTIVE_TIMEOUT="60")
    done = subprocess.run([sys.executable, "-m", "fleetc", "run", "--nproc_per_node", "2", "examples/train_dp.py", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "step 1: loss" in done.stdout and "rank 0 of 2" in done.stdout
    assert "fuse_all_reduce_ops: allreduces_before=4, buckets=1" in done.stdout
