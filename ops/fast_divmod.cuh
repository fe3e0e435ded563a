// Division by an invariant integer with one multiply-high, one add and one shift
// (Granlund & Montgomery 1994, fig. 4.1). The host (ops/fast_divmod.py,
// FastDivmod.as_struct()) fills the struct:
//
//     l = ceil(log2 d),  m = floor(2^32 * (2^l - d) / d) + 1
//
// and the device computes, for 0 <= n < 2^31 and 1 <= d <= 2^31,
//
//     q = (umulhi(m, n) + n) >> l,  r = n - q * d.
//
// The CPU tests (tests/test_ops.py) run exactly this arithmetic over every
// divisor 1..4096, powers of two and their neighbours, 2^31 - 1, and edge
// numerators. Numerators >= 2^31 are out of range (the 32-bit add could wrap):
// kernels whose flat indices may reach 2^31 must take a 64-bit path instead.
//
// FastDivmod::make(d) computes the same constants on the device, for divisors known only there (the
// transducer's per-utterance row strides).
//
// Include as "ops/fast_divmod.cuh" with -I<the folder holding the packages> (ops.cuda_include_dir()).
// Works under NVRTC (no standard headers needed) and nvcc.
#pragma once

#if defined(__CUDACC_RTC__)
typedef unsigned int uint32_t;
#else
#include <cstdint>
#endif

struct FastDivmod {
  uint32_t d;  // divisor
  uint32_t m;  // magic multiplier m'
  uint32_t l;  // shift, ceil(log2 d)

  // The constants for 1 <= d <= 2^31, on the device: m's quotient comes from a correctly rounded
  // double reciprocal, fixed by one exact integer remainder test (the estimate is within 1 of the
  // true quotient, which is < 2^32): no integer division.
  __device__ __forceinline__ static FastDivmod make(uint32_t d) {
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
    f.m = (uint32_t)(q + 1);
    return f;
  }

  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    return (__umulhi(m, n) + n) >> l;
  }
  __device__ __forceinline__ uint32_t mod(uint32_t n) const {
    return n - div(n) * d;
  }
  __device__ __forceinline__ void divmod(uint32_t n, uint32_t& q, uint32_t& r) const {
    q = div(n);
    r = n - q * d;
  }
  // int overloads for callers indexing with int (n must be >= 0)
  __device__ __forceinline__ int div(int n) const { return (int)div((uint32_t)n); }
  __device__ __forceinline__ int mod(int n) const { return (int)mod((uint32_t)n); }
  __device__ __forceinline__ void divmod(int n, int& q, int& r) const {
    uint32_t uq, ur;
    divmod((uint32_t)n, uq, ur);
    q = (int)uq;
    r = (int)ur;
  }
};
