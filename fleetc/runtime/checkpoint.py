"""Trainer checkpoints: what they hold, how each file is checked against the trainer, and restoring all or nothing.

A checkpoint directory (written through `checkpoint_commit`) holds three files:
- `model.pt`: `model.state_dict()`;
- `optimizer.pt`: `optimizer.state_dict()` (empty without an optimizer); under sharding its state entries are in
  per-rank shard files the manifest's meta lists (`optimizer_shards`), merged back on load;
- with one pipeline stage per process, `model.pt` and `optimizer.pt` hold what no stage holds and each pipeline
  rank's entries are in its part file (`pipeline_parts`, runtime/pipeline_checkpoint.py), merged back on load;
- `fleetc.pt`: `CompiledTrainer.state_dict()`: fleetc-owned state (counters, accumulators), the strategy state it
  belongs to (gradient merge, AMP), and the RNG state of every rank (so dropout continues the same stream).
Loading reads and checks every file before it changes anything (keys, shapes, dtypes, the optimizer's kind and
param groups, the strategy state); then it applies them, and puts the old state back should applying fail.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fleetc.errors import CheckpointError
from fleetc.ops.optimizer import MASTER_KEY
from fleetc.runtime import checkpoint_commit, pipeline_checkpoint
from fleetc.runtime.optimizer_shards import merge_optimizer_shards

STATE_KEY = "fleetc_owned"
STRATEGY_KEY = "strategy_state"
RNG_KEY = "rng"
FILES = ("model.pt", "optimizer.pt", "fleetc.pt")
PARAMS_KEY = "optimizer_params"  # manifest meta: the model's name of each parameter the optimizer state numbers


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[str | None]:
    """The model's name of each of the optimizer's parameters, in the order `optimizer.state_dict()` numbers them
    (None: a tensor the model does not hold)."""
    named = {id(p): name for name, p in model.named_parameters()}
    return [named.get(id(p)) for group in optimizer.param_groups for p in group["params"]] if optimizer else []


def check_parameter_names(saved: Any, names: list[str | None], where: str) -> None:
    """CheckpointError unless the checkpoint numbered its optimizer state over parameters of the same names, in the
    same order, as this optimizer does (torch matches them by position only, so another parameter set or order
    would load into the wrong parameters). A checkpoint written before the names were recorded is not checked."""
    if saved is None or saved == names:
        return
    if not isinstance(saved, list) or len(saved) != len(names):
        raise CheckpointError(f"{where}: its optimizer state is over {len(saved) if isinstance(saved, list) else '?'}"
                              f" parameters, this optimizer has {len(names)} (another model or parameter set?)")
    index = next(i for i, (a, b) in enumerate(zip(saved, names)) if a != b)
    raise CheckpointError(f"{where}: its optimizer state numbers {saved[index]!r} as parameter {index}, this "
                          f"optimizer numbers {names[index]!r} so (another parameter set or order)")


def strategy_state(config: Any) -> dict[str, Any]:
    """The strategy settings fleetc-owned state belongs to: a checkpoint only fits a trainer with the same."""
    merge = config.gradient_merge and config.gradient_merge_configs.k_steps > 1
    return {"gradient_merge": {"k_steps": config.gradient_merge_configs.k_steps,
                               "avg": config.gradient_merge_configs.avg} if merge else None,
            "amp": {"use_dynamic_loss_scaling": config.amp_configs.use_dynamic_loss_scaling,
                    "use_pure_fp16": config.amp_configs.use_pure_fp16} if config.amp else None}


def rng_state() -> dict[str, Any]:
    """This process's random generators: torch's CPU generator and, once initialized, every CUDA device's (their
    offsets are what fused dropout's Philox seeds/offsets are drawn from)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": list(cuda)}


def owned_state_dict(owned: Mapping[str, torch.Tensor], config: Any, rng: list[dict[str, Any]]) -> dict[str, Any]:
    """fleetc.pt's content: copies of the fleetc-owned persistables, the strategy state, RNG states by rank."""
    return {STATE_KEY: {name: tensor.detach().clone() for name, tensor in sorted(owned.items())},
            STRATEGY_KEY: strategy_state(config), RNG_KEY: rng}


def _describe(state: Any) -> str:
    if isinstance(state, Mapping):
        return f"a {type(state).__name__} with keys {sorted(map(str, state))[:8]}"
    return f"a {type(state).__name__}"


