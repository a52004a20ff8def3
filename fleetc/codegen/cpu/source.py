"""A generated C++ kernel (name, function text, source hash) and the prelude every kernel's translation unit starts with.

The prelude declares what kernels use without any header (headers cost compile time): fixed-width
integers, the OpenMP thread queries, the libm function the C dialect of fleetc/ops/pointwise.py calls (logf,
declared `omp declare simd` so loops over it vectorize through glibc's libmvec), bf16 ↔ fp32
conversion with torch's rounding (round to nearest even, NaN → 0x7FC0), and inline `fc_exp` / `fc_tanh` / `fc_erf`.
Every kernel has the signature
`extern "C" void name(void* const* data, const int64_t* meta, const double* scalars, int64_t nthreads)`:
tensor pointers, sizes/strides/flags, float arguments, and the thread count (torch.get_num_threads()).

`fc_exp` and `fc_tanh` replace libm's expf/tanhf: written branch-free in the kernel, gcc vectorizes them inline
with the loop around them (libmvec's are calls through the PLT, and leave scalar `expf` calls in loop tails).
Their error, measured against float64 on every 97th fp32 bit pattern in range (tests/codegen/test_cpu_exp.py
checks every 251st against these bounds): fc_exp at most 8.4e-8 relative (1.01 ulp; torch.exp 0.57 ulp) over
normal results, within one unit of 2^-149 on denormal results, and exactly 0, inf, NaN where exp is; fc_tanh at
most 1.4e-7 relative. `fc_erf` (the same way, for GELU): GELU through it is within 2.6e-7 of max(|gelu x|, 1)
of float64 (aten's vectorized erf: 1.1e-6), and 1.2e-7 relative near 0.
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
float logf(float) noexcept;
double pow(double, double) noexcept;
}
static inline float fc_from_bf16(uint16_t v) { return __builtin_bit_cast(float, (uint32_t)v << 16); }
static inline uint16_t fc_to_bf16(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  return f != f ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float fc_round_bf16(float f) { return fc_from_bf16(fc_to_bf16(f)); }
// exp(x) = 2^n * exp(r) with n = rint(x / ln 2) and |r| <= ln 2 / 2 (Cephes expf's split of ln 2 and polynomial,
// in fma form). Branch-free, so loops over it vectorize without a libmvec call; 2^n is applied in two halves so
// results down to the smallest denormal round once. Clamping to [-104, 88.8] keeps n in range: exp overflows to
// inf above ~88.72 and underflows to 0 below ~-103.97 as expf does; NaN passes through.
static inline float fc_exp(float x) {
  float c = x < 88.8f ? x : 88.8f;
  c = c > -104.0f ? c : -104.0f;
  const float n = __builtin_rintf(c * 1.44269504088896341f);
  const float r = __builtin_fmaf(n, 2.12194440e-4f, __builtin_fmaf(n, -0.693359375f, c));
  float p = 1.9875691500e-4f;
  p = __builtin_fmaf(p, r, 1.3981999507e-3f);
  p = __builtin_fmaf(p, r, 8.3334519073e-3f);
  p = __builtin_fmaf(p, r, 4.1665795894e-2f);
  p = __builtin_fmaf(p, r, 1.6666665459e-1f);
  p = __builtin_fmaf(p, r, 5.0000001201e-1f);
  p = __builtin_fmaf(p * r, r, r) + 1.0f;
  const int k = (int)n, k1 = k >> 1, k2 = k - k1;
  const float y = p * __builtin_bit_cast(float, (uint32_t)(k1 + 127) << 23)
                    * __builtin_bit_cast(float, (uint32_t)(k2 + 127) << 23);
  return x != x ? x : y;
}
// tanh: Cephes tanhf's odd polynomial for |x| < 0.625 (no cancellation near 0), else 1 - 2 / (exp(2|x|) + 1)
// with x's sign; both are computed and one selected, so loops over it vectorize.
static inline float fc_tanh(float x) {
  const float a = __builtin_fabsf(x), z = x * x;
  float p = -5.70498872745e-3f;
  p = __builtin_fmaf(p, z, 2.06390887954e-2f);
  p = __builtin_fmaf(p, z, -5.37397155531e-2f);
  p = __builtin_fmaf(p, z, 1.33314422036e-1f);
  p = __builtin_fmaf(p, z, -3.33332819422e-1f);
  const float small = __builtin_copysignf(__builtin_fmaf(p * z, x, x), x);  // tanh(-0) = -0
  const float large = __builtin_copysignf(1.0f - 2.0f / (fc_exp(2.0f * a) + 1.0f), x);
  return a < 0.625f ? small : (x != x ? x : large);
}
// erf: x times Cephes erff's odd polynomial in x^2 for |x| < 1 (relative accuracy near 0), else Abramowitz and
// Stegun 7.1.26, 1 - t * poly(t) * exp(-x^2) with t = 1 / (1 + 0.3275911 |x|), as aten's vectorized erf computes it;
// both are computed and one selected, so loops over it vectorize. erf(+-inf) = +-1, NaN passes through.
static inline float fc_erf(float x) {
  const float a = __builtin_fabsf(x), z = x * x;
  float p = 7.853861353153693e-5f;
  p = __builtin_fmaf(p, z, -8.010193625184903e-4f);
  p = __builtin_fmaf(p, z, 5.188327685732524e-3f);
  p = __builtin_fmaf(p, z, -2.685381193529856e-2f);
  p = __builtin_fmaf(p, z, 1.128358514861418e-1f);
  p = __builtin_fmaf(p, z, -3.761262582423300e-1f);
  p = __builtin_fmaf(p, z, 1.128379165726710f);
  const float small = x * p;
  const float t = 1.0f / __builtin_fmaf(0.3275911f, a, 1.0f);
  float r = 1.061405429f;
  r = __builtin_fmaf(r, t, -1.453152027f);
  r = __builtin_fmaf(r, t, 1.421413741f);
  r = __builtin_fmaf(r, t, -0.284496736f);
  r = __builtin_fmaf(r, t, 0.254829592f);
  const float large = __builtin_copysignf(1.0f - r * t * fc_exp(-z), x);
  return a < 1.0f ? small : (x != x ? x : large);
}
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
