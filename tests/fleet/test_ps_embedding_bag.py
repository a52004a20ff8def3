"""nn.EmbeddingBag tables in parameter-server mode: the bag reduces the rows pulled for the batch's ids, and its
backward gives the row gradients pushed (the 2 servers x 2 workers run is in test_parameter_server.py's sync jobs,
model "bag"); options the rewrite does not support are refused by name."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fleet.ps_jobs import ps_program
from fleet.ps_workers import BagCTR
from fleetc.errors import PassError
from fleetc.fleet.ps_trainer import embedding_tables
from fleetc.ir.verifier import verify
from fleetc.passes.parameter_server import ParameterServerRewrite


def test_bag_weights_are_tables():
    assert embedding_tables(BagCTR(rows=50)) == {"bag.weight", "embedding.weight"}


def test_bag_reduces_the_pulled_rows_and_pushes_their_gradients():
    rewritten, report = ParameterServerRewrite().run(ps_program(BagCTR(rows=50), "sync"), None)
    verify(rewritten, after_pass="parameter_server")
    ops = {op.type: op for op in rewritten.global_block.ops}
    bag, backward, push = (ops["aten._embedding_bag.default"], ops["aten._embedding_bag_backward.default"],
                           ops["fleetc.ps_push"])
    pulls = [op for op in rewritten.global_block.ops if op.type == "fleetc.ps_pull_sparse"]
    assert [op.args[1] for op in pulls] == ["bag.weight", "embedding.weight"]
    rows, local = bag.args[0].name, bag.args[1].name
    assert pulls[0].outputs == [rows] and rewritten.var(rows).shape == (32, 16)  # 8 samples x 4 ids, not 50 rows
    assert ops["aten.arange.default"].outputs == [local] and backward.args[1].name == local and backward.args[6] == 32
    assert push.args[5] == ["embedding.weight", "bag.weight"] and push.args[4][1].name == backward.outputs[0]
    assert push.args[3][1] == pulls[0].args[0]  # the row gradients go back with the ids they were pulled for
    assert not {"bag.weight@GRAD", "embedding.weight@GRAD"} & set(rewritten.global_block.vars)
    assert report.stats["sparse_pulls"] == 2 and report.stats["sparse_grads_pushed"] == 2


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_on_pulled_rows_equals_the_bag_on_the_table(mode):
    """What the rewritten ops compute, run eagerly: outputs and row gradients (scattered back) equal the lookup in
    the whole table and its dense gradient."""
    torch.manual_seed(0)
    table = torch.randn(50, 4, requires_grad=True)
    ids = torch.tensor([3, 7, 3, 49, 0, 7])
    offsets = torch.tensor([0, 2, 5])
    expected = F.embedding_bag(ids, table, offsets, mode=mode)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    rows = table.detach()[ids].requires_grad_()
    out = F.embedding_bag(torch.arange(len(ids)), rows, offsets, mode=mode)
    out.backward(grad)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.zeros(50, 4).index_add_(0, ids, rows.grad), table.grad)


class _Bag(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 16, **options)
        self.fc = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weights = torch.ones(ids.shape, dtype=torch.float32)
        per_sample = weights if self.bag.mode == "sum" and getattr(self, "weighted", False) else None
        return self.fc(self.bag(ids, per_sample_weights=per_sample)).squeeze(1)


@pytest.mark.parametrize("option", ["padding_idx", "per_sample_weights", "scale_grad_by_freq"])
def test_unsupported_bag_options_are_refused_by_name(option):
    model = _Bag(mode="sum", **({"padding_idx": 0} if option == "padding_idx" else
                                {"scale_grad_by_freq": True} if option == "scale_grad_by_freq" else {}))
    model.weighted = option == "per_sample_weights"
    with pytest.raises(PassError, match=rf"EmbeddingBag 'bag.weight' uses {option}, which parameter-server tables "
                                        "do not support yet"):
        ParameterServerRewrite().run(ps_program(model, "sync"), None)