def check_owned_state(state: Any, owned: Mapping[str, torch.Tensor], config: Any, where: str) -> None:
    """CheckpointError (naming `where`) unless `state` fits this trainer's fleetc-owned state and strategy."""
    entries = state.get(STATE_KEY) if isinstance(state, Mapping) else None
    if not isinstance(entries, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                   for k, v in entries.items()):
        raise CheckpointError(f"{where}: expected {{{STATE_KEY!r}: {{var name: tensor}}, …}} as returned by "
                              f"CompiledTrainer.state_dict(), got {_describe(state)}")
    saved_strategy = state.get(STRATEGY_KEY)
    if saved_strategy is not None and saved_strategy != strategy_state(config):
        raise CheckpointError(f"{where}: saved under strategy state {saved_strategy}, but this trainer runs "
                              f"{strategy_state(config)}; fleetc-owned state (accumulators, loss scale) only fits "
                              "the same gradient_merge and amp settings")
    missing = sorted(set(owned) - set(entries))
    if missing:
        raise CheckpointError(f"{where}: lacks fleetc state {missing} that this trainer's compiled Programs use")
    for name, tensor in entries.items():
        current = owned.get(name)
        if current is not None and (current.shape, current.dtype) != (tensor.shape, tensor.dtype):
            raise CheckpointError(f"{where}: fleetc state {name!r} is {tensor.dtype}{list(tensor.shape)}, but this "
                                  f"trainer holds {current.dtype}{list(current.shape)}")
    rng = state.get(RNG_KEY, [])
    if not isinstance(rng, list) or not all(isinstance(r, Mapping) and isinstance(r.get("cpu"), torch.Tensor)
                                            for r in rng):
        raise CheckpointError(f"{where}: {RNG_KEY!r} must be a list of per-rank RNG states, got {_describe(rng)}")


def _dtype_kind(tensor: torch.Tensor) -> str:
    if tensor.dtype == torch.bool:
        return "bool"
    return "floating point" if tensor.is_floating_point() else "complex" if tensor.is_complex() else "integer"


