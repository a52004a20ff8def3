"""AMP test helpers: strategies, a compiled zoo trainer, and a batch that overflows every gradient."""
from __future__ import annotations

import torch
from zoo import OPTIMIZERS, ZOO

import fleetc


def amp_strategy(**configs) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    strategy.amp = True
    if configs:
        strategy.amp_configs = configs
    return strategy


def amp_trainer(zoo_name: str = "mlp", optimizer: str = "sgd", **configs):
    entry = ZOO[zoo_name]
    torch.manual_seed(0)
    model = entry.make_model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    return fleetc.compile(model, amp_strategy(**configs), optimizer=opt, loss_fn=entry.loss_fn, verify=True), entry


def pure_strategy(**configs) -> fleetc.DistributedStrategy:
    """Pure low precision for the whole model (use_fp16_guard=False: the zoo models have no fp16_guard regions)."""
    return amp_strategy(use_pure_fp16=True, **{"use_fp16_guard": False, **configs})


def pure_trainer(zoo_name: str = "mlp", optimizer: str = "adam", **configs):
    return amp_trainer(zoo_name, optimizer, use_pure_fp16=True, **{"use_fp16_guard": False, **configs})


def poisoned(args: tuple) -> tuple:
    """The batch with one inf input value: every gradient of the step becomes inf or nan."""
    x = args[0].clone()
    x.view(-1)[0] = float("inf")
    return (x, *args[1:])
