"""`fleetc.fleet`'s functions: Paddle Fleet's collective-mode API on torch.distributed."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from fleetc.comm import env, groups, host
from fleetc.errors import FleetcError
from fleetc.compiler import CompiledTrainer
from fleetc.fleet import export_sources, inference
from fleetc.fleet.optimizer import DistributedOptimizer
from fleetc.fleet.role_maker import PaddleCloudRoleMaker
from fleetc.fleet.trainer import DataParallelTrainer

PS_NOT_SUPPORTED = ("{name}: fleetc supports collective (data-parallel) mode; parameter-server mode is planned, "
                    "not implemented. Use fleet.init(is_collective=True).")


class Fleet:
    """One per process: the role, the last distributed optimizer, and the trainer built from it."""

    def __init__(self) -> None:
        self.role: env.Role | None = None
        self.optimizer: DistributedOptimizer | None = None
        self.trainer: DataParallelTrainer | None = None

    def init(self, role_maker: Any = None, is_collective: bool = True, timeout: float | None = None) -> None:
        """Join the job: from the launcher's environment, or from `role_maker` (rank, world, endpoints).

        `timeout` (seconds) bounds every collective wait from now on (default FLEETC_COLLECTIVE_TIMEOUT or 300).
        """
        maker = role_maker or PaddleCloudRoleMaker(is_collective=is_collective)
        if not getattr(maker, "is_collective", is_collective):
            raise NotImplementedError(PS_NOT_SUPPORTED.format(name="fleet.init(is_collective=False)"))
        if timeout is not None:
            env.set_collective_timeout(timeout)
        role = maker.role()
        env.init_process_group(role)
        self.role = env.exchange_endpoints(role) if role_maker is None else role

    def _role(self) -> env.Role:
        if self.role is None:
            raise FleetcError("fleet is not initialized: call fleet.init(is_collective=True) first")
        return self.role

    def worker_index(self) -> int:
        return self._role().rank

    def worker_num(self) -> int:
        return self._role().world_size

    def is_first_worker(self) -> bool:
        return self._role().rank == 0

    def is_worker(self) -> bool:
        """Always True once initialized: in collective mode every process is a worker."""
        self._role()
        return True

    def worker_endpoints(self, to_string: bool = False) -> list[str] | str:
        endpoints = list(self._role().endpoints)
        return ",".join(endpoints) if to_string else endpoints

    def barrier_worker(self) -> None:
        """Every worker waits here for the others (bounded by the collective timeout)."""
        self._role()
        host.barrier("barrier_worker")

    def init_worker(self) -> None:
        """Nothing to prepare beyond `init` in collective mode (parameters are broadcast when the model is compiled)."""
        self._role()

    def stop_worker(self) -> None:
        """Leave the job: destroy the process groups (after this, `init` may be called again)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        groups.reset()
        self.role = self.optimizer = self.trainer = None

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer, strategy: Any = None) -> DistributedOptimizer:
        self.optimizer = DistributedOptimizer(optimizer, strategy, fleet=self)
        return self.optimizer

    def distributed_model(self, model: nn.Module, loss_fn: Callable | None = None,
                          **compile_options: Any) -> DataParallelTrainer:
        """The data-parallel trainer of `model`, with the last `distributed_optimizer`'s optimizer and strategy."""
        if self.optimizer is None:
            raise FleetcError("call fleet.distributed_optimizer(optimizer, strategy) before fleet.distributed_model")
        return self.compile(model, self.optimizer, loss_fn=loss_fn, **compile_options)

    def compile(self, model: nn.Module, optimizer: DistributedOptimizer, strategy: Any = None,
                **compile_options: Any) -> DataParallelTrainer:
        """What `fleetc.compile(model, optimizer=distributed_optimizer)` does."""
        self._role()
        self.trainer = DataParallelTrainer(model, strategy if strategy is not None else optimizer.strategy,
                                           optimizer=optimizer.inner, **compile_options)
        return self.trainer

    def _trainer(self, trainer: Any) -> Any:
        trainer = trainer or self.trainer
        if trainer is None:
            raise FleetcError("no trainer to save or load: build one with fleet.distributed_model(model) "
                              "or pass trainer=")
        return trainer

    def save_persistables(self, dirname: str, trainer: Any = None) -> None:
        """Every rank calls it: the first worker writes parameters, buffers, optimizer state, fleetc state and every
        rank's RNG state as a new crash-safe version of the checkpoint (docs/checkpoints.md); all wait for it."""
        self._trainer(trainer).save_checkpoint(dirname)

    def load_persistables(self, dirname: str, trainer: Any = None) -> None:
        """Every rank restores what `save_persistables` wrote (all of it, or nothing and a CheckpointError)."""
        self._trainer(trainer).load_checkpoint(dirname)

    def save_inference_model(self, executor: Any, dirname: str, feeded_var_names: str | list[str],
                             target_vars: str | list[str] | None, main_program: Any = None,
                             export_for_deployment: bool = True, *, trainer: Any = None,
                             dynamic_batch: bool = True) -> inference.InferenceExport | None:
        """Paddle's call: export the trained model for inference into `dirname` (see docs/export.md).

        `executor` is accepted and ignored. `feeded_var_names` are `forward` argument names; `target_vars` are
        `output`, `output.<i>`, module paths or eval-Program value names. `main_program`: an eval Program, or a
        trainer (default: the trainer's own eval Program). `export_for_deployment` prunes what the targets do
        not need. Rank 0 writes while the others wait at a barrier; returns the export on the rank that wrote.
        """
        if isinstance(main_program, CompiledTrainer):
            trainer, main_program = main_program, None
        trainer = self._trainer(trainer)
        export_sources.check_feed_names(trainer.model, export_sources.as_names(feeded_var_names, "feeded_var_names"))
        if self.role is not None and not self.is_first_worker():
            self.barrier_worker()
            return None
        try:
            return inference.save_inference_model(trainer, dirname, feeded_var_names, target_vars, main_program,
                                                  export_for_deployment, dynamic_batch=dynamic_batch)
        finally:  # also when the export fails: the others are released now, not at the collective timeout
            if self.role is not None:
                self.barrier_worker()

    def _parameter_server_only(self, name: str) -> Callable:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(PS_NOT_SUPPORTED.format(name=f"fleet.{name}"))
        return refuse


PARAMETER_SERVER_CALLS = ("init_server", "run_server", "stop_server", "server_num", "server_index",
                          "server_endpoints", "is_server")
