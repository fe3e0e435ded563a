// Element types, conversions and math shared by every kernel of ops, ragged and transducer.
//
// Compiled at run time by NVRTC (cupy.RawModule, through ops.cuda.launch) with -std=c++17 and
// -I<the folder holding the packages>, so that kernels include "ops/numeric.cuh"; no standard
// headers: half and bfloat16 travel as 16-bit payloads and are converted with PTX cvt (or, for
// bf16 before sm_80, in integer arithmetic), so neither cuda_fp16.h nor cuda_bf16.h is needed.
#pragma once

namespace ops {

// 16-bit floating-point storage types (bit patterns of IEEE half / bfloat16).
struct half_t {
  unsigned short bits;
};
struct bf16_t {
  unsigned short bits;
};

// Accumulation type: double for double, float for everything else (ops.accumulate_dtype on the host).
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

// float -> bf16 bits, round to nearest even, in integer arithmetic: what cvt.rn.bf16.f32 does on
// sm_80 and later (NaN stays a quiet NaN of its sign; overflow rounds to infinity). The CPU tests
// check the same arithmetic against torch's rounding (tests/test_ops.py).
__device__ __forceinline__ unsigned short bf16_bits_rn(float x) {
  const unsigned int u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

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
template <>
__device__ __forceinline__ bf16_t from_acc<bf16_t>(float x) {
  bf16_t h;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(OPS_SOFTWARE_BF16)
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#else
  h.bits = bf16_bits_rn(x);
#endif
  return h;
}

// *p loaded through the read-only data path (ld.global.nc), for any T of 1, 2, 4, 8, 16 or 32 bytes (a scalar,
// a 16-bit float, a Vec; 32 bytes: two loads, 16-byte aligned): what a `const T* __restrict__` kernel
// parameter gives the compiler leave to do, for data that arrives in a parameter struct, where it cannot see
// that nothing else writes it. Only for memory that no thread writes while the kernel runs.
template <int BYTES>
struct Word;  // the type __ldg loads for BYTES bytes
template <>
struct Word<1> { typedef unsigned char type; };
template <>
struct Word<2> { typedef unsigned short type; };
template <>
struct Word<4> { typedef unsigned int type; };
template <>
struct Word<8> { typedef unsigned long long type; };
template <>
struct Word<16> { typedef uint4 type; };

template <typename T>
__device__ __forceinline__ T ldg(const T* p) {
  if constexpr (sizeof(T) == 32) {  // two 16-byte loads (8 floats beside 8 halves: the pack passes' vectors)
    union {
      uint4 w[2];
      T x;
    } u;
    const uint4* q = reinterpret_cast<const uint4*>(p);
    u.w[0] = __ldg(q);
    u.w[1] = __ldg(q + 1);
    return u.x;
  } else {
    typedef typename Word<sizeof(T)>::type W;
    union {
      W w;
      T x;
    } u;
    u.w = __ldg(reinterpret_cast<const W*>(p));
    return u.x;
  }
}

// An array a kernel only reads, loaded through ldg.
template <typename T>
struct ReadOnly {
  const T* p;
  __device__ __forceinline__ T operator[](long long i) const { return ldg(p + i); }
};

// N consecutive elements moved as one access (16 bytes at most; ops.cuda.vector_width picks N).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename A>
__device__ __forceinline__ A neg_inf();
template <>
__device__ __forceinline__ float neg_inf<float>() {
  return __int_as_float(0xff800000);
}
template <>
__device__ __forceinline__ double neg_inf<double>() {
  return __longlong_as_double(0xfff0000000000000ULL);
}

template <typename A>
__device__ __forceinline__ A quiet_nan();
template <>
__device__ __forceinline__ float quiet_nan<float>() {
  return __int_as_float(0x7fc00000);
}
template <>
__device__ __forceinline__ double quiet_nan<double>() {
  return __longlong_as_double(0x7ff8000000000000ULL);
}

template <typename A>
__device__ __forceinline__ bool is_finite(A x) {
  return x - x == A(0);  // false for +-inf and NaN
}

// The larger of a and b, NaN if either is NaN (fmax would drop the NaN).
template <typename A>
__device__ __forceinline__ A nan_max(A a, A b) {
  return (b > a || b != b) ? b : a;
}

// Accurate exp / log.
__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

// exp on per-element hot paths: ex2.approx.ftz (one FMUL + MUFU) for float, whose relative error stays
// near 1e-6 for the arguments seen there (|x| < ~30), and results below 2^-126 flushed to zero (__expf's
// ex2.approx without .ftz spends four more instructions an element keeping them: PTX ISA, ex2); the
// accurate exp for double.
__device__ __forceinline__ float exp_fast(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
  return r;
}
__device__ __forceinline__ double exp_fast(double x) { return exp(x); }

// log on such paths (a recursion's logsumexp of a sum in [1, N]): __logf for float (CUDA C++ Programming
// Guide, intrinsic functions: absolute error 2^-21.41 on [0.5, 2], 3 ulp elsewhere), the accurate log for
// double.
__device__ __forceinline__ float log_fast(float x) { return __logf(x); }
__device__ __forceinline__ double log_fast(double x) { return log(x); }

// The two exps as types, for templates that take one (ops/reduce.cuh).
struct AccurateExp {
  template <typename A>
  __device__ __forceinline__ A operator()(A x) const {
    return exp_acc(x);
  }
};
struct FastExp {
  template <typename A>
  __device__ __forceinline__ A operator()(A x) const {
    return exp_fast(x);
  }
};

// log(exp(a) + exp(b)); -inf with -inf gives -inf, and a NaN operand gives NaN (a NaN log-probability
// must reach the loss): comparisons with NaN are false, so a NaN lands in `lo` when the other operand
// is -inf, in `hi` otherwise. Float uses the fast intrinsics (absolute error ~1e-6 per step, on the
// critical path of recursions such as the transducer's alpha and beta; exp_fast's flush of results below
// 2^-126 changes no sum with 1), double the accurate functions.
__device__ __forceinline__ float log1p_exp(float x) { return __logf(1.0f + exp_fast(x)); }
__device__ __forceinline__ double log1p_exp(double x) { return log1p(exp(x)); }

template <typename A>
__device__ __forceinline__ A log_add(A a, A b) {
  const A hi = a > b ? a : b;
  const A lo = a > b ? b : a;
  if (hi == neg_inf<A>()) return lo;  // -inf, or NaN
  return hi + log1p_exp(lo - hi);
}

}  // namespace ops
