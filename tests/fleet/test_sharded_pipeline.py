"""Sharding × pipeline on 4 gloo processes (pp=2 × sharding=2): each stage's optimizer update is sharded over its
sharding group (ZeRO stage 1: owners update, parameters all-gathered; stage 2: the gradient average is a
reduce-scatter). Every rank matches eager PyTorch accumulating over the same micro-batches of every replica; each
rank holds optimizer state only for the parameters it owns. GPT ties its embeddings across the two stages: the
tied gradient's sum over stages and the sharded update compose."""
from __future__ import annotations

import os

import pytest
import torch
from helpers.pipeline import STAGED, fleet_reference
from zoo import ZOO

from fleet.spawn import spawn
from fleetc.comm.mesh import ProcessMesh
from fleetc.passes.data_parallel.common import START
from fleetc.passes.sharding.optimizer_sharding import GATHER, RS_START

pytestmark = pytest.mark.slow  # CI still runs them

STEPS, MICROBATCHES, STAGES, SHARDS = 2, 2, 2, 2
# (zoo model, sharding stage, global-norm clip, gradient merge k_steps): ClipGradByGlobalNorm's norm sums over the
# sharding group (stage 2 keeps only owned gradients) and over the stages; gradient merge runs the sharded update
# every k_steps steps
CASES = [("gpt", 2, None, 1)] + ([("gpt", 1, None, 1), ("cnn", 1, None, 1), ("cnn", 2, None, 1),
                                  ("gpt", 2, 0.05, 1), ("gpt", 2, None, 2)] if os.environ.get("FLEETC_FULL") else [])


@pytest.mark.parametrize("zoo_name, stage, clip_norm, k_steps", CASES)
def test_sharded_stages_of_a_pipeline_match_eager(zoo_name, stage, clip_norm, k_steps, tmp_path):
    args = {"model": zoo_name, "mode": "1F1B", "microbatches": MICROBATCHES, "steps": STEPS * k_steps,
            "stages": STAGES, "batch": 4, "sharding_stage": stage, "clip_norm": clip_norm, "k_steps": k_steps,
            "evaluate": zoo_name == "gpt"}  # GPT: no BatchNorm statistics, which each replica keeps its own of
    results = spawn(STAGES * SHARDS, "fleet_train", args, tmp_path, deadline_s=300, module="fleet.pipeline_workers")
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
    mesh = ProcessMesh(pp=STAGES, sharding=SHARDS)
    losses, params = fleet_reference(zoo_name, STAGES, SHARDS * MICROBATCHES, STEPS * k_steps, k_steps,
                                     clip_norm)
    if args["evaluate"]:  # evaluation on every rank sees every stage's current, whole parameters
        make, _ = STAGED[zoo_name]
        reference = make(STAGES)
        reference.load_state_dict({**reference.state_dict(), **params})
        g = torch.Generator().manual_seed(1)
        batches = [ZOO[zoo_name].make_batch(g)[0] for _ in range(STEPS * k_steps)]
        with torch.no_grad():
            expected = reference.eval()(batches[-1][0])
        for r in results:
            torch.testing.assert_close(r.result["evaluated"], expected)
    owners: dict[tuple[int, str], list[int]] = {}
    for r in results:
        assert r.result["executor"] == "DistributedPipeline" and r.result["mesh"] == str(mesh)
        pipeline = [results[q] for q in mesh.group_of("pp", r.rank)]
        assert all(p.result["losses"] == r.result["losses"] for p in pipeline)  # one loss per pipeline
        for name, value in r.result["params"].items():  # whole and current on every rank of the stage
            torch.testing.assert_close(value, params[name],
                                       msg=lambda m, name=name, rank=r.rank: f"rank {rank} {name}: {m}")
        sharding = r.result["sharding"]
        assert sharding.get("checkpoint", "written").startswith("checkpoints of a sharded pipeline (strategy.sharding with")
        ops = sharding["optimizer_ops"]
        assert ops.count(GATHER) >= 1 and (RS_START in ops) == (stage == 2) and (START in ops) == (stage == 1)
        owned = set(sharding["owned"]) & set(r.result["params"])
        assert set(sharding["state"]) == owned  # optimizer state for the owned parameters (or pieces) only
        if stage == 2:  # flat buckets: each rank's state holds only its pieces, some of them cut
            assert sharding["state_pieces"] >= 1 and sharding["state_elements"] < sum(
                r.result["params"][name].numel() for name in owned) * 2
        for name in owned:
            owners.setdefault((mesh.coordinates(r.rank)["pp"], name), []).append(r.rank)
    for s in range(STAGES):  # each stage's parameters: one owner in its sharding group (stage 2: pieces, maybe two)
        stage_params = set(results[mesh.rank(pp=s)].result["params"])
        assert {name for (t, name) in owners if t == s} == stage_params
        assert all(len(ranks) == 1 for (t, _), ranks in owners.items() if t == s) or stage == 2
    assert {r for ranks in owners.values() for r in ranks} == set(range(STAGES * SHARDS))  # everyone owns some
    if zoo_name == "gpt":
        assert all("tok.weight" in r.result["params"] for r in results)  # tied: both stages hold it
    replica_losses = torch.tensor([results[mesh.rank(sharding=i)].result["losses"] for i in range(SHARDS)])
    torch.testing.assert_close(replica_losses.mean(0), torch.tensor(losses, dtype=replica_losses.dtype))
