"""Factories that `tests/test_cli.py` hands to `fleetc dump-ir` as `cli_factories:<name>`."""
from __future__ import annotations

import torch
from zoo import ZOO

import fleetc


def _mlp_step() -> dict:
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    args, _ = entry.make_batch(torch.Generator().manual_seed(1))
    return {"model": entry.make_model(), "args": args, "loss_fn": entry.loss_fn}


def mlp() -> dict:
    """The zoo MLP with cross-entropy; no optimizer, so dump-ir supplies SGD."""
    return _mlp_step()


def gpt() -> dict:
    """The zoo GPT (LayerNorm, GELU, dropout, tied embeddings) with AdamW: the HTML report's showcase."""
    entry = ZOO["gpt"]
    torch.manual_seed(0)
    args, _ = entry.make_batch(torch.Generator().manual_seed(1))
    model = entry.make_model()
    return {"model": model, "args": args, "loss_fn": entry.loss_fn,
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}


def mlp_with_strategy() -> dict:
    """Carries its own strategy (amp on), which `--strategy FILE` must override."""
    strategy = fleetc.DistributedStrategy()
    strategy.amp = True
    return {**_mlp_step(), "strategy": strategy}


def unsupported_optimizer() -> dict:
    """Compiling fails with a FleetcError (UnsupportedOptimizerError)."""
    spec = _mlp_step()
    return {**spec, "optimizer": torch.optim.LBFGS(spec["model"].parameters())}


def misspelt_key() -> dict:
    spec = _mlp_step()
    return {**spec, "optimiser": torch.optim.SGD(spec["model"].parameters(), lr=0.1)}


def returns_list() -> list:
    return [_mlp_step()]


def missing_args() -> dict:
    return {"model": _mlp_step()["model"]}


not_callable = 42


def needs_arguments(width: int) -> dict:
    return _mlp_step()


def optimizer_as_a_string() -> dict:
    return {**_mlp_step(), "optimizer": "sgd"}


def raises() -> dict:
    raise RuntimeError("the factory itself failed")


def gpt_sharded() -> dict:
    """The zoo's GPT with AdamW under sharding stage 2 (sharding degree: the whole world)."""
    strategy = fleetc.DistributedStrategy()
    strategy.sharding = True
    strategy.sharding_configs = {"stage": 2}
    return {**gpt(), "strategy": strategy}


def mlp_pipeline() -> dict:
    """The zoo MLP under pipeline with no device_guard: hybrid_configs.pp_degree=2 cuts it automatically."""
    strategy = fleetc.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"micro_batch_size": 4, "accumulate_steps": 4, "schedule_mode": "ZBH1"}
    strategy.hybrid_configs = {"pp_degree": 2}
    return {**_mlp_step(), "strategy": strategy}


def mlp_adam() -> dict:
    """The zoo MLP with Adam (optimizer state to shard) and no strategy: `fleetc shard-plan --strategy` sets one."""
    spec = _mlp_step()
    return {**spec, "optimizer": torch.optim.Adam(spec["model"].parameters(), lr=1e-3)}
