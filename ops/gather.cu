// gather / batch gather, one thread per output element (launched by ops/gather_cuda.py).
//
// params  (B, O, G, Kv)   indices (B, I)   out (B, O, I, Kv)
// out[b, o, i, k] = params[b, o, local, k],  local = wrap(indices[b, i]) - offset,
// and 0 where local is outside [0, G) (sharded gather / unchecked indices).
//
// The element type is chosen by the launcher from the *row* width K * itemsize:
// a gather only moves bytes, so a row of K elements is copied as Kv words of W
// bytes (W = 16 when K * itemsize % 16 == 0 and both pointers are 16-byte
// aligned: one 128-bit load/store per thread; else 8, 4, 2, 1).
//
// Coordinates: the flat output index n is split with FastDivmod
//   (b, rest) = divmod(n, O*I*Kv); (o, rest) = divmod(rest, I*Kv); (i, k) = divmod(rest, Kv)
// which is exact for n < 2^31; launches with more outputs than that use the
// *_big kernels (64-bit division, grid-stride loop).
#include "fast_divmod.cuh"

struct alignas(16) Word16 { unsigned long long a, b; };

template <typename W, typename Idx>
__device__ __forceinline__ void gather_one(const W* __restrict__ params, const Idx* __restrict__ indices,
                                           W* __restrict__ out, long long b, long long o, long long i,
                                           long long k, long long n, long long O, long long I,
                                           long long G, long long Kv, long long wrap,
                                           long long offset) {
  long long idx = (long long)indices[b * I + i];
  if (idx < 0) idx += wrap;
  idx -= offset;
  W v;
  if (idx >= 0 && idx < G) {
    v = params[((b * O + o) * G + idx) * Kv + k];
  } else {
    v = W{};
  }
  out[n] = v;
}

template <typename W, typename Idx>
__device__ __forceinline__ void gather_small(const W* __restrict__ params,
                                             const Idx* __restrict__ indices, W* __restrict__ out,
                                             FastDivmod div_oik, FastDivmod div_ik, FastDivmod div_k,
                                             int O, int I, long long G, unsigned int total,
                                             long long wrap, long long offset) {
  unsigned int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= total) return;
  unsigned int b, rest, o, i, k;
  div_oik.divmod(n, b, rest);
  div_ik.divmod(rest, o, rest);
  div_k.divmod(rest, i, k);
  gather_one<W, Idx>(params, indices, out, b, o, i, k, n, O, I, G, (long long)div_k.d, wrap, offset);
}

template <typename W, typename Idx>
__device__ __forceinline__ void gather_big(const W* __restrict__ params,
                                           const Idx* __restrict__ indices, W* __restrict__ out,
                                           long long O, long long I, long long G, long long Kv,
                                           long long total, long long wrap, long long offset) {
  long long stride = (long long)gridDim.x * blockDim.x;
  for (long long n = (long long)blockIdx.x * blockDim.x + threadIdx.x; n < total; n += stride) {
    long long ik = I * Kv;
    long long b = n / (O * ik);
    long long rest = n - b * (O * ik);
    long long o = rest / ik;
    rest -= o * ik;
    long long i = rest / Kv;
    long long k = rest - i * Kv;
    gather_one<W, Idx>(params, indices, out, b, o, i, k, n, O, I, G, Kv, wrap, offset);
  }
}

#define DEFINE_GATHER(SUFFIX, W, IDX)                                                              \
  extern "C" __global__ void gather_##SUFFIX(const W* params, const IDX* indices, W* out,          \
                                             FastDivmod div_oik, FastDivmod div_ik,                \
                                             FastDivmod div_k, int O, int I, long long G,          \
                                             unsigned int total, long long wrap,                   \
                                             long long offset) {                                   \
    gather_small<W, IDX>(params, indices, out, div_oik, div_ik, div_k, O, I, G, total, wrap,       \
                         offset);                                                                  \
  }                                                                                                \
  extern "C" __global__ void gather_big_##SUFFIX(const W* params, const IDX* indices, W* out,      \
                                                 long long O, long long I, long long G,            \
                                                 long long Kv, long long total, long long wrap,    \
                                                 long long offset) {                               \
    gather_big<W, IDX>(params, indices, out, O, I, G, Kv, total, wrap, offset);                    \
  }

DEFINE_GATHER(w1_i32, unsigned char, int)
DEFINE_GATHER(w1_i64, unsigned char, long long)
DEFINE_GATHER(w2_i32, unsigned short, int)
DEFINE_GATHER(w2_i64, unsigned short, long long)
DEFINE_GATHER(w4_i32, unsigned int, int)
DEFINE_GATHER(w4_i64, unsigned int, long long)
DEFINE_GATHER(w8_i32, unsigned long long, int)
DEFINE_GATHER(w8_i64, unsigned long long, long long)
DEFINE_GATHER(w16_i32, Word16, int)
DEFINE_GATHER(w16_i64, Word16, long long)
