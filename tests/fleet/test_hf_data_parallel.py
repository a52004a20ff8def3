"""Data parallel on 2 gloo processes for real architectures (BERT, GPT-2, ViT from `transformers`): each rank trains on
half of every global batch, and the result equals single-process eager training on the whole batch."""
from __future__ import annotations

import pytest
import torch

from fleet.hf_workers import build, sgd
from fleet.spawn import assert_all_ok, spawn

NAMES = ["bert", "gpt2", "vit"]


def eager_training(name: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    case, model, batches = build(name)
    optimizer = sgd(model.parameters())
    losses = []
    for args, kwargs in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = case.loss_fn(model(*args[:-1], **kwargs), args[-1])
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses, model.state_dict()


@pytest.mark.slow
def test_two_ranks_train_real_architectures_like_one_process(tmp_path):
    results = spawn(2, "train_hf", {"names": NAMES}, tmp_path, deadline_s=300, module="fleet.hf_workers")
    assert_all_ok(results)
    for name in NAMES:
        runs = [r.result[name] for r in results]
        assert runs[0]["collectives"] >= 1, f"{name}: no allreduce in the Program"
        want_losses, want_state = eager_training(name)
        for step, want in enumerate(want_losses):
            got = sum(run["losses"][step] for run in runs) / len(runs)  # equal shards: the mean of the halves
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, where=f"{name} step {step}": f"{where}: {m}")
        for key, want in want_state.items():
            for run in runs:
                torch.testing.assert_close(run["state"][key], want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, where=f"{name} {key}": f"{where}: {m}")
