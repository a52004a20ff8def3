"""Worker bodies of tests/fleet/test_sharding_stage3_flat.py (`python -m fleet.sharding_stage3_workers NAME ...`)."""
from __future__ import annotations

import copy
import os

import torch
from torch import nn

import fleetc
import fleetc.fleet as fleet
from fleet.spawn import run_worker
from fleet.workers import make_strategy, shard


def tiny_model() -> nn.Module:
    """Parameters of 40, 5, 5 and 1 elements: in buckets of one parameter each on 2 ranks, the last bucket's second
    segment is all padding, and every other parameter is cut between the ranks."""
    return nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 1))


def padded_pieces(rank: int, args: dict, out_dir: str) -> None:
    """Stage 3 with one-parameter buckets on the tiny model, beside eager Adam on the full batch (every rank has it)
    from the same broadcast initial parameters: losses, parameters, evaluation calls before and after training."""
    fleet.init(is_collective=True)
    world = fleet.worker_num()
    torch.manual_seed(rank)  # different on every rank: the broadcast from rank 0 makes them equal
    model = tiny_model()
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.01), make_strategy(args["strategy"]))
    trainer = fleetc.compile(model, optimizer=opt, loss_fn=nn.functional.mse_loss, verify=True)
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.Adam(eager.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]
    out = {"losses": [], "eager_losses": []}
    # evaluation before any training step: the module still holds every parameter whole, so this Program gathers
    # whole parameters from their owners; after the training step releases them to flat pieces it recompiles
    out["eval_before"] = trainer(batches[0][0])
    with torch.no_grad():
        out["eager_eval_before"] = eager(batches[0][0])
    for x, y in batches:
        out["losses"].append(trainer.step(*shard((x, y), rank, world)))
        eager_opt.zero_grad()
        loss = nn.functional.mse_loss(eager(x), y)
        loss.backward()
        eager_opt.step()
        out["eager_losses"].append(loss.detach())
    out["pieces"] = trainer.program.metadata["sharding"]["param_pieces"]
    out["held"] = {name: p.numel() for name, p in model.named_parameters()}
    out["state"] = trainer.full_state_dict()
    out["eager_state"] = eager.state_dict()
    out["eval"] = trainer(batches[0][0])
    out["eval_layout"] = trainer._last_eval.program.metadata["sharding"]["param_layout"]
    with torch.no_grad():
        out["eager_eval"] = eager(batches[0][0])
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


if __name__ == "__main__":
    run_worker(globals())
