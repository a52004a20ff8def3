"""A generated C++ kernel (name, function text, source hash) and the prelude every kernel's translation unit starts with.

The prelude declares what kernels use without any header (headers cost compile time): fixed-width
integers, the OpenMP thread queries, the libm functions the C dialect of fleetc/ops/pointwise.py calls
(declared `omp declare simd` so loops over them vectorize through glibc's libmvec), and bf16 ↔ fp32
conversion with torch's rounding (round to nearest even, NaN → 0x7FC0). Every kernel has the signature
`extern "C" void name(void* const* data, const int64_t* meta, const double* scalars, int64_t nthreads)`:
tensor pointers, sizes/strides/flags, float arguments, and the thread count (torch.get_num_threads()).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

PRELUDE = r'''// fleetc CPU kernel prelude
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef long int64_t;
extern "C" {
int omp_get_thread_num(void);
int omp_get_num_threads(void);
#pragma omp declare simd notinbranch
float expf(float) noexcept;
#pragma omp declare simd notinbranch
float logf(float) noexcept;
#pragma omp declare simd notinbranch
float erff(float) noexcept;
#pragma omp declare simd notinbranch
float tanhf(float) noexcept;
double pow(double, double) noexcept;
}
static inline float fc_from_bf16(uint16_t v) { return __builtin_bit_cast(float, (uint32_t)v << 16); }
static inline uint16_t fc_to_bf16(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  return f != f ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float fc_round_bf16(float f) { return fc_from_bf16(fc_to_bf16(f)); }
static inline int64_t fc_min(int64_t a, int64_t b) { return a < b ? a : b; }
'''

# Elements below which a kernel runs on one thread (aten's at::internal::GRAIN_SIZE).
GRAIN = 32768

# C type, load expression and store expression of each supported tensor dtype (values are float or bool).
C_TYPES = {"float32": "float", "bfloat16": "uint16_t", "bool": "uint8_t"}


def load(dtype: str, element: str) -> str:
    """The value of a tensor element as the kernel computes with it (fp32 for floats)."""
    return {"float32": element, "bfloat16": f"fc_from_bf16({element})", "bool": f"({element} != 0)"}[dtype]


def store(dtype: str, value: str) -> str:
    """A computed value converted to a tensor element of `dtype`."""
    return {"float32": f"(float)({value})", "bfloat16": f"fc_to_bf16({value})", "bool": f"(uint8_t)({value})"}[dtype]


def value_type(dtype: str) -> str:
    """The C type a value of `dtype` is computed in."""
    return "bool" if dtype == "bool" else "float"


def round_to(dtype: str, value: str) -> str:
    """`value` rounded as storing it in a `dtype` tensor and reading it back would (aten rounds every op's result)."""
    return f"fc_round_bf16({value})" if dtype == "bfloat16" else value


@dataclass(frozen=True)
class CppKernel:
    """One generated kernel: `name` is its exported function, `code` the function's text (after the prelude)."""

    name: str
    code: str

    @property
    def source(self) -> str:
        return PRELUDE + self.code

    @property
    def source_hash(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]


def signature(name: str) -> str:
    return (f'extern "C" void {name}(void* const* data, const int64_t* meta, const double* scalars, '
            f"int64_t nthreads)")
