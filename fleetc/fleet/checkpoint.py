"""Saving and loading a trainer's persistables: parameters, buffers, optimizer state and fleetc-owned state."""
from __future__ import annotations

import os
import secrets
import shutil

import torch

from fleetc.compiler import CompiledTrainer

FILES = ("model.pt", "optimizer.pt", "fleetc.pt")


def save(trainer: CompiledTrainer, dirname: str) -> None:
    """Write into a temporary directory beside `dirname`, then rename it into place: never a half-written checkpoint."""
    target = os.path.abspath(dirname)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    temporary = os.path.join(parent, f".{os.path.basename(target)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    os.mkdir(temporary)
    try:
        optimizer = trainer.optimizer.state_dict() if trainer.optimizer is not None else {}
        for name, value in zip(FILES, (trainer.model.state_dict(), optimizer, trainer.state_dict())):
            torch.save(value, os.path.join(temporary, name))
        previous = None
        if os.path.exists(target):
            previous = temporary + ".old"
            os.replace(target, previous)
        os.replace(temporary, target)
        if previous is not None:
            shutil.rmtree(previous)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def load(trainer: CompiledTrainer, dirname: str) -> None:
    """Restore what `save` wrote into the trainer's model, optimizer and fleetc-owned state (counters, accumulators)."""
    missing = [name for name in FILES if not os.path.isfile(os.path.join(dirname, name))]
    if missing:
        raise FileNotFoundError(f"{dirname!r} is not a fleetc checkpoint: missing {missing}")
    trainer.model.load_state_dict(torch.load(os.path.join(dirname, "model.pt")))
    if trainer.optimizer is not None:
        trainer.optimizer.load_state_dict(torch.load(os.path.join(dirname, "optimizer.pt")))
    trainer.load_state_dict(torch.load(os.path.join(dirname, "fleetc.pt")))
