"""The parameter-server ops a worker's Program runs (role collective): pulls before use, a push after backward.

They call the worker's Client (fleet.init_worker makes it); see passes/parameter_server for where they go.
"""
from __future__ import annotations

import torch

from fleetc.comm.ps.client import client
from fleetc.ir.registry import register_op


@register_op("ps_pull_dense", "copy the servers' current values of dense parameters into them (in place)")
def ps_pull_dense(params: list, names: list) -> None:
    client().pull_dense(params, names)


@register_op("ps_pull_sparse", "the rows of an embedding table for the batch's ids, fetched once per distinct id "
             "from the servers holding them (an embedding lookup without the table)")
def ps_pull_sparse(ids: torch.Tensor, table: str) -> torch.Tensor:
    return client().pull_rows(table, ids)


def _row_grads(ids: list, row_grads: list, tables: list, padding_idx: list
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each table's (ids, row gradients), its lookups' concatenated, without rows at padding_idx."""
    sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for table, index, grad, padding in zip(tables, ids, row_grads, padding_idx):
        index = index.reshape(-1)
        grad = grad.reshape(len(index), -1)
        if padding >= 0:  # as embedding_dense_backward: the padding row gets no gradient
            keep = index != padding
            index, grad = index[keep], grad[keep]
        if table in sparse:
            index, grad = torch.cat([sparse[table][0], index]), torch.cat([sparse[table][1], grad])
        sparse[table] = (index, grad)
    return sparse


@register_op("ps_push", "send the step's dense gradients and table row gradients (ids, rows) to the servers; "
             "returns when the servers let the worker go on (sync: when every worker pushed and the update ran); "
             "with merge_steps k > 1 (gradient merge) only every k-th step sends, the mean (merge_avg) or sum of the "
             "k steps' gradients")
def ps_push(lr: float, dense_grads: list, dense_names: list, ids: list, row_grads: list, tables: list,
            padding_idx: list, merge_steps: int = 1, merge_avg: bool = True) -> None:
    client().push(dict(zip(dense_names, dense_grads)), _row_grads(ids, row_grads, tables, padding_idx), lr,
                  merge_steps, merge_avg)


@register_op("ps_geo_update_rows", "geo: update the table rows this step's lookups trained, with the servers' lazy "
             "row rule and optimizer state kept on the worker (in place), instead of a dense table update")
def ps_geo_update_rows(lr: float, params: list, names: list, ids: list, row_grads: list, tables: list,
                       padding_idx: list) -> None:
    client().geo_update_rows(dict(zip(names, params)), _row_grads(ids, row_grads, tables, padding_idx), lr)


@register_op("ps_geo_note_rows", "geo: remember the table rows this batch trains locally (sent at the next sync)")
def ps_geo_note_rows(ids: torch.Tensor, table: str) -> None:
    client().geo_note_rows(table, ids)


@register_op("ps_geo_sync", "geo: every k_steps-th step, push the parameter deltas since the last sync to the "
             "servers and pull their values (in place)")
def ps_geo_sync(params: list, names: list) -> None:
    client().geo_step(dict(zip(names, params)))
