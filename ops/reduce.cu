// sum / max / logsumexp over one axis of x seen as (outer, R, inner); launched by
// ops/reduce_cuda.py. Inputs float16 / bfloat16 (raw 16-bit words, converted to
// float32), float32, float64; accumulation and output in float32 (float64 for
// float64 inputs).
//
// State of a partial reduction: sum/max keep the value in m; logsumexp keeps
// (m, s) with m = max of the elements seen (NaN if any is NaN) and
// s = sum exp(x - ref(m)), ref(m) = (m is +-inf) ? 0 : m -- torch's convention,
// so an all -inf slice gives log(0) + 0 = -inf and a +inf gives +inf. Each
// element is pushed online (an extra exp only when the max grows); states merge
// associatively, which lets a reduction be split across lanes, warps and blocks.
//
// Kernels (OP: 0 sum, 1 max, 2 logsumexp; type suffix f16, bf16, f32, f64):
//   reduce_rows_*:  inner == 1 (last axis). tpr threads per row (32: one warp per
//                   row, 8 rows per 256-thread block; or blockDim.x: one block per
//                   row for long rows); "virtual rows" v = row * splits + part let
//                   several blocks share one very long row (partials + finalize).
//   reduce_mid_*:   inner > 1, including the highest axis (outer == 1, seed 001):
//                   block (bx, by): bx consecutive inner columns (coalesced) x by
//                   slices of R; blockIdx.x -> (o, tile) with FastDivmod;
//                   blockIdx.y = part of R when R is split across blocks.
//   reduce_finalize_*: merges `splits` partial states per output.
#include "fast_divmod.cuh"

struct F16 { unsigned short x; };
struct BF16 { unsigned short x; };

__device__ __forceinline__ float to_acc(F16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x));
  return f;
}
__device__ __forceinline__ float to_acc(BF16 h) { return __uint_as_float(((unsigned int)h.x) << 16); }
__device__ __forceinline__ float to_acc(float f) { return f; }
__device__ __forceinline__ double to_acc(double d) { return d; }

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return __longlong_as_double(0xfff0000000000000ULL); }

// NaN-propagating max
template <typename A> __device__ __forceinline__ A nanmax(A a, A b) {
  return (b > a || b != b) ? b : a;
}
template <typename A> __device__ __forceinline__ A ref_of(A m) { return isinf(m) ? A(0) : m; }

template <typename A> struct State { A m, s; };

template <int OP, typename A> __device__ __forceinline__ State<A> identity() {
  State<A> st;
  st.m = OP == 0 ? A(0) : neg_inf<A>();
  st.s = A(0);
  return st;
}

template <int OP, typename A> __device__ __forceinline__ void push(State<A>& st, A x) {
  if (OP == 0) {
    st.m += x;
  } else if (OP == 1) {
    st.m = nanmax(st.m, x);
  } else {
    if (x > st.m) {
      A rx = ref_of(x);
      st.s = (st.s == A(0) ? A(0) : st.s * exp_acc(ref_of(st.m) - rx)) + exp_acc(x - rx);
      st.m = x;
    } else if (x != x) {
      st.m = x;
      st.s = x;
    } else {
      st.s += exp_acc(x - ref_of(st.m));
    }
  }
}

template <int OP, typename A> __device__ __forceinline__ State<A> merge(State<A> a, State<A> b) {
  State<A> r;
  if (OP == 0) {
    r.m = a.m + b.m;
    r.s = A(0);
  } else if (OP == 1) {
    r.m = nanmax(a.m, b.m);
    r.s = A(0);
  } else {
    r.m = nanmax(a.m, b.m);
    A R = ref_of(r.m);
    A ta = a.s == A(0) ? A(0) : a.s * exp_acc(ref_of(a.m) - R);
    A tb = b.s == A(0) ? A(0) : b.s * exp_acc(ref_of(b.m) - R);
    r.s = ta + tb;
    if (r.m != r.m) r.s = r.m;
  }
  return r;
}

template <int OP, typename A> __device__ __forceinline__ A finish(State<A> st) {
  if (OP == 2) return log_acc(st.s) + ref_of(st.m);
  return st.m;
}

template <int OP, typename A> __device__ __forceinline__ State<A> warp_merge(State<A> st) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    State<A> o;
    o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
    o.s = __shfl_xor_sync(0xffffffffu, st.s, off);
    st = merge<OP, A>(st, o);
  }
  return st;
}

// Store a state: final value into out (splits == 1), else the partial into ws_m/ws_s.
template <int OP, typename A>
__device__ __forceinline__ void store(State<A> st, A* out, A* ws_s, long long pos, int splits) {
  if (splits == 1) {
    out[pos] = finish<OP, A>(st);
  } else {
    out[pos] = st.m;
    if (OP == 2) ws_s[pos] = st.s;
  }
}

