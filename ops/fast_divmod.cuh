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
// Include with -I<ops dir> (see ops.cuda_include_dir()). Works under NVRTC
// (no standard headers needed) and nvcc.
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

// Free-function spellings, for C-style callers.
__device__ __forceinline__ uint32_t fast_div(const FastDivmod& f, uint32_t n) { return f.div(n); }
__device__ __forceinline__ uint32_t fast_mod(const FastDivmod& f, uint32_t n) { return f.mod(n); }
__device__ __forceinline__ void fast_divmod(const FastDivmod& f, uint32_t n, uint32_t& q, uint32_t& r) {
  f.divmod(n, q, r);
}
