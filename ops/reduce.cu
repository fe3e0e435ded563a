// sum / max / logsumexp over one axis of x seen as (outer, R, inner); launched by ops/reduce_cuda.py
// by name expression, e.g. "reduce_rows<ops::kLogSumExp, ops::half_t>".
//
// T: ops::half_t, ops::bf16_t, float or double, read and accumulated as A = ops::AccOf<T>::type
// (float, or double for double), which is also the output type. The states, their merges and
// torch's logsumexp convention (an all -inf slice gives -inf, a +inf gives +inf, NaN propagates)
// are ops/reduce.cuh's; this file only lays the work out:
//
//   reduce_rows      inner == 1 (last axis). tpr threads per row: 32 (one warp per row, 8 rows per
//                    256-thread block) or blockDim.x (one block per long row). "Virtual rows"
//                    v = row * splits + part let several blocks share one very long row.
//   reduce_mid       inner > 1, the highest axis (outer == 1) included: the layout of Paddle's
//                    ReduceHigherDimKernel (paddle/phi/kernels/funcs/reduce_function.h). Block
//                    (bx, by): bx consecutive inner columns (coalesced reads) x by slices of R,
//                    merged by a tree over y; blockIdx.x -> (o, tile) by FastDivmod, blockIdx.y =
//                    the part of R when R is split across blocks.
//   reduce_finalize  merges the `splits` partial states of each output.
//
// With splits > 1 the kernels write partial states (m into `out`, s into `ws_s`, each laid out as
// (splits, outputs)) and reduce_finalize merges them; with splits == 1 they write the result.
#include "ops/fast_divmod.cuh"
#include "ops/reduce.cuh"

template <int OP, typename A>
__device__ __forceinline__ void store_state(ops::ReduceState<A> st, A* out, A* ws_s, long long pos, int splits) {
  if (splits == 1) {
    out[pos] = ops::finish<OP, A>(st);
  } else {
    out[pos] = st.m;
    if (OP == ops::kLogSumExp) ws_s[pos] = st.s;
  }
}

// The kernels' parameters (ops/reduce_cuda.py mirrors them): x, the output (or the partial states' m) and the
// partial states' s; the sizes; the parts of R (splits, chunk elements each).
template <typename T>
struct ReduceParams {
  const T* x;
  typename ops::AccOf<T>::type* out;
  typename ops::AccOf<T>::type* ws_s;
  long long outer;  // reduce_rows: the rows
  long long R;
  long long inner;
  int tpr;               // reduce_rows: threads per row
  FastDivmod div_tiles;  // reduce_mid: blocks per (o, tile)
  int splits;
  long long chunk;
};

template <typename A>
struct FinalizeParams {
  const A* ws_m;
  const A* ws_s;
  A* out;
  long long n;
  int splits;
};

template <int OP, typename T>
__global__ void reduce_rows(const ReduceParams<T> p) {
  typedef typename ops::AccOf<T>::type A;
  const T* __restrict__ x = p.x;
  const long long rows = p.outer, R = p.R, chunk = p.chunk;
  const int tpr = p.tpr, splits = p.splits;
  __shared__ ops::ReduceState<A> smem[32];
  const int rows_per_block = blockDim.x / tpr;
  const long long v = (long long)blockIdx.x * rows_per_block + threadIdx.x / tpr;
  const int lane = threadIdx.x % tpr;
  const bool active = v < rows * splits;
  const long long row = active ? v / splits : 0;
  const long long part = active ? v - row * splits : 0;
  ops::ReduceState<A> st = ops::identity<OP, A>();
  if (active) {
    const long long start = part * chunk;
    const long long end = min(R, start + chunk);
    const T* xr = x + row * R;
    for (long long j = start + lane; j < end; j += tpr) ops::push<OP, A>(st, ops::to_acc(xr[j]));
  }
  if (tpr > 32) {  // one row per block (tpr == blockDim.x, the same in every thread)
    st = ops::block_merge<OP, A>(st, smem);
    if (threadIdx.x != 0) return;
  } else {
    st = ops::warp_merge<OP, A>(st);
    if (lane != 0) return;
  }
  if (active) store_state<OP, A>(st, p.out, p.ws_s, part * rows + row, splits);
}

// Dynamic shared memory: bx * by states.
template <int OP, typename T>
__global__ void reduce_mid(const ReduceParams<T> p) {
  typedef typename ops::AccOf<T>::type A;
  const T* __restrict__ x = p.x;
  const long long outer = p.outer, R = p.R, inner = p.inner, chunk = p.chunk;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ops::ReduceState<A>* smem = reinterpret_cast<ops::ReduceState<A>*>(smem_raw);
  unsigned int o, tile;
  p.div_tiles.divmod((unsigned int)blockIdx.x, o, tile);
  const int bx = blockDim.x, by = blockDim.y;
  const long long col = (long long)tile * bx + threadIdx.x;
  const int part = blockIdx.y;
  const long long start = (long long)part * chunk;
  const long long end = min(R, start + chunk);
  ops::ReduceState<A> st = ops::identity<OP, A>();
  if (col < inner) {
    const T* xo = x + (long long)o * R * inner + col;
    for (long long r = start + threadIdx.y; r < end; r += by) ops::push<OP, A>(st, ops::to_acc(xo[r * inner]));
  }
  smem[threadIdx.y * bx + threadIdx.x] = st;
  __syncthreads();
  for (int h = by >> 1; h > 0; h >>= 1) {  // by is a power of two
    if ((int)threadIdx.y < h) {
      st = ops::merge<OP, A>(st, smem[(threadIdx.y + h) * bx + threadIdx.x]);
      smem[threadIdx.y * bx + threadIdx.x] = st;
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && col < inner) {
    const long long n_out = outer * inner;
    store_state<OP, A>(st, p.out, p.ws_s, (long long)part * n_out + (long long)o * inner + col, p.splits);
  }
}

// A: float or double. ws_m, ws_s: (splits, n) partial states; out: (n,).
template <int OP, typename A>
__global__ void reduce_finalize(const FinalizeParams<A> p) {
  const A* __restrict__ ws_m = p.ws_m;
  const A* __restrict__ ws_s = p.ws_s;
  A* __restrict__ out = p.out;
  const long long n = p.n;
  const int splits = p.splits;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
    ops::ReduceState<A> st = ops::identity<OP, A>();
    for (int p = 0; p < splits; ++p) {
      ops::ReduceState<A> q;
      q.m = ws_m[(long long)p * n + j];
      q.s = OP == ops::kLogSumExp ? ws_s[(long long)p * n + j] : A(0);
      st = ops::merge<OP, A>(st, q);
    }
    out[j] = ops::finish<OP, A>(st);
  }
}
