"""Builds, caches and launches the Triton kernel of a `fleetc.fused_elementwise` op.

Kernel sources are written once to `$FLEETC_CACHE_DIR/triton/<name>_<source hash>.py` (default
`~/.cache/fleetc`), since `@triton.jit` needs a real file, and Triton compiles them into
`<cache>/triton/bin`, keyed by source, shapes (constexpr sizes and strides), dtypes and device. In
memory, a launcher is kept per (op, input shapes, strides, dtypes, device), so a training step pays
one dict lookup per fused op. `TRITON_INTERPRET=1` (read when a kernel module is first loaded) runs
the same kernels on CPU tensors, which is how the tests check them without a GPU.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fleetc.codegen.cache import cache_root, write_atomic
from fleetc.codegen.triton.kernel import KernelSource, generate_kernel
from fleetc.ops.fused_elementwise import reference

POINTWISE_MAX_BLOCK = 1024
REDUCTION_TILE = 4096  # elements per (BLOCK_M × BLOCK_N) tile
REDUCTION_MAX_BLOCK_N = 512


def cache_dir() -> pathlib.Path:
    """Where generated Triton kernels live: `triton/` in the kernel cache ($FLEETC_CACHE_DIR, else ~/.cache/fleetc)."""
    return cache_root() / "triton"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_sizes(kernel: KernelSource, shape: tuple[int, ...]) -> dict[str, int]:
    """The block-size heuristic: one power-of-two block covering small tensors, capped for large ones."""
    numel = 1
    for d in shape:
        numel *= d
    if kernel.reduce_dims is None:
        return {"NUMEL": numel, "BLOCK": min(POINTWISE_MAX_BLOCK, max(16, next_pow2(numel)))}
    n = 1
    for d in kernel.reduce_dims:
        n *= shape[d]
    m = numel // n if n else 0
    block_n = min(REDUCTION_MAX_BLOCK_N, max(16, next_pow2(n)))
    block_m = min(max(1, REDUCTION_TILE // block_n), max(2, next_pow2(m)))
    return {"M": m, "N": n, "BLOCK_M": block_m, "BLOCK_N": block_n}


_MODULES: dict[tuple[str, bool], Any] = {}


def load_kernel(kernel: KernelSource) -> Any:
    """The @triton.jit function of a kernel source, written to (or found in) the on-disk cache."""
    key = (kernel.source_hash, interpreting())
    if key in _MODULES:
        return _MODULES[key]
    path = cache_dir() / f"{kernel.name}_{kernel.source_hash}.py"
    if not path.exists() or path.read_text() != kernel.source:
        write_atomic(path, kernel.source)
    module_name = f"fleetc_kernel_{kernel.name}_{kernel.source_hash}_{'interp' if key[1] else 'jit'}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    _MODULES[key] = getattr(module, kernel.name)
    return _MODULES[key]


def launch(fn: Any, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
    """Launch a @triton.jit kernel; a launch that compiles writes its binary to fleetc's cache, not the user's."""
    if interpreting():
        fn[grid](*args, **constexprs)
        return
    import triton

    with triton.knobs.cache.scope():
        triton.knobs.cache.dir = str(cache_dir() / "bin")
        fn[grid](*args, **constexprs)


@dataclass
class Launcher:
    """A kernel bound to one input signature: allocates outputs and launches with fixed constexprs."""

    fn: Any
    grid: tuple[int]
    constexprs: dict[str, Any]
    outputs: list[tuple[tuple[int, ...], torch.dtype]]
    compiled: bool = False

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        device = inputs[0].device
        outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.outputs]
        if self.compiled:
            self.fn[self.grid](*inputs, *outs, **self.constexprs)
        else:
            launch(self.fn, self.grid, *inputs, *outs, **self.constexprs)
            self.compiled = not interpreting()
        return outs[0] if len(outs) == 1 else tuple(outs)


def kernel_for(name: str, steps: tuple, results: tuple, inputs: tuple[torch.Tensor, ...]) -> KernelSource:
    """The source generated for a fused op called on tensors like `inputs`."""
    rank = len(torch.broadcast_shapes(*(t.shape for t in inputs)))
    dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in inputs)
    return generate_kernel(name, steps, results, dtypes, rank)


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a launch needs besides the tensors: kernel source, grid, constexpr arguments, output specs."""

    kernel: KernelSource
    grid: tuple[int]
    constexprs: dict[str, Any]
    outputs: list[tuple[tuple[int, ...], torch.dtype]]


def launch_spec(name: str, steps: tuple, results: tuple, inputs: tuple[torch.Tensor, ...]) -> LaunchSpec:
    """The kernel and its arguments for inputs of these shapes, strides and dtypes (meta tensors will do)."""
    shape = tuple(torch.broadcast_shapes(*(t.shape for t in inputs)))
    kernel = kernel_for(name, steps, results, inputs)
    metas = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in inputs]
    produced = reference(*metas, steps=steps, results=results)
    produced = produced if isinstance(produced, tuple) else (produced,)
    constexprs: dict[str, Any] = {f"S{d}": size for d, size in enumerate(shape)}
    for k, t in enumerate(inputs):
        strides = t.expand(shape).stride()
        constexprs.update({f"IN{k}_T{d}": strides[d] for d in range(len(shape))})
        constexprs[f"IN{k}_CONTIG"] = tuple(t.shape) == shape and t.is_contiguous()
    sizes = block_sizes(kernel, shape)
    constexprs.update(sizes)
    if kernel.reduce_dims is None:
        grid = (-(-sizes["NUMEL"] // sizes["BLOCK"]),)
    else:
        grid = (max(1, -(-sizes["M"] // sizes["BLOCK_M"])),)
    return LaunchSpec(kernel, grid, constexprs, [(tuple(p.shape), p.dtype) for p in produced])


def build_launcher(name: str, steps: tuple, results: tuple, inputs: tuple[torch.Tensor, ...]) -> Launcher:
    """Generate, load and bind the kernel for inputs of these shapes, strides, dtypes and device."""
    spec = launch_spec(name, steps, results, inputs)
    return Launcher(load_kernel(spec.kernel), spec.grid, spec.constexprs, spec.outputs)


_LAUNCHERS: dict[tuple, Callable] = {}


def run_fused_elementwise(*inputs: torch.Tensor, steps: tuple, results: tuple, name: str) -> Any:
    """Run a fused op's Triton kernel on `inputs` (CUDA tensors, or any tensors under TRITON_INTERPRET=1)."""
    key = (name, steps, results, interpreting(),
           *((tuple(t.shape), t.stride(), t.dtype, t.device) for t in inputs))
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        launcher = _LAUNCHERS[key] = build_launcher(name, steps, results, inputs)
    return launcher(inputs)
