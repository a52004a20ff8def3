"""Program data structures: clone is a deep, independent copy."""
from __future__ import annotations

import copy

import torch
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.ir.program import Ref


def test_clone_equals_a_deep_copy_and_shares_nothing_mutable():
    entry = ZOO["gpt"]
    torch.manual_seed(0)
    model = entry.make_model()
    strategy = fleetc.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2}
    trainer = fleetc.compile(model, strategy, optimizer=OPTIMIZERS["adam"](model.parameters()), loss_fn=entry.loss_fn)
    args, kwargs = entry.make_batch(torch.Generator().manual_seed(0))
    trainer.step(*args, **kwargs)
    original = trainer.program
    before = str(original)
    clone = original.clone()
    assert clone == copy.deepcopy(original) and str(clone) == before
    for block in clone.blocks:  # mutate every container the clone holds
        for op in block.ops:
            op.attrs["module_path"] = "changed"
            op.outputs.append("extra")
            op.args = tuple(list(a) + [Ref("x")] if isinstance(a, list) else a for a in op.args)
            for value in op.args:
                if isinstance(value, list):
                    value.append(0)
        for var in block.vars.values():
            var.dtype = "float64"
    clone.metadata["kind"] = "changed"
    clone.fetches.clear()
    assert str(original) == before
