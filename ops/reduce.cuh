// Sum, max and logsumexp as mergeable states, and their warp- and block-wide merges; a block-wide
// exclusive sum. Used by ops/reduce.cu (reduce over any axis), the transducer's log-probs (den, the
// logsumexp of a row) and its layout kernel (row_splits).
//
// The split of a reduction into states pushed online and merged associatively, so that one reduction
// can be spread over lanes, warps and blocks, follows Paddle's kernel-primitive reduce
// (paddle/phi/kernels/primitive); logsumexp uses the online-softmax state of Milakov & Gimelshein
// (arXiv:1805.02867), (m, s) standing for m + log(s).
#pragma once

#include "ops/numeric.cuh"

namespace ops {

enum ReduceOp : int { kSum = 0, kMax = 1, kLogSumExp = 2 };

// sum / max keep the value in m. logsumexp keeps (m, s): m = max of the elements seen (NaN if any
// is NaN), s = sum of exp(x - ref(m)) with ref(m) = m, or 0 where m is +-inf (torch's convention:
// an all -inf slice gives log(0) + 0 = -inf, a +inf gives +inf).
//
// kFinite = true drops that care for inputs the caller knows to be finite, or whose non-finite
// values it reports another way (the transducer's den is made NaN by a separate sum of x - x): the
// max ignores NaN and ref(m) = m. It costs one compare per element instead of three, which matters
// in the hot loop of a softmax denominator over 16-bit logits.
template <typename A>
struct ReduceState {
  A m, s;
};

template <typename A, bool kFinite>
__device__ __forceinline__ A max_of(A a, A b) {
  return kFinite ? fmax(a, b) : nan_max(a, b);  // fmax: one instruction, and it drops a NaN
}

template <typename A, bool kFinite>
__device__ __forceinline__ A lse_ref(A m) {
  return (!kFinite && (m == -neg_inf<A>() || m == neg_inf<A>())) ? A(0) : m;
}

template <int OP, typename A>
__device__ __forceinline__ ReduceState<A> identity() {
  ReduceState<A> st;
  st.m = OP == kSum ? A(0) : neg_inf<A>();
  st.s = A(0);
  return st;
}

// Push N elements at once: logsumexp rescales s at most once per group (when its max grows).
template <int OP, typename A, typename Exp = AccurateExp, bool kFinite = false, int N>
__device__ __forceinline__ void push(ReduceState<A>& st, const A (&x)[N]) {
  if (OP == kSum) {
#pragma unroll
    for (int j = 0; j < N; ++j) st.m += x[j];
    return;
  }
  A vm = x[0];
#pragma unroll
  for (int j = 1; j < N; ++j) vm = max_of<A, kFinite>(vm, x[j]);
  const A m = max_of<A, kFinite>(st.m, vm);
  if (OP == kMax) {
    st.m = m;
    return;
  }
  if (!(m == st.m)) {  // the max grew, or became NaN
    st.s = st.s == A(0) ? A(0) : st.s * Exp()(lse_ref<A, kFinite>(st.m) - lse_ref<A, kFinite>(m));
    st.m = m;
  }
  const A r = lse_ref<A, kFinite>(m);
  if (kFinite && r == neg_inf<A>()) return;  // all -inf so far: nothing to add
#pragma unroll
  for (int j = 0; j < N; ++j) st.s += Exp()(x[j] - r);
}

template <int OP, typename A, typename Exp = AccurateExp, bool kFinite = false>
__device__ __forceinline__ void push(ReduceState<A>& st, A x) {
  const A one[1] = {x};
  push<OP, A, Exp, kFinite, 1>(st, one);
}

template <int OP, typename A, typename Exp = AccurateExp, bool kFinite = false>
__device__ __forceinline__ ReduceState<A> merge(ReduceState<A> a, ReduceState<A> b) {
  ReduceState<A> r;
  r.s = A(0);
  if (OP == kSum) {
    r.m = a.m + b.m;
  } else if (OP == kMax) {
    r.m = max_of<A, kFinite>(a.m, b.m);
  } else {
    r.m = max_of<A, kFinite>(a.m, b.m);
    const A R = lse_ref<A, kFinite>(r.m);
    const A ta = a.s == A(0) ? A(0) : a.s * Exp()(lse_ref<A, kFinite>(a.m) - R);
    const A tb = b.s == A(0) ? A(0) : b.s * Exp()(lse_ref<A, kFinite>(b.m) - R);
    r.s = r.m != r.m ? r.m : ta + tb;
  }
  return r;
}

template <int OP, typename A, bool kFinite = false>
__device__ __forceinline__ A finish(ReduceState<A> st) {
  return OP == kLogSumExp ? log_acc(st.s) + lse_ref<A, kFinite>(st.m) : st.m;
}

// Merge over the 32 lanes of a warp (blockDim.x a multiple of 32), or over each aligned group of WIDTH lanes
// (8 or 16: several rows a warp; `mask` holds the lanes of the calling thread's group, every one of which makes
// the call): every lane ends with its group's state. logsumexp takes the group's max first, then each lane's sum
// rescaled to it once, then the sum of those: one exp a lane instead of two at each step of pairwise merges (the
// same value: the scale factors of a lane's steps multiply into the one).
template <int OP, typename A, typename Exp = AccurateExp, bool kFinite = false, int WIDTH = 32>
__device__ __forceinline__ ReduceState<A> warp_merge(ReduceState<A> st, unsigned int mask = 0xffffffffu) {
  static_assert(WIDTH == 8 || WIDTH == 16 || WIDTH == 32, "warp_merge: groups of 8, 16 or 32 lanes");
  if constexpr (OP == kLogSumExp) {
    A m = st.m;
#pragma unroll
    for (int o = WIDTH / 2; o > 0; o >>= 1) m = max_of<A, kFinite>(m, __shfl_xor_sync(mask, m, o));
    A s = st.s == A(0) ? A(0) : st.s * Exp()(lse_ref<A, kFinite>(st.m) - lse_ref<A, kFinite>(m));
#pragma unroll
    for (int o = WIDTH / 2; o > 0; o >>= 1) s += __shfl_xor_sync(mask, s, o);
    st.m = m;
    st.s = m != m ? m : s;
  } else {
#pragma unroll
    for (int o = WIDTH / 2; o > 0; o >>= 1) {
      ReduceState<A> other;
      other.m = __shfl_xor_sync(mask, st.m, o);
      other.s = A(0);
      st = merge<OP, A, Exp, kFinite>(st, other);
    }
  }
  return st;
}

// Merge over a one-dimensional block of whole warps (at most 32); thread 0 ends with the block's
// state. `smem` holds 32 states; the call contains a __syncthreads, so every thread of the block
// makes it, and a second call on the same `smem` needs a __syncthreads before it.
template <int OP, typename A, typename Exp = AccurateExp, bool kFinite = false>
__device__ __forceinline__ ReduceState<A> block_merge(ReduceState<A> st, ReduceState<A>* smem) {
  st = warp_merge<OP, A, Exp, kFinite>(st);
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0) smem[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = (int)threadIdx.x < warps ? smem[threadIdx.x] : identity<OP, A>();
    st = warp_merge<OP, A, Exp, kFinite>(st);
  }
  return st;
}

// Exclusive prefix sum of one value per thread over a one-dimensional block of whole warps (at most
// 1024 threads): returns the sum of the values of the threads before this one; *total (if given)
// gets the block's sum in every thread. `smem` holds 32 values; every thread of the block makes the
// call, and a second call on the same `smem` needs a __syncthreads before it.
template <typename A>
__device__ __forceinline__ A block_exclusive_sum(A value, A* smem, A* total = nullptr) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  A incl = value;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const A y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) smem[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    A w = lane < warps ? smem[lane] : A(0);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const A y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    __syncwarp();
    if (lane < warps) smem[lane] = w;  // inclusive totals of warps 0..lane
  }
  __syncthreads();
  if (total) *total = smem[warps - 1];
  return incl - value + (warp > 0 ? smem[warp - 1] : A(0));
}

}  // namespace ops
