"""Pipeline test helpers: the zoo's GPT and CNN cut into device_guard stages, and the pipelined run beside eager
PyTorch accumulating over the same micro-batches."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from zoo import OPTIMIZERS, ZOO, SmallCNN, TinyGPT

import fleetc
from fleetc.capture import capture_train_program
from fleetc.ir.program import Program
from fleetc.ir.verifier import verify
from fleetc.passes.pipeline_parallel.partition import partition
from fleetc.passes.pipeline_parallel.schedule import build_schedule
from fleetc.runtime.pipeline_local import LocalPipeline
from fleetc.strategy import resolve_conflicts, resolve_strategy


def _stage(segment: int, segments: int, stages: int) -> str:
    return f"stage:{segment * stages // segments}"


class StagedGPT(TinyGPT):
    """TinyGPT (tied embeddings, dropout off) in four segments, spread over `stages` stages."""

    def __init__(self, stages: int):
        super().__init__(dropout=0.0)
        self.stages = stages

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with fleetc.device_guard(_stage(0, 4, self.stages)):
            positions = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.tok(idx) + self.pos(positions))
        for i, layer in enumerate(self.layers):
            with fleetc.device_guard(_stage(1 + i, 4, self.stages)):
                x = layer(x)
        with fleetc.device_guard(_stage(3, 4, self.stages)):
            return self.lm_head(self.ln_f(x))


class StagedCNN(SmallCNN):
    """SmallCNN (BatchNorm, residual blocks) in four segments, spread over `stages` stages."""

    def __init__(self, stages: int):
        super().__init__()
        self.stages = stages

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fleetc.device_guard(_stage(0, 4, self.stages)):
            h = F.relu(self.bn(self.stem(x)))
        for i, block in enumerate(self.blocks):
            with fleetc.device_guard(_stage(1 + i, 4, self.stages)):
                h = block(h)
        with fleetc.device_guard(_stage(3, 4, self.stages)):
            return self.head(h.mean(dim=(2, 3)))


class TwoStageMLP(nn.Module):
    """Linear + tanh on stage 0, Linear on stage 1 (3 classes). `make_overflow()` sets two rows of stage 1's weight
    huge: the gradient stage 1 sends back to stage 0 overflows once loss-scaled, while stage 1's own parameter
    gradients stay finite, so only stage 0 sees an inf."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fleetc.device_guard("stage:0"):
            h = torch.tanh(self.a(x))
        with fleetc.device_guard("stage:1"):
            return self.b(h)

    @torch.no_grad()
    def make_overflow(self) -> None:
        self.b.weight[0].fill_(1e36)     # rows that differ: softmax's gradient sums to 0 over the classes
        self.b.weight[1].fill_(-1e36)


SCALING_STATE = ("loss_scaling", "num_good_steps", "num_bad_steps")  # AMP's loss-scaling counters


def staged_gpt_program(optimizer: type[torch.optim.Optimizer], stages: int = 2,
                       **strategy_fields) -> tuple[Program, object]:
    """The GPT's training Program in `stages` device_guard stages on its first sample, captured with `optimizer`,
    and the resolved config of a pipeline strategy (1 × 2 micro-batches) with `strategy_fields` also set."""
    strategy = fleetc.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"micro_batch_size": 1, "accumulate_steps": 2}
    for key, value in strategy_fields.items():
        setattr(strategy, key, value)
    config, _ = resolve_conflicts(resolve_strategy(strategy))
    torch.manual_seed(0)
    model = StagedGPT(stages)
    batch, _ = ZOO["gpt"].make_batch(torch.Generator().manual_seed(0))
    program = capture_train_program(model, ZOO["gpt"].loss_fn, optimizer(model.parameters(), lr=0.1),
                                    tuple(a[:1] for a in batch), {})
    return program, config