def check_model_state(state: Any, model: nn.Module, where: str, files: Mapping[str, str] | None = None) -> None:
    """CheckpointError unless `state` has exactly the model's keys, each with its shape and kind of dtype. `files`:
    the file each key was read from when not `where` (a pipeline stage's part), named in errors about it."""
    live = model.state_dict()
    if not isinstance(state, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in state.items()):
        raise CheckpointError(f"{where}: expected a model state_dict (name → tensor), got {_describe(state)}")
    missing, unexpected = sorted(set(live) - set(state)), sorted(set(state) - set(live))
    if missing or unexpected:
        raise CheckpointError(f"{where}: does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        mine, at = live[name], (files or {}).get(name, where)
        if tensor.shape != mine.shape:
            raise CheckpointError(f"{at}: {name!r} has shape {list(tensor.shape)}, the model's is "
                                  f"{list(mine.shape)}")
        # Precision may differ (amp use_pure_fp16 saves low-precision weights; loading casts, as torch does).
        if _dtype_kind(tensor) != _dtype_kind(mine):
            raise CheckpointError(f"{at}: {name!r} is {tensor.dtype}, the model's is {mine.dtype}")


def check_optimizer_state(state: Any, optimizer: torch.optim.Optimizer | None, saved_kind: str | None,
                          where: str, files: Mapping[Any, str] | None = None,
                          describe: Callable[[Any], str] = "parameter {}".format) -> None:
    """CheckpointError unless `state` is a state_dict of the same kind of optimizer over the same parameters.
    `files`: the file each parameter's state was read from when not `where` (an optimizer shard, a pipeline part);
    `describe(index)` names a parameter in errors."""
    if optimizer is None:
        if state:
            raise CheckpointError(f"{where}: holds optimizer state, but this trainer has no optimizer")
        return
    kind = type(optimizer).__name__
    if saved_kind is not None and saved_kind != kind:
        raise CheckpointError(f"{where}: holds {saved_kind} state, but this trainer's optimizer is {kind}")
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups"), list) \
            or not isinstance(state.get("state"), Mapping):
        raise CheckpointError(f"{where}: expected an optimizer state_dict ('state', 'param_groups'), "
                              f"got {_describe(state)}")
    live = optimizer.state_dict()["param_groups"]
    groups = state["param_groups"]
    if not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        raise CheckpointError(f"{where}: every param group must be a mapping with a 'params' list")
    if [len(g.get("params", ())) for g in groups] != [len(g["params"]) for g in live]:
        raise CheckpointError(f"{where}: param groups of sizes {[len(g.get('params', ())) for g in groups]}, this "
                              f"optimizer's are {[len(g['params']) for g in live]}")
    for i, (saved, mine) in enumerate(zip(groups, live)):
        if set(saved) != set(mine):
            raise CheckpointError(f"{where}: param_groups[{i}] has settings {sorted(saved)}, this {kind} has "
                                  f"{sorted(mine)} (a checkpoint of another kind of optimizer?)")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, slots in state["state"].items():
        at = (files or {}).get(index, where)
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(slots, Mapping):
            raise CheckpointError(f"{at}: state entry {index!r} names no parameter of this optimizer")
        for key, value in slots.items():
            param = params[index]
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise CheckpointError(f"{at}: state {key!r} of {describe(index)} has shape {list(value.shape)}, "
                                      f"the parameter's is {list(param.shape)}")
            if key == MASTER_KEY and param.dtype != torch.float32:
                raise CheckpointError(f"{at}: holds float32 master weights, but the parameters are already "
                                      f"{param.dtype} (amp use_pure_fp16 converted them at the first step): load "
                                      "the checkpoint before the first step")


@dataclass
class TrainerState:
    """The live state a checkpoint restores: the model, the optimizer, fleetc-owned state, this rank's RNG."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    owned: dict[str, torch.Tensor]
    rank: int = 0
    pipeline_merges: dict[int, dict] | None = None  # a pipeline rank's trainer: receives the carried merge state
    # a pipeline rank's trainer: (pipeline ranks, chunks per rank, k_steps) of its pipeline, built or planned
    # (comm/mesh.py's `pipeline_layout`; ranks None while unknown), which the carried merge state must fit
    pipeline_layout: tuple[int | None, int, int] | None = None

    def snapshot(self) -> tuple[dict, dict | None, dict[str, torch.Tensor], dict[str, Any]]:
        """Copies of everything a restore may change: model, optimizer, owned state, RNG."""
        return ({k: v.detach().clone() for k, v in self.model.state_dict().items()},
                copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
                {k: v.detach().clone() for k, v in self.owned.items()}, rng_state())

    def restore_owned(self, owned: Mapping[str, torch.Tensor], rng: Mapping[str, Any] | None) -> None:
        """Put checked fleetc-owned tensors and (when saved) this rank's RNG state into the trainer."""
        for name in set(self.owned) - set(owned):
            del self.owned[name]  # only on rollback: entries a checkpoint added
        for name, tensor in owned.items():
            if name in self.owned:
                self.owned[name].copy_(tensor)  # bound Programs hold these very tensors
            else:
                self.owned[name] = tensor.detach().clone()
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if rng.get("cuda") and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(rng["cuda"])

    def rng_of_this_rank(self, owned_state: Mapping) -> Mapping[str, Any] | None:
        """This rank's saved RNG state (None when the checkpoint holds none for it, e.g. a larger world now)."""
        states = owned_state.get(RNG_KEY, [])
        return states[self.rank] if self.rank < len(states) else None

    def _apply(self, model: Mapping, optimizer: Mapping | None, owned: Mapping[str, torch.Tensor],
               rng: Mapping[str, Any] | None) -> None:
        self.model.load_state_dict(model)
        if self.optimizer is not None and optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
        self.restore_owned(owned, rng)

    def restore_all_or_nothing(self, model: Mapping, optimizer: Mapping | None, owned_state: Mapping) -> None:
        """Apply checked state; should torch still refuse part of it, put everything back as it was."""
        before = self.snapshot()
        try:
            self._apply(model, optimizer, owned_state[STATE_KEY], self.rng_of_this_rank(owned_state))
        except Exception as exc:
            self._apply(*before)
            raise CheckpointError(f"restoring the checkpoint failed, the trainer is unchanged: {exc}") from exc


def save_checkpoint(root: str, state: TrainerState, config: Any, rng: list[dict[str, Any]]) -> str:
    """Write a new version of the checkpoint at `root` (crash-safe); returns its directory."""
    return write_checkpoint(checkpoint_commit.begin(root), state, config, rng)


def write_checkpoint(staged: checkpoint_commit.StagedVersion, state: TrainerState, config: Any,
                     rng: list[dict[str, Any]], optimizer_shards: Mapping[str, list[int]] | None = None,
                     shard_pieces: Mapping[str, list[list[int]]] | None = None, *,
                     pipeline_parts: dict[str, Any] | None = None) -> str:
    """Write the trainer's files into `staged` and commit it (or abort it). `optimizer_shards`: files other writers
    (sharding ranks) put into the staged version, each holding some entries of `optimizer.state_dict()["state"]`
    (file → the parameter indices of its entries, recorded in the manifest so a loader can skip the files it does
    not need); `optimizer.pt` then holds the param groups only, and loading merges the shards back.
    `shard_pieces`: file → [index, lo, hi] for each parameter of which the file holds only the state of elements
    [lo, hi) of the flattened parameter (sharding on flat buckets); loading joins the pieces. `pipeline_parts`: the
    pipeline ranks' part files (runtime/pipeline_checkpoint.py): {"files", "tied", "model", "optimizer_state"},
    the last two being what `model.pt` and `optimizer.pt`'s state then hold (the entries no stage holds)."""
    try:
        parts = pipeline_parts or {}
        staged.write("model.pt", parts["model"] if parts else state.model.state_dict())
        optimizer = state.optimizer.state_dict() if state.optimizer is not None else {}
        if optimizer_shards or parts:
            optimizer = {**optimizer, "state": parts.get("optimizer_state", {})}
        staged.write("optimizer.pt", optimizer)
        staged.write("fleetc.pt", owned_state_dict(state.owned, config, rng))
        meta = {"optimizer": type(state.optimizer).__name__ if state.optimizer is not None else None,
                "strategy_state": strategy_state(config), PARAMS_KEY: parameter_names(state.model, state.optimizer)}
        if optimizer_shards:
            meta["optimizer_shards"] = sorted(optimizer_shards)
            meta["optimizer_shard_params"] = {name: sorted(optimizer_shards[name]) for name in meta["optimizer_shards"]}
            meta["optimizer_shard_pieces"] = {name: list(pieces) for name, pieces in (shard_pieces or {}).items()
                                              if pieces}
        if parts:
            meta[pipeline_checkpoint.PARTS_KEY] = list(parts["files"])
            meta[pipeline_checkpoint.TIED_KEY] = dict(parts["tied"])
        return staged.commit(meta)
    except BaseException:
        staged.abort()
        raise


def _needed_shards(meta: Mapping[str, Any], wanted: set[int] | None) -> list[str]:
    """The optimizer shard files to read: all of them, or (`wanted`) those holding state of a wanted parameter
    (a file the manifest gives no parameter list for is read: a checkpoint written before the lists existed)."""
    held = meta.get("optimizer_shard_params", {})
    return [name for name in meta.get("optimizer_shards", ())
            if wanted is None or name not in held or wanted.intersection(held[name])]


def read_checkpoint(root: str) -> dict[str, Any]:
    """The checkpoint at `root` as plain state dicts, for use without a trainer: `{"model": ..., "optimizer": ...,
    "fleetc": ...}`, every file checked against the manifest and loaded with `weights_only=True`, the per-rank files
    of sharding and pipeline runs merged back (`model.load_state_dict(read_checkpoint(d)["model"])`; optimizer
    state saved in flat-bucket pieces comes back flattened, as there is no parameter to give its shape)."""
    _, model_state, optimizer_state, owned_state, _, _ = _read(root)
    return {"model": model_state, "optimizer": optimizer_state, "fleetc": owned_state}


def _read(root: str, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
          wanted: set[int] | None = None
          ) -> tuple[checkpoint_commit.CheckpointVersion, dict, dict, dict, dict[int, dict], dict[Any, str]]:
    """The checkpoint's model, optimizer and fleetc state with every rank's files merged in, the carried
    gradient-merge state of a pipeline checkpoint, and the file each parameter's optimizer state came from when
    not optimizer.pt. Given the trainer's `model` and `optimizer`, the model state and the optimizer's parameter
    names are checked before the optimizer shards are joined (the optimizer gives the shapes of state saved in
    pieces); `wanted` as for load_checkpoint."""
    version = checkpoint_commit.open_latest(root, FILES)
    model_state, optimizer_state, owned_state = (version.read(name) for name in FILES)
    merges, files = {}, {"model": {}, "optimizer": {}}
    if version.meta.get(pipeline_checkpoint.PARTS_KEY):  # written one file per pipeline rank
        where = f"{version.path}/fleetc.pt"
        if not isinstance(owned_state, Mapping) or not isinstance(owned_state.get(STATE_KEY), dict) \
                or not isinstance(model_state, dict) or not isinstance(optimizer_state, dict):
            raise CheckpointError(f"{where}: the first rank's files of a pipeline checkpoint are not state dicts")
        merges, files = pipeline_checkpoint.merge_parts(version, model_state, optimizer_state, owned_state[STATE_KEY])
    if model is not None:
        check_model_state(model_state, model, f"{version.path}/model.pt", files["model"])
    names = parameter_names(model, optimizer) if model is not None else []
    if optimizer is not None:
        check_parameter_names(version.meta.get(PARAMS_KEY), names, f"{version.path}/optimizer.pt")
    pieces = version.meta.get("optimizer_shard_pieces", {})
    params = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    sizes = {index: hi for split in pieces.values() for index, _, hi in split}  # the last piece ends the tensor

    def shape_of(index: int) -> tuple:
        return tuple(params[index].shape) if index < len(params) else (max(sizes.get(index, 0), 0),)
    shards = ((f"{version.path}/{shard}", version.read(shard), pieces.get(shard, ()))  # one file per sharding rank
              for shard in _needed_shards(version.meta, wanted))
    if version.meta.get("optimizer_shards"):
        files["optimizer"].update(merge_optimizer_shards(optimizer_state["state"], shards, shape_of,
                                                         describer(names), wanted))
    return version, model_state, optimizer_state, owned_state, merges, files["optimizer"]


def describer(names: list[str | None]) -> Callable[[Any], str]:
    """Names a parameter in errors by its optimizer index and, when known, its name in the model."""
    def describe(index: Any) -> str:
        known = isinstance(index, int) and 0 <= index < len(names) and names[index] is not None
        return f"parameter {index} ({names[index]!r})" if known else f"parameter {index!r}"
    return describe


def load_checkpoint(root: str, state: TrainerState, config: Any,
                    agree: Callable[[str | None], None] | None = None, wanted: set[int] | None = None) -> str:
    """Check every file of the checkpoint at `root` against the trainer, then restore it all (or raise
    CheckpointError and change nothing); returns the version directory read. `agree(problem or None)` runs
    between checking and restoring: data parallel makes every rank agree there, so all restore or none does.
    `wanted`: the optimizer's parameter indices whose state this loader keeps (a sharding rank's own); optimizer
    shard files the manifest lists with none of them are not read (None: every file is). A pipeline checkpoint's
    carried gradient-merge state goes to `state.pipeline_merges` (refused when the trainer cannot take it: when that
    is None, or when it was carried by another pipeline layout than `state.pipeline_layout`)."""
    checked, problem = None, None
    try:
        version, model_state, optimizer_state, owned_state, merges, files = _read(root, state.model,
                                                                                 state.optimizer, wanted)
        where = {name: f"{version.path}/{name}" for name in FILES}
        check_optimizer_state(optimizer_state, state.optimizer, version.meta.get("optimizer"),
                              where["optimizer.pt"], files, describer(parameter_names(state.model, state.optimizer)))
        check_owned_state(owned_state, state.owned, config, where["fleetc.pt"])
        if state.pipeline_merges is None and pipeline_checkpoint.mid_period(merges):
            raise CheckpointError(f"{version.path}: saved between gradient-merge updates by a pipeline, whose "
                                  "stages carry gradient sums; it resumes only on a pipeline with one stage per "
                                  "process (save at an update boundary to load it elsewhere)")
        if state.pipeline_layout is not None:
            pipeline_checkpoint.check_carried(merges, state.pipeline_layout, version.path)
        checked = (model_state, optimizer_state if state.optimizer is not None else None, owned_state)
    except CheckpointError as exc:
        problem = exc
    if agree is not None:
        agree(None if problem is None else str(problem))
    if problem is not None:
        raise problem
    state.restore_all_or_nothing(*checked)
    if state.pipeline_merges is not None:
        state.pipeline_merges.update(merges)
    return version.path
