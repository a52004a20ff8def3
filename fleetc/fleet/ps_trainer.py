"""The parameter-server worker's trainer: a CompiledTrainer whose Programs pull from and push to the servers."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fleetc.comm.ps.client import Client
from fleetc.comm.ps.placement import Placement, place
from fleetc.comm.ps.rules import optimizer_spec
from fleetc.compiler import CompiledTrainer
from fleetc.errors import CheckpointError, FleetcError
from fleetc.ir.program import Program
from fleetc.passes.manager import History
from fleetc.report import CompileReport
from fleetc.runtime import checkpoint_commit

PARAMS_FILE = "ps_params.pt"
STATE_FILE = "ps_optimizer_state.pt"
FILES = (PARAMS_FILE, STATE_FILE)
THREAD_BARRIER = "execution_strategy.use_thread_barrier"


def ps_mode(config: Any) -> tuple[str, int]:
    """Paddle's choice: a_sync=False is sync; a_sync with a_sync_configs.k_steps > 0 is geo, else async."""
    if not config.a_sync:
        return "sync", 0
    k_steps = config.a_sync_configs.k_steps
    return ("geo", k_steps) if k_steps > 0 else ("async", 0)


def embedding_tables(model: nn.Module) -> set[str]:
    """The weights of the model's nn.Embedding and nn.EmbeddingBag modules: the tables row-sharded over the
    servers."""
    return {f"{path}.weight" if path else "weight" for path, module in model.named_modules()
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag))}


class ParameterServerTrainer(CompiledTrainer):
    """Built by `fleet.distributed_model(model)` on a worker of a parameter-server job (after fleet.init_worker()).

    Construction places the parameters on the servers (worker 0 sends its initial values unless the servers loaded
    a checkpoint) and waits until every server is ready. Each step pulls and pushes inside the compiled Program.
    """

    programs_read_servers = True  # export compiles the model's eval Program without the PS pass (export_sources)

    def __init__(self, model: nn.Module, strategy: Any = None, *, optimizer: torch.optim.Optimizer | None = None,
                 client: Client, loss_fn: Callable | None = None, **compile_options: Any):
        if optimizer is None:
            raise FleetcError("parameter-server mode needs an optimizer: the servers run its update")
        super().__init__(model, strategy, optimizer=optimizer, loss_fn=loss_fn, **compile_options)
        self.client = client
        self.mode, self.k_steps = ps_mode(self.config)
        self.spec = optimizer_spec(optimizer)
        self.barrier = bool(self.config.execution_strategy.use_thread_barrier)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self.placement: Placement = place(shapes, embedding_tables(model), client.role.server_num)
        self.decisions = [d for d in self.decisions if not d.startswith("a_sync:")]  # replaced by the mode line
        self.decisions.append(self._mode_line())
        params = dict(model.named_parameters())
        with torch.no_grad():
            client.register(self.placement, self.spec, self.mode, self.k_steps, self.barrier, params)
            if self.mode == "geo":
                client.geo_start({n: p.data for n, p in params.items()})

    def _mode_line(self) -> str:
        what = {"sync": "a_sync=False: sync, the servers average every worker's gradients once per step",
                "async": "a_sync=True, a_sync_configs.k_steps<=0: async, each push is applied as it arrives",
                "geo": f"a_sync=True, a_sync_configs.k_steps={self.k_steps}: geo, local updates and parameter "
                       f"deltas sent every {self.k_steps} step(s)"}[self.mode]
        barrier = ("; use_thread_barrier: every worker waits for the others at each push" if self.barrier
                   and self.mode != "sync" else "")
        return f"parameter server: {what}{barrier}"

    def _optimize(self, program: Program, capture_seconds: float) -> tuple[Program, History, CompileReport]:
        program.metadata["parameter_server"] = {
            "mode": self.mode, "k_steps": self.k_steps, "use_thread_barrier": self.barrier,
            "placement": self.placement.to_data(), "lr": self.spec["lr"], **self._merge()}
        final, history, report = super()._optimize(program, capture_seconds)
        if report.skipped.pop(THREAD_BARRIER, None) is not None and self.mode == "sync":
            report.skipped[THREAD_BARRIER] = "not needed: sync mode already waits for every worker at each step"
        return final, history, report

    def _merge(self) -> dict:
        """Gradient merge in sync / async mode: the worker's push sends every k steps (the gradient_merge pass
        stands aside); in geo mode the gradient_merge pass merges the local update as in one process."""
        if not self.config.gradient_merge or self.mode == "geo":
            return {}
        merge = self.config.gradient_merge_configs
        return {"merge_steps": int(merge.k_steps), "merge_avg": bool(merge.avg)}

    # ----- checkpoints: gathered from the servers, written by the calling worker ------------
    def pull_all(self) -> None:
        """Copy the servers' current parameters into the local model (for evaluation outside the Program, export)."""
        params, _ = self.client.gather()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(params[name])

    def save_checkpoint(self, dirname: str) -> str:
        """Gather parameters and optimizer state from every server and write them as a new crash-safe version of
        `dirname`; servers restart from it with fleet.init_server(dirname)."""
        params, state = self.client.gather()
        staged = checkpoint_commit.begin(dirname)
        try:
            staged.write(PARAMS_FILE, params)
            staged.write(STATE_FILE, state)
            return staged.commit({"parameter_server": {"rule": self.spec["type"], "mode": self.mode,
                                                       "servers": self.client.role.server_num}})
        except BaseException:
            staged.abort()
            raise

    def load_checkpoint(self, dirname: str) -> str:
        raise CheckpointError("in parameter-server mode the servers hold the parameters: restart the job and pass "
                              f"the checkpoint to fleet.init_server({dirname!r}) on every server")


def read_checkpoint(dirname: str) -> dict:
    """What a server loads in fleet.init_server(dirname): full parameters and optimizer state."""
    version = checkpoint_commit.open_latest(dirname, FILES)
    if "parameter_server" not in version.meta and version.manifest is not None:
        raise CheckpointError(f"{dirname}: not a parameter-server checkpoint (written by fleet.save_persistables "
                              "in a parameter-server job)")
    return {"params": version.read(PARAMS_FILE), "optimizer": version.read(STATE_FILE)}
