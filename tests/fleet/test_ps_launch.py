"""`fleetc run --server_num S --worker_num W` end to end: the real launcher (`python -m fleetc run`) starts servers and
workers on loopback with Paddle's role environment; the example's sync training equals single-process training, and
a failing process stops the whole job quickly with a clear message."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from fleet.spawn import ROOT

EXAMPLE = ROOT / "examples" / "train_ps.py"
STEPS = 4


def _example():
    spec = importlib.util.spec_from_file_location("train_ps_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fleetc_run(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", FLEETC_COLLECTIVE_TIMEOUT="60")
    return subprocess.run([sys.executable, "-m", "fleetc", "run", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _reference(example, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Eager single-process training on the whole batches, with the example's model and optimizer."""
    model = example.make_model()
    optimizer = example.make_optimizer(model)
    losses = []
    for ids, labels in example.global_batches(steps):
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(ids), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_fleetc_run_trains_the_example_with_two_servers_and_two_workers(tmp_path):
    done = _fleetc_run("--server_num", "2", "--worker_num", "2", str(EXAMPLE), str(STEPS), str(tmp_path),
                       timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"step {STEPS - 1}: loss" in done.stdout and "(worker 0 of 2, 2 servers)" in done.stdout
    assert "parameter server: a_sync=False: sync" in done.stdout  # the report's mode line
    results = [torch.load(tmp_path / f"worker{i}.pt", weights_only=False) for i in range(2)]
    losses, params = _reference(_example(), STEPS)
    torch.testing.assert_close([sum(r["losses"][i] for r in results) / 2 for i in range(STEPS)], losses,
                               atol=1e-5, rtol=1e-4)
    for result in results:
        assert "fleetc.ps_pull_sparse(ids, 'embedding.weight')" in result["program"]
        for key, value in params.items():
            torch.testing.assert_close(result["params"][key], value, atol=1e-5, rtol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
    assert (tmp_path / "ckpt").is_dir()


FAILING = """\
import os, sys, time
with open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w") as handle:
    handle.write(os.environ["TRAINING_ROLE"] + " " + os.environ["PADDLE_PSERVERS_IP_PORT_LIST"])
if os.environ.get("PADDLE_TRAINER_ID") == "1":  # fail once all four processes are up
    deadline = time.monotonic() + 30
    while len([f for f in os.listdir(sys.argv[1]) if f.endswith(".pid")]) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    sys.exit(3)
time.sleep(120)
"""


def test_fleetc_run_stops_the_job_when_a_process_fails(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILING)
    start = time.monotonic()
    done = _fleetc_run("--server_num", "2", "--worker_num", "2", str(script), str(tmp_path), timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"fleetc run: {script} failed in worker1 (exit status 3); the other processes were stopped" in done.stdout
    assert time.monotonic() - start < 45, "the launcher waited for the sleeping processes instead of stopping them"
    roles = {}
    for pid_file in tmp_path.glob("*.pid"):
        role, endpoints = pid_file.read_text().split()
        roles[role] = roles.get(role, 0) + 1
        assert len(endpoints.split(",")) == 2 and all(e.startswith("127.0.0.1:") for e in endpoints.split(","))
        with pytest.raises(ProcessLookupError):  # stopped and reaped by the launcher
            os.kill(int(pid_file.stem), 0)
    assert roles == {"PSERVER": 2, "TRAINER": 2}
