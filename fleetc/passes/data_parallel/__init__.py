"""Data-parallel passes: gradients averaged across ranks with bucketed, overlapped allreduces.

- `allreduce`: an averaging allreduce after each gradient's last producer.
- `bucketing`: `fuse_all_reduce_ops`, one flat buffer and one collective per bucket.
- `views`: gradient producers write straight into their bucket's buffer.
- `overlap`: each wait moves to just before its first consumer (`sync_nccl_allreduce=False`).
- `merged`: under gradient merge, the accumulators are allreduced once per k steps.
- `sync_batch_norm`: batch-norm statistics over every rank's samples.
- `common`: names and helpers the allreduce passes share.
"""
from fleetc.passes.data_parallel.allreduce import InsertAllreduce
from fleetc.passes.data_parallel.bucketing import FuseAllreduce
from fleetc.passes.data_parallel.overlap import OverlapAllreduce
from fleetc.passes.data_parallel.sync_batch_norm import SyncBatchNorm
from fleetc.passes.data_parallel.views import AllreduceViews

__all__ = ["AllreduceViews", "FuseAllreduce", "InsertAllreduce", "OverlapAllreduce", "SyncBatchNorm"]
