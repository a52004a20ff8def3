"""Running parameter-server test jobs (`fleet.ps_workers.train` in every process) and the single-process training
each is compared with."""
from __future__ import annotations

import torch
from torch import nn
from zoo import CTR_ENTRY

import fleetc
from fleet.ps_workers import PS_OPTIMIZERS, batches, grad_clip, make_model, make_strategy
from fleet.spawn import start_ps
from fleetc.comm.ps.placement import place
from fleetc.fleet.ps_trainer import embedding_tables
from fleetc.ir.program import Program


def ps_program(model: nn.Module, mode: str, strategy: fleetc.DistributedStrategy | None = None,
               grad_clip: fleetc.ClipGradByGlobalNorm | None = None, **settings) -> Program:
    """The CTR training Program stamped as the PS trainer stamps it (two servers), for the parameter_server pass
    alone: the capture, or with a strategy or clipping, the Program after the other passes."""
    trainer = fleetc.compile(model, strategy, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=CTR_ENTRY.loss_fn, verify=True, grad_clip=grad_clip)
    ids, labels = CTR_ENTRY.make_batch(torch.Generator().manual_seed(0))[0]
    trainer.step(ids[:8] % 50, labels[:8])
    plain = strategy is None and grad_clip is None
    program = (trainer.history[0].program if plain else trainer.program).clone()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    program.metadata["parameter_server"] = {"mode": mode, "k_steps": 2, "use_thread_barrier": False, "lr": 0.1,
                                            "placement": place(shapes, embedding_tables(model), 2).to_data(),
                                            **settings}
    return program


def reference_run(config: dict, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Eager single-process training on the global batches with the update rule the servers run (SparseAdam for a
    table under Adam); with `gradient_merge` k, the update runs every k steps on the mean of their gradients."""
    model, entry = make_model(config)
    if config["opt"] == "adam" and config["model"] == "ctr":
        model.embedding.sparse = True
        dense = [p for n, p in model.named_parameters() if n != "embedding.weight"]
        optimizers = [torch.optim.SparseAdam([model.embedding.weight], lr=1e-2), PS_OPTIMIZERS["adam"](dense)]
    else:
        optimizers = [PS_OPTIMIZERS[config["opt"]](model.parameters())]
    merge = config.get("gradient_merge", 1)
    losses = []
    for step, args in enumerate(batches(config, steps)):
        loss = entry.loss_fn(model(args[0]), args[1])
        loss.backward()
        if (step + 1) % merge == 0:
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad /= merge
                optimizer.step()
                optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def compiled_reference(config: dict, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """fleetc.compile in one process with the job's strategy (a_sync is ignored there) and gradient clipping: what a
    geo job of one worker and one server must equal, since it trains locally and its deltas come back unchanged."""
    model, entry = make_model(config)
    trainer = fleetc.compile(model, make_strategy(config), optimizer=PS_OPTIMIZERS[config["opt"]](model.parameters()),
                             loss_fn=entry.loss_fn, grad_clip=grad_clip(config))
    losses = [float(trainer.step(*args)) for args in batches(config, steps)]
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def run_jobs(tmp_path, jobs: dict[str, tuple[int, int, dict]], deadline_s: float = 180,
             parallel: bool = False) -> dict[str, list]:
    """Run the jobs (`parallel`: all started at once, overlapping their start-up); per job, every process's
    RankResult. A process still running at its deadline is killed, after dumping its threads' stacks."""
    def begin(name: str) -> object:
        servers, workers, config = jobs[name]
        config = {"timeout": 30, "dump_after_s": deadline_s - 30, **config}
        return start_ps(servers, workers, "train", config, tmp_path / name, deadline_s)
    if parallel:
        started = {name: begin(name) for name in jobs}
        return {name: job.collect() for name, job in started.items()}
    return {name: begin(name).collect() for name in jobs}


def worker_results(tmp_path, name: str, ranks: list, workers: int) -> list[dict]:
    for r in ranks:
        assert r.returncode == 0, f"{name}: process {r.rank} exited with {r.returncode}:\n{r.output[-3000:]}"
    return [torch.load(tmp_path / name / f"worker{i}.pt", weights_only=False) for i in range(workers)]
