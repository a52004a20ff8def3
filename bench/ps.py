"""Parameter-server throughput and traffic on the CTR-style model (100k x 16 table + MLP), through `fleetc run`.

Usage: OMP_NUM_THREADS=1 python bench/ps.py [--steps 30] [--batch 256]
For each mode (sync, async, geo with k_steps=4) and 1 or 2 servers it launches
`python -m fleetc run --server_num S --worker_num 2 bench/ps.py ...` on loopback; worker 0 times `--steps`
steps after 3 warm-up steps (compiling) and reports samples/s over the global batch and the bytes per step it
pulled and pushed, sparse (table rows) and dense. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from zoo import CTR  # noqa: E402  (the parameter-server tests' model)

import fleetc  # noqa: E402
import fleetc.fleet as fleet  # noqa: E402

WARMUP = 3
MODES = {"sync": (False, 0), "async": (True, 0), "geo": (True, 4)}


def job(mode: str, steps: int, batch: int, out: str) -> None:
    """One process of the job (server or worker)."""
    fleet.init(timeout=120)
    torch.manual_seed(0)
    model = CTR()
    strategy = fleetc.DistributedStrategy()
    strategy.a_sync, k_steps = MODES[mode]
    strategy.a_sync_configs = {"k_steps": k_steps}
    fleet.distributed_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.05), strategy)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    fleet.init_worker()
    trainer = fleet.distributed_model(model, loss_fn=F.binary_cross_entropy_with_logits)
    g = torch.Generator().manual_seed(fleet.worker_index())
    local = batch // fleet.worker_num()
    data = [(torch.randint(0, 100_000, (local, 4), generator=g), torch.rand(local, generator=g).round())
            for _ in range(WARMUP + steps)]
    for ids, labels in data[:WARMUP]:
        trainer.step(ids, labels)
    before = dict(trainer.client.stats)
    start = time.perf_counter()
    for ids, labels in data[WARMUP:]:
        trainer.step(ids, labels)
    seconds = time.perf_counter() - start
    moved = {k: (v - before.get(k, 0)) / steps for k, v in trainer.client.stats.items()}
    fleet.barrier_worker()
    if fleet.is_first_worker():
        with open(out, "w") as handle:
            json.dump({"samples_per_s": batch * steps / seconds, **moved}, handle)
    fleet.stop_worker()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256, help="global batch (split over 2 workers)")
    options = parser.parse_args()
    rows = []
    for mode in MODES:
        for servers in (1, 2):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "result.json")
                subprocess.run([sys.executable, "-m", "fleetc", "run", "--server_num", str(servers), "--worker_num",
                                "2", __file__, "--job", mode, str(options.steps), str(options.batch), out], check=True)
                with open(out) as handle:
                    rows.append((mode, servers, json.load(handle)))
    print(f"| mode | servers | samples/s | sparse pull B/step | dense pull B/step | sparse push B/step | "
          f"dense push B/step |  (2 workers, global batch {options.batch}, worker 0)")
    print("|---|---|---|---|---|---|---|")
    for mode, servers, r in rows:
        print(f"| {mode} | {servers} | {r['samples_per_s']:.0f} | {r.get('pull_sparse_bytes', 0):.0f} | "
              f"{r.get('pull_dense_bytes', 0):.0f} | {r.get('push_sparse_bytes', 0):.0f} | "
              f"{r.get('push_dense_bytes', 0):.0f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        job(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
