"""Worker bodies of the sharding tests (`python -m fleet.sharding_workers NAME ARGS_JSON OUT_DIR`, one per rank)."""
from __future__ import annotations

import json
import os
import sys

import torch

import fleetc.fleet as fleet
from fleet.workers import train_with_trainer


def optimizer_state_elements(trainer) -> int:
    """Elements of optimizer state this rank holds."""
    return sum(t.numel() for slot in trainer.optimizer.state.values() for t in slot.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def train_sharded(rank: int, args: dict, out_dir: str) -> None:
    """Each config trained as in data parallel, plus what the rank keeps of the optimizer state and the plan."""
    fleet.init(is_collective=True)
    runs = []
    for config in args["configs"]:
        trainer, run = train_with_trainer(rank, fleet.worker_num(), config)
        program = trainer.program
        run["state_elements"] = optimizer_state_elements(trainer)
        run["params"] = len(list(trainer.model.parameters()))
        run["op_types"] = sorted({op.type for _, op in program.walk_ops()})
        runs.append(run)
    torch.save({"runs": runs}, os.path.join(out_dir, f"rank{rank}.pt"))
    fleet.barrier_worker()
    fleet.stop_worker()


if __name__ == "__main__":
    name, args, out_dir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    globals()[name](int(os.environ["RANK"]), args, out_dir)
