"""The state of a pipeline run one stage per process: per-stage checkpoint parts, and the whole model for evaluation.

A rank's model and optimizer are current only for what its stages hold (the persistables of its chunks' Programs:
parameters, buffers such as BatchNorm's running statistics, their optimizer state, fleetc-owned state); the other
entries keep their initial values.

Checkpoints: each pipeline rank writes its own part (`pipeline.pp<index>.pt`, runtime/pipeline_checkpoint.py) into
one staged version, only the first data-parallel replica of each stage writing (replicas hold the same state), and
the first rank commits after all parts are in (fleet/checkpoint_parts.py, the crash-safe commit sharding uses too).
Under sharding (stages 1 and 2) each stage's optimizer state is split over its sharding group: every sharding rank
of a stage writes the state it owns of the stage's stored parameters as an optimizer shard file
(fleet/sharded_state.py's naming, one index per (stage, sharding rank)) beside the stage's part, which then holds
no optimizer state; loading merges the shards and the parts back into one checkpoint.
A persistable several stages hold (tied embeddings) is stored once, by its lowest stage's rank. Gradient-merge sums
carried mid-period are in the part; with data-parallel replicas (whose sums differ until the update's allreduce
averages them) the part holds their average, which gives the same update.

Evaluation: `gather_stage_state` makes every rank's model whole and current before an evaluation call.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fleetc.comm import host
from fleetc.fleet.checkpoint_parts import save_with_parts
from fleetc.fleet.sharded_state import state_pieces
from fleetc.runtime.checkpoint import TrainerState, write_checkpoint
from fleetc.runtime.pipeline_checkpoint import PART_FILE
from fleetc.runtime.pipeline_local import PipelineExecutor


def gather_stage_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, held: set[str]) -> None:
    """Make this rank's model and optimizer hold every stage's current entries, in place (a collective: every rank
    calls it). `held`: the parameter and buffer names this rank's stages hold."""
    params = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    name_of = {id(p): name for name, p in model.named_parameters()}
    state = optimizer.state_dict()["state"] if optimizer is not None else {}
    mine = ({name: t.detach() for name, t in model.state_dict().items() if name in held},
            {index: entry for index, entry in state.items() if name_of.get(id(params[index])) in held})
    theirs = host.gather_objects(mine, "evaluation (gathering every pipeline stage's state)")
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


def stored_by(pipe: PipelineExecutor) -> dict[str, int]:
    """The pipeline rank whose part stores each persistable: the rank of the lowest stage holding it."""
    lowest: dict[str, int] = {}
    for s, stage in enumerate(pipe.plan.stages):
        for phase in stage.phases.values():
            for var in phase.persistables():
                lowest.setdefault(var.name, s)
    return {name: pipe.schedule.rank_of(s) for name, s in lowest.items()}


def chunk_state_pieces(pipe: PipelineExecutor, optimizer: torch.optim.Optimizer, model: nn.Module
                       ) -> list[list[int]]:
    """`state_pieces` of every chunk this rank runs (VPP: several, each holding pieces of its own parameters): the
    pieces its optimizer shard file holds."""
    return sorted(piece for s in pipe.chunks
                  for piece in state_pieces(pipe.plan.stages[s].phases["optimizer"].metadata, optimizer, model))


def tied_keys(model: nn.Module) -> dict[str, str]:
    """state_dict keys whose tensor is an earlier key's (`lm_head.weight` → `tok.weight`): stored once."""
    first: dict[int, str] = {}
    tied = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        source = first.setdefault(id(tensor), key)
        if source != key:
            tied[key] = source
    return tied


def _entries(live: TrainerState, keep: Any) -> dict[str, dict]:
    """The model, optimizer-state and fleetc-owned entries whose names `keep(name)` accepts."""
    model = live.model
    name_of = {id(p): name for name, p in model.named_parameters()}
    params = [p for group in live.optimizer.param_groups for p in group["params"]] if live.optimizer else []
    state = live.optimizer.state_dict()["state"] if live.optimizer is not None else {}
    return {"model": {k: v.detach() for k, v in model.state_dict().items() if keep(k)},
            "optimizer": {i: entry for i, entry in state.items() if keep(name_of.get(id(params[i])))},
            "owned": {k: v.detach() for k, v in live.owned.items() if keep(k)}}


def _replica_mean(merge: dict, replicas: list[int]) -> dict:
    """The carried gradient sums averaged over this stage's data-parallel replicas (a collective on every rank;
    only mid-period with replicas): the update averages them anyway, so resuming from the mean gives the same."""
    if merge["steps_merged"] == 0 or len(replicas) == 1:
        return merge
    every = host.gather_objects(merge["carried"], "checkpoint (averaging carried gradient sums over replicas)")
    carried = {s: {name: torch.stack([every[r][s][name] for r in replicas]).mean(0) for name in sums}
               for s, sums in merge["carried"].items()}
    return {**merge, "carried": carried}


def save_pipeline_checkpoint(root: str, live: TrainerState, config: Any, rng: list, pipe: PipelineExecutor,
                             writes: bool, replicas: list[int], shard: tuple[str, list[list[int]]] | None = None,
                             writes_shard: bool = False) -> str:
    """Every rank calls it. `writes`: this rank is its stage's first replica; `replicas`: the global ranks holding
    the same stage. `shard`: under sharding, (this rank's optimizer shard file, its pieces as `state_pieces` gives
    them): the optimizer state of the parameters this part stores then goes into that file, which each rank with
    `writes_shard` (one replica of each shard) writes, and the part holds none. Returns the committed version's
    directory (CheckpointError on every rank when any write failed)."""
    index = pipe.ranks_here[0]
    by, tied = stored_by(pipe), tied_keys(live.model)
    merge = _replica_mean(pipe.merge_state(), replicas)
    stored = _entries(live, lambda n: by.get(n) == index and n not in tied)
    parts = []
    if shard is not None:  # about: the parameter indices (and pieces) the shard file holds, for the manifest
        optimizer, stored["optimizer"] = stored["optimizer"], {}
        pieces = [piece for piece in shard[1] if piece[0] in optimizer]
        parts += [(shard[0], optimizer, (sorted(optimizer), pieces))] if writes_shard else []
    if writes:  # about None: a pipeline part
        parts.append((PART_FILE.format(index), {**stored, "merge": merge}, None))
    rest = _entries(live, lambda n: n not in by and n not in tied)  # held by no stage: the first rank writes them

    def commit(staged: Any, written: dict[str, Any]) -> str:
        shards = {name: about for name, about in written.items() if about is not None}
        parts = {"files": [name for name, about in written.items() if about is None], "tied": tied,
                 "model": rest["model"], "optimizer_state": rest["optimizer"]}
        return write_checkpoint(staged, live, config, rng, {n: held for n, (held, _) in shards.items()},
                                {n: split for n, (_, split) in shards.items()}, pipeline_parts=parts)
    return save_with_parts(root, parts, commit)
