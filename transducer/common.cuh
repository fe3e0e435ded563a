// Shared device helpers of the transducer kernels (stages.cu, pack.cu).
//
// Compiled at run time by cupy.RawModule (NVRTC) with -std=c++17 -I<ops dir>
// -I<transducer dir>, and by nvcc in the syntax check; no standard headers:
// half and bfloat16 are carried as 16-bit payloads and converted with PTX cvt,
// so neither cuda_fp16.h nor cuda_bf16.h is needed.
#pragma once

#include "fast_divmod.cuh"

namespace td {

// 16-bit floating-point storage types (bit patterns of IEEE half / bfloat16).
struct half_t {
  unsigned short bits;
};
struct bf16_t {
  unsigned short bits;
};

// Accumulation type: double for double, float for everything else.
template <typename T>
struct AccOf {
  typedef float type;
};
template <>
struct AccOf<double> {
  typedef double type;
};

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(half_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_acc(bf16_t x) { return __uint_as_float(((unsigned int)x.bits) << 16); }

template <typename T>
__device__ __forceinline__ T from_acc(typename AccOf<T>::type x);
template <>
__device__ __forceinline__ float from_acc<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ double from_acc<double>(double x) {
  return x;
}
template <>
__device__ __forceinline__ half_t from_acc<half_t>(float x) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
  return h;
}
// cvt.rn.bf16.f32 needs sm_80; before that, the same round-to-nearest-even in integer arithmetic
// (NaN stays a quiet NaN of the same sign; infinities and overflow to them as cvt does).
__device__ __forceinline__ unsigned short bf16_bits_rn(float x) {
  const unsigned int u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <>
__device__ __forceinline__ bf16_t from_acc<bf16_t>(float x) {
  bf16_t h;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(TD_SOFTWARE_BF16)
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#else
  h.bits = bf16_bits_rn(x);
#endif
  return h;
}

// N consecutive elements moved as one access (16 bytes at most).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename Acc>
__device__ __forceinline__ Acc neg_inf();
template <>
__device__ __forceinline__ float neg_inf<float>() {
  return __int_as_float(0xff800000);
}
template <>
__device__ __forceinline__ double neg_inf<double>() {
  return __longlong_as_double(0xfff0000000000000ULL);
}

template <typename Acc>
__device__ __forceinline__ Acc quiet_nan();
template <>
__device__ __forceinline__ float quiet_nan<float>() {
  return __int_as_float(0x7fc00000);
}
template <>
__device__ __forceinline__ double quiet_nan<double>() {
  return __longlong_as_double(0x7ff8000000000000ULL);
}

// Accurate exp / log1p (recursions, per-row coefficients).
__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }
__device__ __forceinline__ float log1p_acc(float x) { return log1pf(x); }
__device__ __forceinline__ double log1p_acc(double x) { return log1p(x); }

// exp on the per-element hot paths: ex2.approx (one FMUL + MUFU) for float,
// whose relative error stays near 1e-6 for the arguments seen here
// (|x| < ~30); the accurate exp for double.
__device__ __forceinline__ float exp_fast(float x) { return __expf(x); }
__device__ __forceinline__ double exp_fast(double x) { return exp(x); }

// log(exp(a) + exp(b)) with -inf + -inf -> -inf. Float uses the
// fast intrinsics (absolute error ~1e-6 per step, on the critical path of the
// alpha/beta recursions); double the accurate functions.
__device__ __forceinline__ float log1p_exp(float x) { return __logf(1.0f + __expf(x)); }
__device__ __forceinline__ double log1p_exp(double x) { return log1p(exp(x)); }

// A NaN operand gives NaN (a NaN log-probability must reach the loss): comparisons with NaN are
// false, so a NaN lands in `lo` when the other operand is -inf, in `hi` otherwise.
template <typename Acc>
__device__ __forceinline__ Acc log_add(Acc a, Acc b) {
  Acc hi = a > b ? a : b;
  Acc lo = a > b ? b : a;
  if (hi == neg_inf<Acc>()) return lo;  // -inf, or NaN
  return hi + log1p_exp(lo - hi);
}

template <typename Acc>
__device__ __forceinline__ bool is_finite(Acc x) {
  return x - x == Acc(0);  // false for +-inf and NaN
}

// FastDivmod of a divisor known only on the device (a per-utterance row
// stride): l = ceil(log2 d), m = floor(2^32 (2^l - d) / d) + 1 exactly as
// ops/fast_divmod.py, with the quotient taken from a correctly rounded double
// reciprocal and fixed by one exact integer remainder test (the double
// estimate is within 1 of the true quotient, which is < 2^32): no integer
// division. Valid for 1 <= d <= 2^31.
__device__ __forceinline__ FastDivmod fast_divmod_for(unsigned int d) {
  FastDivmod f;
  f.d = d;
  f.l = 32 - __clz(d - 1);  // __clz(0) == 32: l = 0 for d == 1
  const long long num = (long long)(((1ull << f.l) - d) << 32);  // < 2^63
  long long q = (long long)((double)num * __drcp_rn((double)d));
  const long long rem = num - q * (long long)d;
  if (rem < 0)
    --q;
  else if (rem >= (long long)d)
    ++q;
  f.m = (unsigned int)(q + 1);
  return f;
}

// Online logsumexp state merge: (m1, s1) <- (m1, s1) (+) (m2, s2), where the
// pair stands for m + log(s). m == -inf means "empty" (s == 0).
template <typename Acc>
__device__ __forceinline__ void lse_merge(Acc& m1, Acc& s1, Acc m2, Acc s2) {
  Acc m = m1 > m2 ? m1 : m2;
  if (m == neg_inf<Acc>()) return;
  s1 = s1 * exp_fast(m1 - m) + s2 * exp_fast(m2 - m);
  m1 = m;
}

// The Layout table (transducer/layout.py): [T_b (B) | U_b (B) | row_strides (B) | row_splits (B + 1) | stats].
struct Grids {
  const long long* __restrict__ table;
  int B;
  __device__ __forceinline__ long long T(int b) const { return table[b]; }
  __device__ __forceinline__ long long U(int b) const { return table[B + b]; }
  __device__ __forceinline__ long long stride(int b) const { return table[2 * B + b]; }
  __device__ __forceinline__ long long split(int b) const { return table[3 * B + b]; }  // b in [0, B]
  // The utterance of row r (0 <= r < split(B)): the last b with split(b) <= r. A binary search over
  // B + 1 cached entries stands in for a per-row index array: no launch and no N-sized buffer for it.
  __device__ __forceinline__ int utterance_of(long long r) const {
    int lo = 0, hi = B - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (split(mid) <= r)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }
  // (b, t, u) of row r: b by utterance_of, t and u by a FastDivmod of b's stride (clamped to >= 1).
  __device__ __forceinline__ void coordinates(int r, int& b, int& t, int& u) const {
    b = utterance_of(r);
    const long long st = stride(b);
    fast_divmod_for(st < 1 ? 1u : (unsigned int)st).divmod(r - (int)split(b), t, u);
  }
};

template <typename Acc>
__device__ __forceinline__ Acc shfl_xor(Acc x, int mask) {
  return __shfl_xor_sync(0xffffffffu, x, mask);
}

}  // namespace td