// ---------------------------------------------------------------- last axis
// out: (rows,) final, or (splits, rows) partial m when splits > 1 (ws_s likewise).
template <int OP, typename T, typename A>
__device__ __forceinline__ void reduce_rows(const T* __restrict__ x, A* __restrict__ out,
                                            A* __restrict__ ws_s, long long rows, long long R,
                                            int tpr, int splits, long long chunk) {
  __shared__ State<A> smem[32];
  const int rows_per_block = blockDim.x / tpr;
  const long long v = (long long)blockIdx.x * rows_per_block + threadIdx.x / tpr;
  const int lane = threadIdx.x % tpr;
  const bool active = v < rows * splits;
  const long long row = active ? v / splits : 0;
  const long long part = active ? v - row * splits : 0;
  State<A> st = identity<OP, A>();
  if (active) {
    const long long start = part * chunk;
    const long long end = min(R, start + chunk);
    const T* xr = x + row * R;
    for (long long j = start + lane; j < end; j += tpr) push<OP, A>(st, to_acc(xr[j]));
  }
  st = warp_merge<OP, A>(st);
  if (tpr > 32) {  // one row per block: combine the warps
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) smem[warp] = st;
    __syncthreads();
    if (warp == 0) {
      st = (int)threadIdx.x < nw ? smem[threadIdx.x] : identity<OP, A>();
      st = warp_merge<OP, A>(st);
    }
    if (threadIdx.x != 0) return;
  } else if (lane != 0) {
    return;
  }
  if (active) store<OP, A>(st, out, ws_s, part * rows + row, splits);
}

// ------------------------------------------------------------- middle / highest axis
template <int OP, typename T, typename A>
__device__ __forceinline__ void reduce_mid(const T* __restrict__ x, A* __restrict__ out,
                                           A* __restrict__ ws_s, long long outer, long long R,
                                           long long inner, FastDivmod div_tiles, int splits,
                                           long long chunk) {
  extern __shared__ unsigned char smem_raw[];
  State<A>* smem = reinterpret_cast<State<A>*>(smem_raw);
  unsigned int o, tile;
  div_tiles.divmod((unsigned int)blockIdx.x, o, tile);
  const int bx = blockDim.x, by = blockDim.y;
  const long long col = (long long)tile * bx + threadIdx.x;
  const int part = blockIdx.y;
  const long long start = (long long)part * chunk;
  const long long end = min(R, start + chunk);
  State<A> st = identity<OP, A>();
  if (col < inner) {
    const T* xo = x + (long long)o * R * inner + col;
    for (long long r = start + threadIdx.y; r < end; r += by) push<OP, A>(st, to_acc(xo[r * inner]));
  }
  smem[threadIdx.y * bx + threadIdx.x] = st;
  __syncthreads();
  for (int h = by >> 1; h > 0; h >>= 1) {  // by is a power of two
    if ((int)threadIdx.y < h) {
      st = merge<OP, A>(st, smem[(threadIdx.y + h) * bx + threadIdx.x]);
      smem[threadIdx.y * bx + threadIdx.x] = st;
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && col < inner) {
    const long long n_out = outer * inner;
    store<OP, A>(st, out, ws_s, (long long)part * n_out + (long long)o * inner + col, splits);
  }
}

// ------------------------------------------------------------------- finalize
template <int OP, typename A>
__device__ __forceinline__ void reduce_finalize(const A* __restrict__ ws_m, const A* __restrict__ ws_s,
                                                A* __restrict__ out, long long n, int splits) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
    State<A> st = identity<OP, A>();
    for (int p = 0; p < splits; ++p) {
      State<A> q;
      q.m = ws_m[(long long)p * n + j];
      q.s = OP == 2 ? ws_s[(long long)p * n + j] : A(0);
      st = merge<OP, A>(st, q);
    }
    out[j] = finish<OP, A>(st);
  }
}

#define DEFINE_REDUCE(OPNAME, OP, TNAME, T, A)                                                     \
  extern "C" __global__ void reduce_rows_##OPNAME##_##TNAME(const T* x, A* out, A* ws_s,          \
                                                            long long rows, long long R, int tpr,  \
                                                            int splits, long long chunk) {         \
    reduce_rows<OP, T, A>(x, out, ws_s, rows, R, tpr, splits, chunk);                              \
  }                                                                                                \
  extern "C" __global__ void reduce_mid_##OPNAME##_##TNAME(                                        \
      const T* x, A* out, A* ws_s, long long outer, long long R, long long inner,                  \
      FastDivmod div_tiles, int splits, long long chunk) {                                         \
    reduce_mid<OP, T, A>(x, out, ws_s, outer, R, inner, div_tiles, splits, chunk);                 \
  }

#define DEFINE_REDUCE_TYPES(OPNAME, OP)                                                            \
  DEFINE_REDUCE(OPNAME, OP, f16, F16, float)                                                       \
  DEFINE_REDUCE(OPNAME, OP, bf16, BF16, float)                                                     \
  DEFINE_REDUCE(OPNAME, OP, f32, float, float)                                                     \
  DEFINE_REDUCE(OPNAME, OP, f64, double, double)                                                   \
  extern "C" __global__ void reduce_finalize_##OPNAME##_f32(const float* ws_m, const float* ws_s,  \
                                                            float* out, long long n, int splits) { \
    reduce_finalize<OP, float>(ws_m, ws_s, out, n, splits);                                        \
  }                                                                                                \
  extern "C" __global__ void reduce_finalize_##OPNAME##_f64(                                       \
      const double* ws_m, const double* ws_s, double* out, long long n, int splits) {              \
    reduce_finalize<OP, double>(ws_m, ws_s, out, n, splits);                                       \
  }

DEFINE_REDUCE_TYPES(sum, 0)
DEFINE_REDUCE_TYPES(max, 1)
DEFINE_REDUCE_TYPES(logsumexp, 2)
