"""Parameter-server job bodies (`python -m fleet.ps_workers NAME ARGS_JSON OUT_DIR`, servers and workers alike)."""
from __future__ import annotations

import os
import threading
import time

import torch
from torch import nn
from zoo import CTR, CTR_ENTRY, MLP, ZOO

import fleetc
import fleetc.fleet as fleet
from fleet.spawn import run_worker

PS_OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
}


class BagCTR(nn.Module):
    """CTR with two tables: the mean of every field's row in an nn.EmbeddingBag, and the first field's row in an
    nn.Embedding."""

    def __init__(self, rows: int = 100_000, dim: int = 16):
        super().__init__()
        self.bag = nn.EmbeddingBag(rows, dim, mode="mean")
        self.embedding = nn.Embedding(rows, dim)
        self.fc = nn.Linear(2 * dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.bag(ids), self.embedding(ids[:, 0])], dim=1)).squeeze(1)


def make_model(config: dict) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    if config["model"] == "ctr":
        return CTR(rows=config.get("rows", 100_000)), CTR_ENTRY
    if config["model"] == "bag":
        return BagCTR(), CTR_ENTRY
    return MLP(), ZOO["mlp"]


def batches(config: dict, steps: int) -> list:
    """The global batches: the same on every worker and in the single-process reference."""
    g = torch.Generator().manual_seed(config.get("seed", 1))
    entry = ZOO["mlp"] if config["model"] == "mlp" else CTR_ENTRY
    return [entry.make_batch(g)[0] for _ in range(steps)]


def make_strategy(config: dict) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    strategy.a_sync = config.get("a_sync", False)
    strategy.a_sync_configs = {"k_steps": config.get("k_steps", 0)}
    if config.get("thread_barrier"):
        strategy.execution_strategy.use_thread_barrier = True
    if config.get("gradient_merge"):
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": config["gradient_merge"], "avg": True}
    strategy.amp = bool(config.get("amp"))
    return strategy


def grad_clip(config: dict) -> fleetc.ClipGradByGlobalNorm | None:
    return fleetc.ClipGradByGlobalNorm(config["clip"]) if config.get("clip") else None


def _die_after_setup() -> None:
    """Server 0 dies 2 s after worker 0 set it up (workers are mid-training then)."""
    from fleetc.comm.ps import server
    while not server.current_server().ready.done():
        time.sleep(0.1)
    time.sleep(2)
    os._exit(4)


def train(rank: int, config: dict, out_dir: str) -> None:
    """A server serves; a worker trains `steps` steps on its shard of each global batch and saves what it saw."""
    fleet.init(timeout=config.get("timeout", 20))
    model, entry = make_model(config)
    fleet.distributed_optimizer(PS_OPTIMIZERS[config["opt"]](model.parameters()), make_strategy(config))
    if fleet.is_server():
        fleet.init_server(config.get("load"))
        if config.get("server_dies") and fleet.server_index() == 0:
            threading.Thread(target=_die_after_setup, daemon=True).start()
        fleet.run_server()
        return
    fleet.init_worker()
    trainer = fleet.distributed_model(model, loss_fn=entry.loss_fn, verify=True, grad_clip=grad_clip(config))
    me, workers = fleet.worker_index(), fleet.worker_num()
    losses = []
    start = config.get("start", 0)
    for step, args in enumerate(batches(config, start + config["steps"])[start:]):
        if step == config.get("die_at_step") and me == config.get("die_worker", 1):
            os._exit(3)
        losses.append(float(trainer.step(*(a.chunk(workers)[me] for a in args))))
    if config.get("save") and fleet.is_first_worker():
        fleet.save_persistables(config["save"])
        fleet.save_inference_model(None, os.path.join(out_dir, "inference"), ["ids"], None)
    trainer.pull_all()
    result = {"losses": losses, "params": {k: v.clone() for k, v in model.state_dict().items()},
              "stats": dict(trainer.client.stats), "program": str(trainer.program),
              "report": {"decisions": list(trainer.report().decisions), "text": str(trainer.report())}}
    fleet.barrier_worker()
    torch.save(result, os.path.join(out_dir, f"worker{me}.pt"))
    fleet.stop_worker()


if __name__ == "__main__":
    run_worker(globals(), "PADDLE_TRAINER_ID")
