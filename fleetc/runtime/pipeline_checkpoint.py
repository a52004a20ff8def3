"""The per-stage part files of a pipeline checkpoint, and how loading folds them back into one checkpoint.

With one pipeline rank per process each rank writes its own part, `pipeline.pp<index>.pt` (fleet/pipeline_state.py
saves): the model entries, optimizer state and fleetc-owned state its stages hold, and the gradient-merge sums its
executor carries mid-period. A persistable several stages hold (tied embeddings) is in the part of its lowest
stage only; a state_dict key that aliases another tensor (`lm_head.weight` tied to `tok.weight`) is listed in the
manifest's meta (`tied`) and filled from it on load. The first rank's `model.pt`/`optimizer.pt` hold what no stage
holds. Loading merges the parts into one model state_dict, one optimizer state_dict and one fleetc state, so the
checkpoint then passes the ordinary checks and loads into any trainer, or into a plain model
(`fleetc.read_checkpoint`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from fleetc.errors import CheckpointError

PART_FILE = "pipeline.pp{:05d}.pt"
PARTS_KEY = "pipeline_parts"  # manifest meta: the part files
TIED_KEY = "tied"             # manifest meta: {aliasing state_dict key: the key whose tensor it is}
KINDS = ("model", "optimizer", "owned")
_PART = re.compile(r"^pipeline\.pp(\d{5})\.pt$")


def part_index(name: str, where: str) -> int:
    """The pipeline rank a part file belongs to, from its name."""
    match = _PART.match(name)
    if match is None:
        raise CheckpointError(f"{where}: {PARTS_KEY} lists {name[:60]!r}, which is not a pipeline part file name")
    return int(match.group(1))


def check_merge_state(merge: Any, where: str) -> None:
    """CheckpointError unless `merge` is a pipeline rank's carried gradient-merge state as `merge_state()` gives."""
    if not isinstance(merge, Mapping) or type(merge.get("steps_merged")) is not int or merge["steps_merged"] < 0 \
            or not isinstance(merge.get("carried"), Mapping) or not isinstance(merge.get("period_flags"), list):
        raise CheckpointError(f"{where}: 'merge' must be {{'steps_merged': int, 'carried': {{chunk: {{grad: "
                              f"tensor}}}}, 'period_flags': [...]}}, got {type(merge).__name__}")


def merge_parts(version: Any, model_state: dict, optimizer_state: dict, owned_entries: dict
                ) -> tuple[dict[int, dict], dict[str, dict[Any, str]]]:
    """Fold the version's part files (if any) into the model state_dict, the optimizer state_dict's `state` and the
    fleetc-owned entries, in place; returns each pipeline rank's carried gradient-merge state by index, and the
    part file (path) each entry came from, by kind ("model", "optimizer", "owned"), for errors about it."""
    merges: dict[int, dict] = {}
    seen: dict[str, dict[Any, str]] = {kind: {} for kind in KINDS}
    for name in version.meta.get(PARTS_KEY, ()):
        where = f"{version.path}/{name}"
        index = part_index(name, where)
        part = version.read(name)
        if not isinstance(part, Mapping) or not all(isinstance(part.get(kind), Mapping) for kind in KINDS):
            raise CheckpointError(f"{where}: expected a pipeline part {{'model', 'optimizer', 'owned', 'merge'}}, "
                                  f"got {type(part).__name__}")
        check_merge_state(part.get("merge"), where)
        targets = {"model": model_state, "optimizer": optimizer_state.setdefault("state", {}),
                   "owned": owned_entries}
        for kind in KINDS:
            for key, value in part[kind].items():
                if key in seen[kind]:
                    raise CheckpointError(f"{where}: {kind} entry {key!r} is also in {seen[kind][key]}: a stored "
                                          "entry belongs to exactly one pipeline part")
                seen[kind][key] = name
                targets[kind][key] = value
        merges[index] = dict(part["merge"])
    tied = version.meta.get(TIED_KEY, {})
    for alias, source in tied.items() if isinstance(tied, Mapping) else ():
        if source not in model_state:
            raise CheckpointError(f"{version.path}: {alias!r} is tied to {source!r}, which no file holds")
        model_state[alias] = model_state[source]
    return merges, {kind: {key: f"{version.path}/{name}" for key, name in entries.items()}
                    for kind, entries in seen.items()}


def mid_period(merges: Mapping[int, Mapping]) -> bool:
    """Whether a pipeline rank saved between gradient-merge updates (it carries gradient sums)."""
    return any(m["steps_merged"] > 0 for m in merges.values())


def check_carried(merges: Mapping[int, Mapping], layout: tuple[int | None, int, int], where: str) -> None:
    """CheckpointError unless a pipeline of `layout` = (pipeline ranks, chunks per rank, k_steps), rank r running
    chunks r, r + ranks, ..., can take the carried gradient-merge sums `merges` (by pipeline rank) of the checkpoint
    at `where`: saved at an update boundary, or mid-period by a pipeline of that very layout. The sums are per chunk
    of the writer's cut: on another depth or chunking they would be added to other gradients, or lost. Ranks None
    (comm/mesh.py's `pipeline_layout` before the capture that finds the device_guard stages): the chunking and
    k_steps are checked on the writer's depth, which the pipeline, once built, must have too. Every rank holds every
    part's merge state, so all ranks decide alike."""
    if not mid_period(merges):
        return
    ranks, vpp, k_steps = layout
    ranks = len(merges) if ranks is None else ranks
    steps = {index: merge["steps_merged"] for index, merge in merges.items()}
    chunks_of = {r: [r + ranks * v for v in range(vpp)] for r in range(ranks)}
    if sorted(merges) != sorted(chunks_of):
        raise CheckpointError(f"{where}: saved between gradient-merge updates by a pipeline of {len(merges)} "
                              f"rank(s) (parts {sorted(merges)}), which carry gradient sums of their own chunks; "
                              f"this pipeline has {ranks}: resume mid-period on the same pipeline depth, or save "
                              "at an update boundary to reshard")
    for r, chunks in chunks_of.items():
        carried = sorted(merges[r]["carried"])
        if carried != chunks or steps[r] != max(steps.values()) or steps[r] >= k_steps:
            raise CheckpointError(f"{where}/{PART_FILE.format(r)}: carries the gradient sums of chunks {carried} "
                                  f"after {steps[r]} merged step(s), but this pipeline's rank {r} runs chunks "
                                  f"{chunks} with k_steps={k_steps}: resume mid-period on the same pipeline, or "
                                  "save at an update boundary to reshard")
