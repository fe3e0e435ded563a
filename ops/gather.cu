// gather / batch gather, one thread per output word; launched by ops/gather_cuda.py by name
// expression, e.g. "gather_kernel<16, long long>".
//
// params  (B, O, G, Kv)   indices (B, I)   out (B, O, I, Kv)
// out[b, o, i, k] = params[b, o, local, k],  local = wrap(indices[b, i]) - offset,
// and 0 where local is outside [0, G): a shard of params split along the gathered axis gives zeros
// for the indices of the other shards, so that the shards' results sum to the full gather, and
// unchecked out-of-range indices give zeros too. Both the offset and the word width below follow
// OneFlow's gather (oneflow/user/kernels/gather_kernel_util.cu: GatherForwardGpu's `offset`, the
// kernel of its gather split along the gathered axis, and DispatchMovementSize's 16/8/4/2/1-byte
// movement types).
//
// A gather only moves bytes: the launcher picks the word width W (template argument, bytes) from
// the row of K elements, and a row is copied as Kv = K * itemsize / W words (W = 16 when the row's
// bytes and both base addresses allow it: one 128-bit load and store per thread; else 8, 4, 2, 1).
//
// Coordinates, as in ONNX Runtime's Gather (onnxruntime/core/providers/cuda/tensor/gather_impl.cu):
// the flat output index n is split with FastDivmod (ops/fast_divmod.cuh),
//   (b, rest) = divmod(n, O*I*Kv); (o, rest) = divmod(rest, I*Kv); (i, k) = divmod(rest, Kv),
// exact for n < 2^31; launches with more outputs take gather_big_kernel (64-bit division,
// grid-stride loop).
#include "ops/fast_divmod.cuh"
#include "ops/numeric.cuh"

template <int W>
struct Word;
template <>
struct Word<1> {
  typedef unsigned char type;
};
template <>
struct Word<2> {
  typedef unsigned short type;
};
template <>
struct Word<4> {
  typedef unsigned int type;
};
template <>
struct Word<8> {
  typedef unsigned long long type;
};
template <>
struct Word<16> {
  typedef ops::Vec<unsigned long long, 2> type;
};

// The parameters of both kernels (ops/gather_cuda.py: GATHER_PARAMS): the output's (O, I, Kv) divisors for
// gather_kernel, and the sizes for both.
template <typename V, typename Idx>
struct GatherParams {
  const V* params;
  const Idx* indices;
  V* out;
  FastDivmod div_oik;  // O * I * Kv
  FastDivmod div_ik;   // I * Kv
  FastDivmod div_k;    // Kv
  long long O;
  long long I;
  long long G;
  long long Kv;
  long long total;
  long long wrap;
  long long offset;
};

template <typename V, typename Idx>
__device__ __forceinline__ void gather_one(const GatherParams<V, Idx>& p, long long b, long long o, long long i,
                                           long long k, long long n) {
  long long idx = (long long)p.indices[b * p.I + i];
  if (idx < 0) idx += p.wrap;
  idx -= p.offset;
  p.out[n] = idx >= 0 && idx < p.G ? p.params[((b * p.O + o) * p.G + idx) * p.Kv + k] : V{};
}

// total < 2^31 outputs (words).
template <int W, typename Idx>
__global__ void gather_kernel(const GatherParams<typename Word<W>::type, Idx> p) {
  const unsigned int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= (unsigned int)p.total) return;
  unsigned int b, rest, o, i, k;
  p.div_oik.divmod(n, b, rest);
  p.div_ik.divmod(rest, o, rest);
  p.div_k.divmod(rest, i, k);
  gather_one(p, b, o, i, k, n);
}

template <int W, typename Idx>
__global__ void gather_big_kernel(const GatherParams<typename Word<W>::type, Idx> p) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long ik = p.I * p.Kv;
  for (long long n = (long long)blockIdx.x * blockDim.x + threadIdx.x; n < p.total; n += stride) {
    const long long b = n / (p.O * ik);
    long long rest = n - b * (p.O * ik);
    const long long o = rest / ik;
    rest -= o * ik;
    const long long i = rest / p.Kv;
    gather_one(p, b, o, i, rest - i * p.Kv, n);
  }
}
