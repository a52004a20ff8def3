"""Data-parallel training with fleetc's Fleet API: run it with `fleetc run --nproc_per_node 2 examples/train_dp.py`.

Every rank trains on its half of each batch; gradients are averaged inside the compiled step, so all
ranks end with identical parameters. Works on CPU (gloo) and prints one line per step from rank 0.
"""
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import fleetc
import fleetc.fleet as fleet


def main(steps: int = 5) -> None:
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_reduce_ops = True        # one allreduce per bucket of gradients
    strategy.sync_nccl_allreduce = False       # overlap the allreduces with the rest of backward
    optimizer = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    train = fleet.distributed_model(model, loss_fn=F.cross_entropy)

    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(16, 32, generator=data), torch.randint(0, 10, (16,), generator=data)
        loss = train.step(x.chunk(world)[rank], y.chunk(world)[rank])   # this rank's shard of the batch
        if fleet.is_first_worker():
            print(f"step {step}: loss {loss.item():.4f} (rank 0 of {world}), lr {optimizer.get_lr()}")
    checkpoint = os.path.join(tempfile.gettempdir(), f"fleetc_train_dp_{os.environ.get('MASTER_PORT', 'local')}")
    fleet.save_persistables(checkpoint)        # rank 0 writes, atomically; every rank waits for it
    fleet.load_persistables(checkpoint)        # every rank can restore it
    if fleet.is_first_worker():
        print(train.report())
        print(f"saved to {checkpoint}")
    fleet.stop_worker()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
