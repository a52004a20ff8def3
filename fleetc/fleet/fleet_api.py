"""`fleetc.fleet`'s functions: Paddle Fleet's API, collective mode on torch.distributed, parameter-server mode on
torch.distributed.rpc (docs/parameter_server.md)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from fleetc.comm import env, groups, host
from fleetc.comm.ps import rpc as ps_rpc
from fleetc.comm.ps import server as ps_server
from fleetc.comm.ps.client import Client, active_client, set_client
from fleetc.comm.ps.role import PsRole, ps_environment_present
from fleetc.compiler import CompiledTrainer
from fleetc.errors import FleetcError
from fleetc.fleet import export_sources, inference
from fleetc.fleet.optimizer import DistributedOptimizer
from fleetc.fleet.ps_trainer import ParameterServerTrainer, read_checkpoint
from fleetc.fleet.role_maker import PaddleCloudRoleMaker
from fleetc.fleet.trainer import DataParallelTrainer


class Fleet:
    """One per process: the role, the last distributed optimizer, and the trainer built from it."""

    def __init__(self) -> None:
        self.role: env.Role | None = None
        self.optimizer: DistributedOptimizer | None = None
        self.trainer: DataParallelTrainer | ParameterServerTrainer | None = None
        self.ps_role: PsRole | None = None  # set in a parameter-server job
        self.ps_client: Client | None = None

    def init(self, role_maker: Any = None, is_collective: bool | None = None, timeout: float | None = None) -> None:
        """Join the job: from the launcher's environment, or from `role_maker` (rank, world, endpoints).

        Collective mode is the default; parameter-server mode when `is_collective=False`, or when it is not given and
        the launcher set TRAINING_ROLE (`fleetc run --server_num S --worker_num W`). `timeout` (seconds) bounds every
        collective wait and rpc from now on (default FLEETC_COLLECTIVE_TIMEOUT or 300).
        """
        if is_collective is None:
            is_collective = getattr(role_maker, "is_collective", not ps_environment_present())
        maker = role_maker or PaddleCloudRoleMaker(is_collective=is_collective)
        if timeout is not None:
            env.set_collective_timeout(timeout)
        if not getattr(maker, "is_collective", is_collective):
            self._init_parameter_server(maker.ps_role())
            return
        role = maker.role()
        env.init_process_group(role)
        self.role = env.exchange_endpoints(role) if role_maker is None else role

    # ----- parameter-server mode ------------------------------------------------------------
    def _init_parameter_server(self, role: PsRole) -> None:
        """Join the rpc group of every server and worker; a server's tables exist from now on, empty until
        init_server and worker 0's setup."""
        timeout = env.collective_timeout().total_seconds()
        if role.is_server:
            ps_server.start(ps_server.Server(role, timeout))
        ps_rpc.join(role, timeout)
        self.ps_role = role
        if not role.is_server:
            self.ps_client = Client(role, timeout)
            self.ps_client.start_heartbeat()

    def _ps(self, server: bool | None = None, call: str = "") -> PsRole:
        """The parameter-server role; FleetcError when not in PS mode or (for `server`) in the wrong role."""
        if self.ps_role is None:
            raise FleetcError(f"fleet.{call}() is a parameter-server call: call fleet.init() in a job started with "
                              "`fleetc run --server_num S --worker_num W` (or fleet.init(is_collective=False) with "
                              "Paddle's role environment) first")
        if server is not None and self.ps_role.is_server != server:
            raise FleetcError(f"fleet.{call}() runs on {'servers' if server else 'workers'}; this process is "
                              f"{self.ps_role.name}")
        return self.ps_role

    def is_server(self) -> bool:
        """True on a parameter server, False on a worker (and in collective mode)."""
        if self.ps_role is None:
            self._role()
            return False
        return self.ps_role.is_server

    def server_num(self) -> int:
        return self._ps(call="server_num").server_num

    def server_index(self) -> int:
        return self._ps(server=True, call="server_index").index

    def server_endpoints(self, to_string: bool = False) -> list[str] | str:
        endpoints = list(self._ps(call="server_endpoints").server_endpoints)
        return ",".join(endpoints) if to_string else endpoints

    def init_server(self, dirname: str | None = None, var_names: Any = None, **kwargs: Any) -> None:
        """Prepare this server: from the checkpoint `dirname` (fleet.save_persistables of a PS job), else from
        worker 0's initial parameters when it builds its trainer."""
        self._ps(server=True, call="init_server")
        ps_server.current_server().init(read_checkpoint(dirname) if dirname else None)

    def run_server(self) -> None:
        """Serve until every worker has called stop_worker(), then leave the job; ParameterServerError (after
        leaving at once) when a worker was silent for the rpc timeout."""
        self._ps(server=True, call="run_server")
        server = ps_server.current_server()
        if not server.initialized.is_set():
            raise FleetcError("call fleet.init_server() before fleet.run_server()")
        try:
            server.serve()
        except BaseException:
            ps_rpc.leave(graceful=False)
            raise
        ps_rpc.leave(graceful=True)
        self.ps_role = None

    def stop_server(self) -> None:
        """Servers stop by themselves once every worker called stop_worker(); nothing to do."""
        self._ps(call="stop_server")

    # ----- both modes ------------------------------------------------------------------------
    def _role(self) -> env.Role:
        if self.role is None:
            raise FleetcError("fleet is not initialized: call fleet.init(is_collective=True) first")
        return self.role

    def worker_index(self) -> int:
        if self.ps_role is not None:
            return self._ps(server=False, call="worker_index").index
        return self._role().rank

    def worker_num(self) -> int:
        if self.ps_role is not None:
            return self.ps_role.worker_num
        return self._role().world_size

    def is_first_worker(self) -> bool:
        if self.ps_role is not None:
            return not self.ps_role.is_server and self.ps_role.index == 0
        return self._role().rank == 0

    def is_worker(self) -> bool:
        """True on workers (in collective mode every process is one)."""
        if self.ps_role is not None:
            return not self.ps_role.is_server
        self._role()
        return True

    def worker_endpoints(self, to_string: bool = False) -> list[str] | str:
        if self.ps_role is not None:  # workers of a PS job do not listen; the launcher may still name them
            endpoints = [e for e in os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e]
        else:
            endpoints = list(self._role().endpoints)
        return ",".join(endpoints) if to_string else endpoints

    def barrier_worker(self) -> None:
        """Every worker waits here for the others (bounded by the collective / rpc timeout)."""
        if self.ps_role is not None:
            self._ps(server=False, call="barrier_worker")
            self.ps_client.barrier()
            return
        self._role()
        host.barrier("barrier_worker")

    def init_worker(self) -> None:
        """Parameter-server mode: this worker's client to the servers (its model is placed on them when
        distributed_model builds the trainer). Collective mode: nothing beyond `init`."""
        if self.ps_role is not None:
            self._ps(server=False, call="init_worker")
            set_client(self.ps_client)
            return
        self._role()

    def stop_worker(self) -> None:
        """Leave the job: tell the servers this worker is done and leave the rpc group (parameter-server mode), or
        destroy the process groups (after this, `init` may be called again)."""
        if self.ps_role is not None:
            self._ps(server=False, call="stop_worker")
            self.ps_client.stop()
            ps_rpc.leave(graceful=True)
            set_client(None)
            self.ps_role = self.ps_client = self.optimizer = self.trainer = None
            return
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
        if self.ps_role is not None:
            self._ps(server=False, call="distributed_model")
            if self.ps_client is None or self.ps_client is not active_client():
                raise FleetcError("call fleet.init_worker() before building the trainer")
            self.trainer = ParameterServerTrainer(model, strategy if strategy is not None else optimizer.strategy,
                                                  optimizer=optimizer.inner, client=self.ps_client,
                                                  **compile_options)
            return self.trainer
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
        if isinstance(trainer, ParameterServerTrainer):  # the calling worker exports the servers' current weights
            trainer.pull_all()
        whole = getattr(trainer, "whole_parameters", contextlib.nullcontext)  # sharding stage 3: gathered, all ranks
        with whole():
            if self.role is not None and not self.is_first_worker():
                self.barrier_worker()
                return None
            try:
                return inference.save_inference_model(trainer, dirname, feeded_var_names, target_vars, main_program,
                                                      export_for_deployment, dynamic_batch=dynamic_batch)
            finally:  # also when the export fails: the others are released now, not at the collective timeout
                if self.role is not None:
                    self.barrier_worker()

