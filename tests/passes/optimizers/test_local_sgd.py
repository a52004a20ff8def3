"""On 2 gloo ranks: local SGD and adaptive local SGD against a hand-written two-replica reference, and clipping,
LARS and a traced optimizer under data parallel against single-process training on the full batch."""
from __future__ import annotations

import math

import pytest
import torch
from helpers.clip import clip_grads_
from helpers.layerwise import Lars
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleet.optimizer_workers import grad_clip, optimizer_factory
from fleet.spawn import assert_all_ok, spawn
from fleet.workers import global_batches, shard

WORLD = 2
CONFIGS = {
    "localsgd": {"optimizer": "momentum", "steps": 6,
                 "strategy": {"localsgd": True, "localsgd_configs": {"k_steps": 2, "begin_step": 2}}},
    "adaptive": {"optimizer": "sgd", "steps": 7,
                 "strategy": {"adaptive_localsgd": True,
                              "adaptive_localsgd_configs": {"init_k_steps": 4, "begin_step": 1}}},
    # matmuls in float32: AMP's exact power-of-two loss scaling is then all that differs from float32 training
    "clip_amp_merge": {"optimizer": "momentum", "steps": 4, "grad_clip": ["global_norm", 0.1],
                       "strategy": {"amp": True, "amp_configs": {"custom_black_list": ["matmul"]},
                                    "gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}},
    "lars_clip": {"optimizer": "momentum", "steps": 2, "grad_clip": ["norm", 0.2],
                  "strategy": {"lars": True, "lars_configs": {"lars_coeff": 0.02, "lars_weight_decay": 0.01,
                                                              "exclude_from_weight_decay": ["bias"]}}},
    "traced": {"optimizer": "rmsprop", "steps": 2, "strategy": {}},
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    results = spawn(WORLD, "train_configs", {"configs": list(CONFIGS.values())}, tmp_path_factory.mktemp("ranks"),
                    deadline_s=180, module="fleet.optimizer_workers")
    assert_all_ok(results)
    return [dict(zip(CONFIGS, r.result)) for r in results]


def _replicas(config: dict, initial: dict) -> tuple[list, list]:
    """One model and optimizer per rank, from the same initial state."""
    models = [ZOO["mlp"].make_model() for _ in range(WORLD)]
    for model in models:
        model.load_state_dict(initial)
    return models, [optimizer_factory(config["optimizer"])(m.parameters()) for m in models]


def _average(models: list) -> None:
    with torch.no_grad():
        for params in zip(*(m.parameters() for m in models)):
            mean = sum(params) / WORLD
            for p in params:
                p.copy_(mean)


def local_sgd_reference(config: dict, initial: dict, adaptive: bool) -> tuple[list, list, int]:
    """Paddle's schedule written out: per-rank models and losses, and how many averages ran."""
    entry = ZOO["mlp"]
    cfg = config["strategy"]["adaptive_localsgd_configs" if adaptive else "localsgd_configs"]
    init_k = k = cfg["init_k_steps"] if adaptive else cfg["k_steps"]
    begin, last, averages = cfg["begin_step"], 0, 0
    models, opts = _replicas(config, initial)
    losses = [[] for _ in range(WORLD)]
    for step, batch in enumerate(global_batches("mlp", config["steps"]), start=1):
        step_losses = []
        for rank, (model, opt) in enumerate(zip(models, opts)):
            x, y = shard(batch, rank, WORLD)
            opt.zero_grad()
            loss = entry.loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses[rank].append(loss.detach())
            step_losses.append(loss.detach())
        mean_loss = sum(step_losses) / WORLD
        if adaptive and step == 1:
            loss_0, lr_0 = mean_loss, opts[0].param_groups[0]["lr"]
        if step <= begin or step - last == k:
            _average(models)
            last, averages = step, averages + 1
            if adaptive and step > begin:
                lr = opts[0].param_groups[0]["lr"]
                k = min(16, max(1, math.ceil(math.sqrt(lr_0 * float(mean_loss) / (lr * float(loss_0)) * init_k))))
    return models, losses, averages


@pytest.mark.slow
@pytest.mark.parametrize("name", ["localsgd", "adaptive"])
def test_local_sgd_matches_the_two_replica_reference(ranks, name):
    config, runs = CONFIGS[name], [r[name] for r in ranks]
    models, losses, averages = local_sgd_reference(config, runs[0]["initial"], adaptive=name == "adaptive")
    for rank, run in enumerate(runs):
        torch.testing.assert_close(torch.stack(run["losses"]), torch.stack(losses[rank]), rtol=1e-5, atol=1e-6)
        for key, want in models[rank].state_dict().items():
            torch.testing.assert_close(run["state"][key], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
        assert int(run["counters"]["local_sgd@averages"]) == averages
    stats = runs[0]["stats"]["adaptive_localsgd" if name == "adaptive" else "localsgd"]
    assert stats["collectives_per_average"] == (2 if name == "adaptive" else 1)  # + the loss, to adapt k
    assert runs[0]["collectives"] == (3 if name == "adaptive" else 1)  # the loss is averaged on step 1 too
    assert runs[0]["skipped"]["insert_allreduce"].startswith("local SGD")
    if name == "localsgd":  # steps 1, 2 (up to begin_step), then 4 and 6
        assert averages == 4 and torch.equal(runs[0]["state"]["fc1.weight"], runs[1]["state"]["fc1.weight"])
    else:  # step 1 (begin_step), step 5 (k = init_k_steps = 4), then k = ceil(sqrt(4 * ~1.0)) = 2: step 7
        assert averages == 3 and int(runs[0]["counters"]["local_sgd@k_steps"]) == 2


def full_batch_reference(config: dict, initial: dict) -> tuple[list, dict]:
    """Single-process training on the full batches, clipping (Paddle's rule) and updating every k_steps."""
    entry = ZOO["mlp"]
    model = ZOO["mlp"].make_model()
    model.load_state_dict(initial)
    strategy = config["strategy"]
    lars = strategy.get("lars_configs")
    opt = None if lars else optimizer_factory(config["optimizer"])(model.parameters())
    # the zoo's "momentum" SGD: lr 0.05, momentum 0.9, its own weight decay 1e-3 (dampening: not in LARS)
    reference = Lars(0.05, 0.9, lars["lars_coeff"], lars["lars_weight_decay"], 0.0,
                     tuple(lars["exclude_from_weight_decay"]), sgd_weight_decay=1e-3) if lars else None
    k = strategy.get("gradient_merge_configs", {}).get("k_steps", 1)
    clip = grad_clip(config)
    losses = []
    for step, batch in enumerate(global_batches("mlp", config["steps"]), start=1):
        loss = entry.loss_fn(model(batch[0]), batch[1])
        (loss / k).backward()
        losses.append(loss.detach())
        if step % k == 0:
            if clip is not None:
                clip_grads_(model.parameters(), clip)
            if reference is not None:
                params = dict(model.named_parameters())
                reference.step(params, {n: p.grad for n, p in params.items()})
            else:
                opt.step()
            model.zero_grad()
    return losses, model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["clip_amp_merge", "lars_clip", "traced"])
def test_data_parallel_compositions_match_full_batch_training(ranks, name):
    config, runs = CONFIGS[name], [r[name] for r in ranks]
    losses, state = full_batch_reference(config, runs[0]["initial"])
    mean_losses = [sum(run["losses"][i] for run in runs) / WORLD for i in range(config["steps"])]
    torch.testing.assert_close(torch.stack(mean_losses), torch.stack(losses), rtol=1e-5, atol=1e-6)
    for key, want in state.items():
        assert torch.equal(runs[0]["state"][key], runs[1]["state"][key]), key
        torch.testing.assert_close(runs[0]["state"][key], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    if "grad_clip" in config:
        assert runs[0]["stats"]["grad_clip"] == {"gradients_clipped": 6}


def test_local_sgd_in_one_process_says_why_it_does_nothing():
    entry = ZOO["mlp"]
    model = entry.make_model()
    strategy = fleetc.DistributedStrategy()
    strategy.localsgd = True
    trainer = fleetc.compile(model, strategy, optimizer=OPTIMIZERS["sgd"](model.parameters()), loss_fn=entry.loss_fn)
    trainer.step(*entry.make_batch(torch.Generator().manual_seed(1))[0])
    assert trainer.report().skipped["localsgd"] == "single process: nothing to average"
