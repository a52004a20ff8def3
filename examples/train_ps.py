"""Parameter-server training with fleetc's Fleet API: run it with
`fleetc run --server_num 2 --worker_num 2 examples/train_ps.py [STEPS] [OUT_DIR]`.

Every process runs this script. Servers hold the parameters (the embedding table row-sharded by id) and run
Adagrad; workers train on their half of each batch, pulling the rows their ids need and pushing gradients.
In sync mode (a_sync=False) the result equals single-process training on the whole batch. With OUT_DIR, each
worker writes its losses and the final parameters to OUT_DIR/worker<i>.pt, and worker 0 a checkpoint to
OUT_DIR/ckpt (servers resume from it with fleet.init_server(OUT_DIR + "/ckpt")).
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import fleetc
import fleetc.fleet as fleet


class CTR(nn.Module):
    """Four sparse id fields looked up in one table, then a small MLP giving a click logit."""

    def __init__(self, rows: int = 10_000, dim: int = 8, fields: int = 4):
        super().__init__()
        self.embedding = nn.Embedding(rows, dim)
        self.fc1 = nn.Linear(fields * dim, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(self.embedding(ids).flatten(1)))).squeeze(1)


def make_model() -> CTR:
    torch.manual_seed(0)
    return CTR()


def global_batches(steps: int, batch: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole job's batches (every worker takes its shard of each); the label is learnable from the ids."""
    data = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 10_000, (batch, 4), generator=data)
        out.append((ids, ((ids % 2).sum(1) >= 2).float()))
    return out


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(model.parameters(), lr=0.05)


def main(steps: int = 5, out_dir: str | None = None) -> None:
    fleet.init()                               # TRAINING_ROLE from `fleetc run --server_num`: parameter-server mode
    model = make_model()                       # every process builds the same model
    strategy = fleetc.DistributedStrategy()
    strategy.a_sync = False                    # sync: the servers apply the mean of every worker's gradients per step
    fleet.distributed_optimizer(make_optimizer(model), strategy)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()                     # returns once every worker called stop_worker()
        return
    fleet.init_worker()
    train = fleet.distributed_model(model, loss_fn=F.binary_cross_entropy_with_logits)
    me, workers = fleet.worker_index(), fleet.worker_num()
    losses = []
    for step, (ids, labels) in enumerate(global_batches(steps)):
        losses.append(train.step(ids.chunk(workers)[me], labels.chunk(workers)[me]).item())  # this worker's shard
        if fleet.is_first_worker():
            print(f"step {step}: loss {losses[-1]:.4f} (worker 0 of {workers}, {fleet.server_num()} servers)")
    if out_dir is not None:
        if fleet.is_first_worker():
            fleet.save_persistables(os.path.join(out_dir, "ckpt"))  # gathered from every server, crash-safe
            print(train.report())
        train.pull_all()                       # the servers' final parameters into the local model
        torch.save({"losses": losses, "params": model.state_dict(), "program": str(train.program)},
                   os.path.join(out_dir, f"worker{me}.pt"))
    fleet.stop_worker()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, sys.argv[2] if len(sys.argv) > 2 else None)