def amp_pipeline_strategy(args: dict, pipeline: bool = True) -> fleetc.DistributedStrategy:
    """bf16 AMP with `args["amp"]` settings; with `pipeline`, `args["microbatches"]` micro-batches of
    `args["batch"]` samples on the device_guard stages (`args["mode"]`); without, the reference: gradient merge
    over the same micro-batches, averaged as the pipeline's micro-batch gradients are."""
    strategy = fleetc.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"dtype": "bfloat16", **args.get("amp", {})}
    m = args["microbatches"]
    if pipeline:
        strategy.pipeline = True
        strategy.pipeline_configs = {"micro_batch_size": args["batch"] // m, "accumulate_steps": m,
                                     "schedule_mode": args.get("mode", "1F1B")}
    else:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": m, "avg": True}
    return strategy


STAGED = {"gpt": (StagedGPT, "adam"), "cnn": (StagedCNN, "momentum")}


def pipelined(zoo_name: str, mode: str, ranks: int, microbatches: int, vpp: int = 1):
    """(model, LocalPipeline, eager copy, eager optimizer) for a zoo model cut into ranks·vpp stages."""
    make, optimizer_name = STAGED[zoo_name]
    torch.manual_seed(0)
    model = make(ranks * vpp)
    reference = copy.deepcopy(model)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    reference_optimizer = OPTIMIZERS[optimizer_name](reference.parameters())
    args, _ = ZOO[zoo_name].make_batch(torch.Generator().manual_seed(0))
    micro = tuple(a.chunk(microbatches)[0] for a in args)
    program = capture_train_program(model, ZOO[zoo_name].loss_fn, optimizer, micro, {})
    plan = partition(program, microbatches)
    for stage in plan.stages:
        for phase in stage.phases.values():
            verify(phase, after_pass="pipeline partition")
    pipe = LocalPipeline(program, plan, build_schedule(mode, ranks, microbatches, vpp), model, optimizer)
    return model, pipe, reference, reference_optimizer


def eager_accumulating_step(model, optimizer, loss_fn, args: tuple, microbatches: int, *, update: bool = True,
                            divide: int = 1, clip_norm: float | None = None) -> float:
    """The reference: the gradients of the mean micro-batch loss (each micro-batch on its own, so BatchNorm sees each
    micro-batch's statistics), accumulated into p.grad; with `update`, they are divided by `divide` (gradient merge's
    avg over its k steps), clipped to the global norm `clip_norm` (Paddle's ClipGradByGlobalNorm) and applied."""
    total = 0.0
    for micro in zip(*(a.chunk(microbatches) for a in args)):
        loss = loss_fn(model(micro[0]), micro[1]) / microbatches
        loss.backward()
        total += loss.item()
    if update:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for grad in grads:
            grad.div_(divide)
        if clip_norm is not None:
            norm = torch.stack([grad.norm() for grad in grads]).norm()
            for grad in grads:
                grad.mul_(clip_norm / torch.clamp_min(norm, clip_norm))
        optimizer.step()
        optimizer.zero_grad()
    return total


def fleet_reference(zoo_name: str, stages: int, microbatches: int, steps: int, k_steps: int = 1,
                    clip_norm: float | None = None) -> tuple[list[float], dict]:
    """Eager PyTorch on one process for `steps` steps of the zoo's batches (generator seed 1), from the weights of
    seed 0: per step, the gradient of the mean loss over the global batch's micro-batches (every replica's: the
    replicas' average gradient is the gradient of that mean); one update every k_steps steps on their average,
    clipped to the global norm `clip_norm`. Returns the losses and the final parameters."""
    losses, model, _ = eager_reference_run(zoo_name, stages, microbatches, steps, k_steps, clip_norm)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def eager_reference_run(zoo_name: str, stages: int, microbatches: int, steps: int, k_steps: int = 1,
                        clip_norm: float | None = None) -> tuple[list[float], nn.Module, torch.optim.Optimizer]:
    """`fleet_reference`'s run, returning its losses, model and optimizer (whose state a resumed run's is checked
    against)."""
    make, optimizer_name = STAGED[zoo_name]
    torch.manual_seed(0)
    model = make(stages)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        batch, _ = ZOO[zoo_name].make_batch(g)
        losses.append(eager_accumulating_step(model, optimizer, ZOO[zoo_name].loss_fn, batch, microbatches,
                                              update=(step + 1) % k_steps == 0, divide=k_steps, clip_norm=clip_norm))
    return losses, model, optimizer
