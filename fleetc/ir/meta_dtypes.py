"""Output dtypes where torch's meta (fake) kernels disagree with its real kernels, corrected for the Programs fleetc
writes.

A batch norm of a low-precision input with float32 weight and running statistics (AMP's mixed rule,
passes/precision/amp.py) writes its saved and running statistics in float32 on CPU and CUDA, while the meta kernels
give them the input's dtype. Whatever infers or checks output dtypes on fake tensors (the AMP pass, the verifier)
corrects its results here, so the Program declares what really runs.
"""
from __future__ import annotations

from typing import Any

import torch

_BATCH_NORM_FORWARD = frozenset(("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                                 "_native_batch_norm_legit_no_training"))


def real_results(op_type: str, args: tuple, results: list) -> list:
    """`results` of `op_type` computed on the fake `args`, in the dtypes the real kernels give (call it under the
    fake mode that made them)."""
    if not op_type.startswith("aten.") or op_type.split(".")[1] not in _BATCH_NORM_FORWARD:
        return results
    x, params = args[0], [a for a in args[1:5] if isinstance(a, torch.Tensor)]
    if not isinstance(x, torch.Tensor) or x.dtype == torch.float32 or not params or any(
            p.dtype != torch.float32 for p in params):
        return results
    return results[:1] + [_float32(r) for r in results[1:]]


def _float32(value: Any) -> Any:
    return value.to(torch.float32) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
