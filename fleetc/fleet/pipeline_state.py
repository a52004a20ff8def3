"""Checkpoints of a pipeline run one stage per process: every stage's current state, gathered before the write.

A rank's model and optimizer are current only for what its stages hold (`PipelineExecutor.holders`: parameters,
buffers such as BatchNorm's running statistics, and their optimizer state); the other entries keep their initial
values. Before a checkpoint every rank sends its stages' entries to the others and takes theirs, so each holds the
whole current model, and the first rank writes it with the ordinary crash-safe commit. The checkpoint is then an
ordinary one: it resumes on the same pipeline (each rank uses its stages' part) and loads into a single process.
"""
from __future__ import annotations

import torch
from torch import nn

from fleetc.comm import host


def gather_stage_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, held: set[str]) -> None:
    """Make this rank's model and optimizer hold every stage's current entries, in place (a collective: every rank
    calls it). `held`: the parameter and buffer names this rank's stages hold."""
    params = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    name_of = {id(p): name for name, p in model.named_parameters()}
    state = optimizer.state_dict()["state"] if optimizer is not None else {}
    mine = ({name: t.detach() for name, t in model.state_dict().items() if name in held},
            {index: entry for index, entry in state.items() if name_of.get(id(params[index])) in held})
    theirs = host.gather_objects(mine, "checkpoint (gathering every pipeline stage's state)")
    live = model.state_dict()
    with torch.no_grad():
        for tensors, entries in theirs:  # replicas of a stage hold the same entries
            for name, tensor in tensors.items():
                if name not in held:
                    live[name].copy_(tensor)
            for index, entry in entries.items():
                if name_of.get(id(params[index])) not in held:
                    optimizer.state[params[index]] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                                      for k, v in entry.items()}
