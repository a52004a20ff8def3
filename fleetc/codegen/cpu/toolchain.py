"""Builds generated C++ kernels into shared libraries with the system compiler, cached on disk, loaded with ctypes.

A library is named after a hash of its source, the compiler flags, the compiler's version and the CPU
(`-march=native` code is only valid on the machine that built it), and lives in `cpu/` of fleetc's kernel
cache beside its source. Kernels link against the OpenMP runtime this process already loaded (torch's
bundled libgomp), so their parallel regions share torch's thread pool instead of starting a second one.

Flags: `-ffp-contract=off`, so the compiler never fuses a multiply and an add on its own (kernels that
claim to match aten bit for bit write `__builtin_fmaf` where aten's build does fuse); `-fno-math-errno`
so `sqrtf` is one instruction; glibc's libmvec supplies a vectorized `logf` (exp, tanh and erf are inline, source.py).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess

from fleetc.codegen.cache import cache_root, temporary_path, write_atomic

COMPILE_FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-math-errno",
                 "-fno-trapping-math", "-fno-exceptions", "-fno-rtti", "-fPIC", "-shared", "-w")
COMPILE_TIMEOUT_S = 120


class BuildError(Exception):
    """The compiler is missing or rejected a generated kernel (the message carries its output)."""


def cache_dir() -> pathlib.Path:
    return cache_root() / "cpu"


@functools.lru_cache(maxsize=None)
def compiler() -> str | None:
    """The C++ compiler: $CXX, else g++ on PATH; None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


@functools.lru_cache(maxsize=None)
def _compiler_version() -> str:
    path = compiler()
    if path is None:
        return "none"
    return subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]


@functools.lru_cache(maxsize=None)
def _cpu_identity() -> str:
    """What `-march=native` depends on: the CPU model and its feature flags."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n" + "\n".join(wanted)


@functools.lru_cache(maxsize=None)
def openmp_runtime() -> str | None:
    """The path of the OpenMP runtime already mapped into this process (torch loads it with libtorch_cpu)."""
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps.splitlines()
                    if line.rstrip().endswith((".so.1", ".so")) and any(n in line for n in ("libgomp", "libiomp"))})
    return paths[0] if paths else None


def link_flags() -> list[str]:
    runtime = openmp_runtime()
    flags = [runtime, f"-Wl,-rpath,{os.path.dirname(runtime)}"] if runtime else []
    return flags + ["-lmvec", "-lm"]


def library_hash(source: str) -> str:
    key = "\n".join([source, *COMPILE_FLAGS, *link_flags(), _compiler_version(), _cpu_identity()])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def build(name: str, source: str) -> pathlib.Path:
    """The shared library of `source`: from the cache, or compiled now (BuildError on failure)."""
    path = cache_dir() / f"{name}_{library_hash(source)}.so"
    if path.exists():
        return path
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler: set $CXX or install g++")
    source_path = path.with_suffix(".cpp")
    write_atomic(source_path, source)
    scratch = temporary_path(path.parent, ".so.tmp")
    try:
        result = subprocess.run([cxx, *COMPILE_FLAGS, str(source_path), "-o", str(scratch), *link_flags()],
                                capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            raise BuildError(f"{cxx} failed on {source_path}:\n{result.stderr[-4000:]}")
        os.replace(scratch, path)  # atomic: other processes see the whole library or none
    finally:
        scratch.unlink(missing_ok=True)
    return path


def load_function(path: pathlib.Path, symbol: str) -> ctypes._CFuncPtr:
    """`symbol` of a kernel library, typed as `void f(void* const* data, const int64_t* meta,
    const double* scalars, int64_t nthreads)`, the one signature every generated kernel has."""
    function = getattr(ctypes.CDLL(str(path)), symbol)
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    function.restype = None
    return function
