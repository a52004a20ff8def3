"""The data-parallel compiled trainer: a CompiledTrainer whose Programs allreduce gradients across ranks."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from fleetc.capture import DynamicDims
from fleetc.comm import env, groups, host
from fleetc.comm.faults import collective_failed
from fleetc.comm.mesh import ProcessMesh, pipeline_layout, resolve_mesh
from fleetc.comm.plan import check_plans_agree, check_ranks_agree
from fleetc.compiler import CompiledStep, CompiledTrainer
from fleetc.errors import CheckpointError, StrategyError
from fleetc.fleet.merge_state import averaged_accumulators
from fleetc.fleet.pipeline_state import (
    chunk_state_pieces,
    gather_stage_state,
    save_pipeline_checkpoint,
)
from fleetc.fleet.sharded_params import (
    HeldParameters,
    WholeDuringRun,
    sharded_parameters,
    whole,
)
from fleetc.fleet.sharded_state import (
    SHARD_FILE,
    drop_foreign_state,
    owned_indices,
    owned_parameters,
    save_sharded_checkpoint,
    state_pieces,
)
from fleetc.fleet.sharding_memory import per_rank_bytes, stage_share
from fleetc.ir.program import Program
from fleetc.passes.manager import History
from fleetc.passes.optimizers import GradClip
from fleetc.passes.pipeline_parallel.stages import pipeline_stages, pipelined
from fleetc.passes.recompute import RecomputePolicy
from fleetc.passes.sharding.optimizer_sharding import RS_WAIT
from fleetc.report import CompileReport
from fleetc.runtime.checkpoint import (
    TrainerState,
    load_checkpoint,
    owned_state_dict,
    rng_state,
    save_checkpoint,
)
from fleetc.runtime.guards import GuardCheck, observe_guards
from fleetc.runtime.pipeline_checkpoint import check_carried
from fleetc.runtime.pipeline_forward import ForwardPipeline, forward_pipeline
from fleetc.runtime.pipeline_local import (
    DistributedPipeline,
    PipelineExecutor,
    make_pipeline,
)
from fleetc.runtime.step_cache import DEFAULT_CACHE_LIMIT


def model_layout(model: nn.Module) -> list[str]:
    """One line per parameter and buffer: name, shape and dtype (what every rank's model must agree on)."""
    return [f"{name} {list(t.shape)} {t.dtype}" for name, t in [*model.named_parameters(), *model.named_buffers()]]


def optimizer_settings(optimizer: torch.optim.Optimizer | None) -> list[str]:
    """The optimizer's kind and every param group's hyperparameters and size: ranks that differ would diverge."""
    if optimizer is None:
        return ["no optimizer"]
    return [type(optimizer).__name__] + [
        f"group {i}: {len(group['params'])} params, " + ", ".join(f"{k}={group[k]!r}" for k in sorted(group)
                                                                  if k != "params")
        for i, group in enumerate(optimizer.param_groups)]


def broadcast_state(model: nn.Module) -> None:
    """Copy rank 0's parameters and buffers to every rank, so all ranks start from the same model (after checking
    that every rank built the same layout: a broadcast of mismatched tensors would hang or abort)."""
    check_ranks_agree("model check (before broadcasting rank 0's parameters)", {"the model": model_layout(model)},
                      "Every rank must build the same model (same parameters and buffers, shapes and dtypes).")
    timeout = env.collective_timeout()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        try:
            dist.broadcast(tensor.data, 0, async_op=True).wait(timeout)
        except RuntimeError as exc:
            raise collective_failed(f"broadcast of {name!r} from rank 0", exc, timeout.total_seconds()) from exc


def sharding_metadata(mesh: ProcessMesh, rank: int) -> dict[str, Any]:
    """What the sharding pass needs to know about this rank's place in the mesh (passes never see the environment)."""
    groups_ = {"sharding": mesh.groups("sharding")}
    if mesh.dp > 1:
        groups_["sharding_dp"] = mesh.groups("dp")
    return {"degree": mesh.sharding, "rank": mesh.coordinates(rank)["sharding"], "dp_degree": mesh.dp,
            "groups": groups_}


class DataParallelTrainer(CompiledTrainer):
    """Each rank trains on its own shard of the batch; gradients are averaged, so all ranks stay identical.

    Built by `fleet.distributed_model(model)` or `fleetc.compile(model, optimizer=fleet.distributed_optimizer(...))`.
    Construction broadcasts rank 0's parameters and buffers. Each training Program is checked to issue
    the same collectives on every rank before it first runs.
    """

    def __init__(self, model: nn.Module, strategy: Any = None, *, optimizer: torch.optim.Optimizer | None = None,
                 loss_fn: Callable | None = None, measure_memory: bool = False, verify: bool = False,
                 disable_passes: Iterable[str] = (), print_after: str | None = None,
                 recompute_policy: RecomputePolicy | None = None, grad_clip: GradClip | None = None,
                 cpu_kernels: str | None = None, on_guard_failure: str = "recompile",
                 cache_limit: int = DEFAULT_CACHE_LIMIT, dynamic: bool | None = None,
                 dynamic_dims: dict[str, dict[int, str]] | None = None, compile_cache: str | None = None):
        super().__init__(model, strategy, optimizer=optimizer, loss_fn=loss_fn, measure_memory=measure_memory,
                         verify=verify, disable_passes=disable_passes, print_after=print_after,
                         recompute_policy=recompute_policy, grad_clip=grad_clip, cpu_kernels=cpu_kernels,
                         on_guard_failure=on_guard_failure, cache_limit=cache_limit, dynamic=dynamic,
                         dynamic_dims=dynamic_dims, compile_cache=compile_cache)
        self.world_size = env.world_size()
        self._owned: set[str] | None = None  # under sharding: the parameters this rank updates
        self._gathered_at = -1  # under a pipeline across processes: the step whose stage state was last gathered
        self._resumed_merges: dict[int, dict] | None = None  # a loaded pipeline checkpoint's carried merge state
        self._sharded_params: HeldParameters | None = None  # stage 3: the parameters this rank holds
        self.mesh, mesh_notes = resolve_mesh(self.config, self.world_size)
        self.decisions += [f"process mesh {self.mesh}", *mesh_notes]
        if self.world_size > 1:
            broadcast_state(model)

    def _optimize(self, program: Program, capture_seconds: float) -> tuple[Program, History, CompileReport]:
        if pipelined(program, self.config):  # the stage count of device_guard is known now
            self.mesh, _ = resolve_mesh(self.config, self.world_size, pipeline_stages(program))
        # the ranks that hold the same stage (dp × sharding) average gradients; pipeline stages are the other ranks
        program.metadata["data_parallel"] = {"world_size": self.world_size // self.mesh.pp}
        if self.mesh.pp > 1:
            program.metadata["data_parallel"]["groups"] = self.mesh.groups("dp", "sharding")
        if self.config.sharding and self.world_size > 1:
            program.metadata["sharding"] = sharding_metadata(self.mesh, env.rank())
            if self._sharded_params is not None:  # stage 3: later Programs follow the training step's layout
                program.metadata["sharding"].update(self._sharded_params.layout())
        return super()._optimize(program, capture_seconds)

    def _compile(self, kind: str, args: tuple, kwargs: dict, dynamic: DynamicDims) -> CompiledStep:
        with whole(self._sharded_params, values=False):  # stage 3: capture sees whole-shaped parameters
            compiled = super()._compile(kind, args, kwargs, dynamic)
        gathers = "param_layout" in compiled.program.metadata.get("sharding", {})  # stage 3 eval too
        if self.world_size > 1 and (kind == "train" or gathers or compiled.pipeline is not None):
            # The plan check first: a dead rank or a disagreement fails here, cleanly, before group creation waits.
            check_plans_agree(compiled.program, {"the optimizer's settings": optimizer_settings(self.optimizer)})
            pipeline_group = {"pp": self.mesh.groups("pp")} if compiled.pipeline is not None else {}
            try:
                groups.ensure_groups({**compiled.program.metadata.get("collective_groups", {}), **pipeline_group})
            except (RuntimeError, dist.DistError) as exc:
                raise collective_failed("process group creation", exc,
                                        env.collective_timeout().total_seconds()) from exc
        if self.world_size > 1 and kind == "train":
            self._owned = owned_parameters(compiled.program.metadata)
            if self._owned is not None:
                drop_foreign_state(self.optimizer, self.model, self._owned)  # e.g. loaded from a checkpoint
            if self._sharded_params is None:
                self._sharded_params = sharded_parameters(self.model, compiled.program.metadata,
                                                          getattr(compiled.pipeline, "chunks", None))
                if self._sharded_params is not None:  # stage 3: keep only the parameters this rank owns
                    self._sharded_params.release()
        if self._sharded_params is not None:  # the guards describe the model as steps see it: released
            compiled.guards = GuardCheck(observe_guards(kind, self.model, self.optimizer, args, kwargs,
                                                        compiled.program), self.model, self.optimizer)
        return compiled

    def _make_pipeline(self, program: Program) -> PipelineExecutor:
        """This process's rank of its pipeline group (the mesh's pp axis), over torch.distributed."""
        if self.world_size == 1:
            return super()._make_pipeline(program)
        pipeline = make_pipeline(program, self.model, self.optimizer, self.counters, self.cpu_kernels,
                                 self.mesh.group_of("pp", env.rank()), "pp")
        if self._resumed_merges is not None:  # loaded before this pipeline existed
            self._resume_pipeline(pipeline)
        return pipeline

    def _pipeline_layout(self, pipeline: PipelineExecutor | None) -> tuple[int | None, int, int] | None:
        """The layout a loaded checkpoint's carried gradient-merge sums must fit: the built pipeline's, else the one
        the strategy plans (its depth None while the device_guard stages that decide it are not captured)."""
        return pipeline_layout(self.config, len(pipeline.plan.stages) if pipeline is not None else None)

    def _resume_pipeline(self, pipeline: PipelineExecutor) -> None:
        """Hand a loaded checkpoint's carried gradient-merge state for this rank to its pipeline executor (its layout
        was checked by the load, but for a depth the device_guard stages decided after it)."""
        try:
            check_carried(self._resumed_merges, self._pipeline_layout(pipeline), "the loaded checkpoint")
            pipeline.load_state(self._resumed_merges.get(pipeline.ranks_here[0]))
        except CheckpointError as exc:  # only a depth the load could not know
            raise CheckpointError(f"{exc} (found at the first step, whose capture gave the pipeline depth: the load "
                                  "had already restored the checkpoint; set hybrid_configs.pp_degree to have the load "
                                  "refuse it before restoring anything)") from exc
        except StrategyError as exc:
            raise CheckpointError(f"the loaded checkpoint does not fit this pipeline: {exc}") from exc
        finally:
            self._resumed_merges = None

    def _distributed_pipeline(self) -> DistributedPipeline | None:
        """This process's pipeline rank, once a training step built it (one stage per process)."""
        pipeline = self._last_train.pipeline if self._last_train is not None else None
        return pipeline if isinstance(pipeline, DistributedPipeline) else None

    def _make_forward_pipeline(self, program: Program) -> ForwardPipeline | WholeDuringRun:
        """This process's rank of the forward-only pipeline (the mesh's pp axis), over torch.distributed; under
        sharding stage 3 its stages' parameters are gathered whole for each run."""
        if self.world_size == 1:
            return super()._make_forward_pipeline(program)
        pipeline = forward_pipeline(program, self.cpu_kernels, self.mesh.group_of("pp", env.rank()), "pp",
                                    env.collective_timeout().total_seconds())
        if self.config.sharding and self.config.sharding_configs.stage == 3:  # the stages hold pieces between steps
            return WholeDuringRun(pipeline, self.whole_parameters)
        return pipeline

    def _gather_pipeline_stages(self) -> None:
        """With one pipeline stage per process, each rank's model is current for its stages only: gather the others'
        (a collective, once per training step at most) before anything reads the whole model."""
        pipeline = self._distributed_pipeline()
        if pipeline is not None and self._gathered_at != self._steps:
            gather_stage_state(self.model, self.optimizer, set(pipeline.holders))
            self._gathered_at = self._steps

    def _before_eval(self, compiled: CompiledStep) -> None:
        """Under a pipeline with one stage per process every rank evaluates. With device_guard stages evaluation runs
        pipelined, forward only: each rank runs its own stages on their current state, and every rank returns the
        last stage's outputs. Otherwise the stages' current state is gathered first, and each rank runs the whole
        evaluation Program."""
        if compiled.pipeline is None:
            self._gather_pipeline_stages()

    def memory_stats(self) -> dict[str, Any]:
        """The static estimate; under sharding also `sharding`: this rank's parameter, gradient and optimizer-state
        bytes beside the ZeRO formula's (fleet/sharding_memory.py)."""
        stats = super().memory_stats()
        if self._owned is not None and self.optimizer is not None:
            whole_numel = self._sharded_params.numel() if self._sharded_params is not None else None
            share: dict[str, Any] = {"programs": [self.program], "whole_numel": whole_numel}
            if (pipeline := self._distributed_pipeline()) is not None:  # this rank's pipeline stages only
                whole = {n: p.shape for n, p in self.model.named_parameters()}  # stage 3: the pieces' whole shapes
                share = stage_share(self.program, pipeline.plan, pipeline.chunks,
                                    getattr(self._sharded_params, "shapes", whole))
            stats["sharding"] = per_rank_bytes(self.model, self.optimizer, degree=self.mesh.sharding,
                                               stage=self.config.sharding_configs.stage, reduce_scatter_wait=RS_WAIT, **share)
        return stats

    def whole_parameters(self) -> AbstractContextManager[None]:
        """Inside the block every parameter of the model is whole and current (sharding stage 3: gathered from their
        owners, a collective every rank enters; otherwise they already are)."""
        return whole(self._sharded_params)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the whole, current parameters and buffers on every rank (stage 3: gathered from their owners;
        a collective, so every rank calls it)."""
        with whole(self._sharded_params):
            self._gather_pipeline_stages()  # one pipeline stage per process: the other stages' current state too
            return super().full_state_dict()

    # ----- checkpointing: the first rank writes, every rank restores ------------------------
    def _live_state(self) -> TrainerState:
        return TrainerState(self.model, self.optimizer, self.counters, rank=env.rank())

    def _rank_averaged(self, owned: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`owned` with its gradient-merge accumulators averaged over the ranks, as a checkpoint holds them mid
        period (fleet/merge_state.py; a collective when there are any)."""
        program = self._last_train.program if self._last_train is not None else None
        return averaged_accumulators(owned, program, self.world_size)

    def state_dict(self) -> dict[str, Any]:
        """CompiledTrainer.state_dict, with the gradient-merge accumulators averaged over the ranks as in
        save_checkpoint: under gradient merge every rank calls it (a collective), and loading the first rank's copy
        on every rank resumes mid period as the uninterrupted run. A pipeline rank's carried merge sums are save_checkpoint's only."""
        if self._distributed_pipeline() is not None:
            return super().state_dict()
        return owned_state_dict(self._rank_averaged(self.counters), self.config, [rng_state()])

    def save_checkpoint(self, dirname: str) -> str:
        """Every rank calls it: their RNG states are gathered, the first rank writes a new crash-safe version, and
        all wait for it (CheckpointError on every rank when the write failed). Under sharding each shard, and with
        one pipeline stage per process each stage, writes its own part into that version first."""
        with whole(self._sharded_params):
            return self._save_whole(dirname)

    def _save_whole(self, dirname: str) -> str:
        rng = host.gather_objects(rng_state(), "checkpoint (gathering RNG states)")
        pipeline = self._distributed_pipeline()
        if pipeline is not None:  # each stage writes its own part (sharded: and each shard its optimizer file)
            return self._save_pipeline(dirname, rng, pipeline)
        self._gather_pipeline_stages()
        live = self._live_state()
        live.owned = self._rank_averaged(live.owned)  # mid gradient-merge period
        if self._owned is not None and self.optimizer is not None:  # sharded: each shard's entries in its own file
            coordinates = self.mesh.coordinates(env.rank())
            return save_sharded_checkpoint(dirname, live, self.config, rng, coordinates["sharding"],
                                           writes_shard=coordinates["dp"] == 0,
                                           pieces=state_pieces(self.program.metadata, self.optimizer, self.model))
        written, problem = "", None
        if env.rank() == 0:
            try:
                written = save_checkpoint(dirname, live, self.config, rng)
            except (OSError, CheckpointError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
        outcome = host.gather_objects((written, problem), "checkpoint (waiting for the first rank's write)")[0]
        if outcome[1] is not None:
            raise CheckpointError(f"the first rank could not write checkpoint {dirname!r}: {outcome[1]}")
        return outcome[0]

    def _save_pipeline(self, dirname: str, rng: list, pipeline: DistributedPipeline) -> str:
        """A pipeline's checkpoint: the first replica of each stage writes the stage's part; under sharding every
        (stage, sharding rank) of the first data-parallel replica writes its optimizer shard file too."""
        at = self.mesh.coordinates(env.rank())
        replicas = [r for r in range(self.world_size) if self.mesh.coordinates(r)["pp"] == at["pp"]]
        shard = None
        if self._owned is not None and self.optimizer is not None:
            shard = (SHARD_FILE.format(at["pp"] * self.mesh.sharding + at["sharding"]),
                     chunk_state_pieces(pipeline, self.optimizer, self.model))  # VPP: every chunk's
        return save_pipeline_checkpoint(dirname, self._live_state(), self.config, rng, pipeline,
                                        at["dp"] == 0 and at["sharding"] == 0, replicas, shard, at["dp"] == 0)

    def load_checkpoint(self, dirname: str) -> str:
        """Every rank checks the checkpoint; only when all found it fitting does each restore it (all or nothing,
        on every rank)."""
        def agree(problem: str | None) -> None:
            problems = host.gather_objects(problem, "checkpoint (agreeing that it fits every rank)")
            failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
            if failed:
                raise CheckpointError(f"checkpoint {dirname!r} does not fit rank {failed[0][0]}: {failed[0][1]}")
        live = self._live_state()
        if self.config.pipeline and self.world_size > 1:  # a pipeline rank takes its carried gradient-merge sums
            live.pipeline_merges = {}
            live.pipeline_layout = self._pipeline_layout(self._distributed_pipeline())  # checked before restoring
        with whole(self._sharded_params):  # stage 3: the checkpoint's whole parameters, then this rank's again
            loaded = load_checkpoint(dirname, live, self.config, agree,
                                     owned_indices(self.optimizer, self.model, self._owned))
        self._resumed_merges = live.pipeline_merges
        pipeline = self._distributed_pipeline()
        if pipeline is not None:
            self._resume_pipeline(pipeline)
        self._gathered_at = self._steps  # every rank now holds the whole checkpoint
        if self._owned is not None:  # the checkpoint holds every parameter's state: keep this rank's
            drop_foreign_state(self.optimizer, self.model, self._owned)
        return loaded
