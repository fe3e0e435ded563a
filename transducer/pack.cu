// Packing the joiner input straight into the compact layout, and its backward (launched by
// transducer/cuda.py: pack_forward / pack_backward). Both work on the rows [row_start, row_start + n)
// of the layout, so that the fused joiner loss (transducer/fused.py) can go tile by tile:
//
//   pack_forward_kernel            out[r - row_start] = act(enc[b, t] + pred[b, u]) for row r = (b, t, u)
//                                  (out's rows ld_out apart: the fused loss packs into a wider matrix)
//   pack_grad_kernel<..., false>   grad_enc[b, t]  (+)= sum_{u <= U_b}  d(b, t, u) in range   (t < T_b)
//   pack_grad_kernel<..., true>    grad_pred[b, u] (+)= sum_{t < T_b}   d(b, t, u) in range   (u <= U_b)
//
// with d = grad_rows * act'(h), h = act(enc[b, t] + pred[b, u]) recomputed as pack_forward_kernel computes
// it (same roundings: the same h), or, for the identity, d = grad_rows: the fused joiner loss's activation
// and its backward ride on these passes instead of passes of their own, and the tile's hidden need not be
// kept (or read back: the input rows a pass reads besides grad_rows are few and stay in cache). The sum
// enc + pred is rounded to the rows' type before act, as in act(pack(enc, pred)). Each output row is owned
// by one group of TPR threads (a power of two), each thread one VEC-wide slice of D at a time: no atomics,
// fp32 (fp64) sums. With ACCUMULATE the sums are added to the output (of the accumulation type), else they
// overwrite it (in the rows' type).

#include "transducer/common.cuh"

namespace td {
enum Activation : int { kIdentity = 0, kTanh = 1, kRelu = 2 };

// FAST: the result is rounded to a 16-bit type, whose half ulp (2^-9 at least) exceeds tanh.approx's
// error (2^-10.99, PTX ISA), so the one-instruction approximation (sm_75 and later) is as good there.
template <int ACT, bool FAST, typename A>
__device__ __forceinline__ A activate(A a) {
  if (ACT == kTanh) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    if constexpr (FAST && sizeof(A) == 4) {
      float r;
      asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(a));
      return r;
    }
#endif
    return tanh(a);
  }
  if (ACT == kRelu) return a > A(0) ? a : A(0);
  return a;
}

// act(e + p) for one vector of the joiner input, rounded to T after the sum and after act: pack_forward
// writes it, pack_grad recomputes it (bit for bit)
template <int ACT, typename T, int VEC>
__device__ __forceinline__ ops::Vec<T, VEC> joiner_input(const ops::Vec<T, VEC>& e, const ops::Vec<T, VEC>& p) {
  using namespace ops;
  Vec<T, VEC> o;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    o.v[j] = from_acc<T>(to_acc(e.v[j]) + to_acc(p.v[j]));
    if (ACT != kIdentity) o.v[j] = from_acc<T>(activate<ACT, sizeof(T) == 2>(to_acc(o.v[j])));
  }
  return o;
}

// act'(a) from h = act(a): tanh' = 1 - h^2, relu' = [h > 0]
template <int ACT, typename A>
__device__ __forceinline__ A activation_slope(A h) {
  if (ACT == kTanh) return A(1) - h * h;
  if (ACT == kRelu) return h > A(0) ? A(1) : A(0);
  return A(1);
}
}  // namespace td

// kPackRows consecutive rows per group of threads: a group finds the first row's (b, t, u) by the search
// and steps to the next rows (a search again only where a row starts another utterance), and has the
// rows' loads in flight together. One row per group (a search, a FastDivmod and one vector per thread)
// wrote at half the copy rate (RESULTS.md section 7).
constexpr int kPackRows = 4;

template <typename T, int VEC, int ACT>
__global__ void __launch_bounds__(256)
    pack_forward_kernel(const T* __restrict__ enc, const T* __restrict__ pred, const long long* __restrict__ table,
                        int B, int row_start, int num_rows, int max_t, int max_u1, int nvec, int log_tpr,
                        long long ld_out, T* __restrict__ out) {
  using namespace ops;
  typedef typename AccOf<T>::type Acc;
  typedef Vec<T, VEC> V;
  constexpr int R = kPackRows;
  const int lane = threadIdx.x & ((1 << log_tpr) - 1);
  const int first = (blockIdx.x * (blockDim.x >> log_tpr) + (threadIdx.x >> log_tpr)) * R;
  if (first >= num_rows) return;
  const td::Grids g{table, B};
  const long long D = (long long)nvec * VEC;
  int b, t, u;
  g.coordinates(row_start + first, b, t, u);
  long long end = g.split(b + 1);  // the first row past utterance b
  long long st = g.stride(b);
  const V* pe[R];
  const V* pp[R];
  bool inside[R], cell[R];  // a row of the tile; and a cell of the inputs (else zeros: inconsistent lengths)
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int r = row_start + first + k;
    inside[k] = first + k < num_rows;
    if (k > 0 && inside[k]) {
      if (r < end) {
        if (++u >= st) u = 0, ++t;
      } else {
        g.coordinates(r, b, t, u);
        end = g.split(b + 1);
        st = g.stride(b);
      }
    }
    cell[k] = inside[k] && t < max_t && u < max_u1;
    pe[k] = reinterpret_cast<const V*>(enc + ((long long)b * max_t + t) * D);
    pp[k] = reinterpret_cast<const V*>(pred + ((long long)b * max_u1 + u) * D);
  }
  for (int i = lane; i < nvec; i += (1 << log_tpr)) {
    V e[R], p[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (cell[k]) e[k] = pe[k][i], p[k] = pp[k][i];
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (!inside[k]) continue;
      V o;
      if (cell[k]) {
        o = td::joiner_input<ACT>(e[k], p[k]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = from_acc<T>(Acc(0));
      }
      reinterpret_cast<V*>(out + (long long)(first + k) * ld_out)[i] = o;
    }
  }
}

// PRED == false: item = b * max_t + t, summing over u; PRED == true: item = b * max_u1 + u, summing over
// t. Items [item_start, item_start + num_items); rows [row_start, row_end), grad_rows holding them; enc
// (B, max_t, D) and pred (B, max_u1, D) are read only for an activation (h; a row whose t or u lies past
// them, possible with unchecked lengths, had h = 0 in forward, as here). A
// block of 256 threads is 256 >> log_tpr groups of 1 << log_tpr threads; the 1 << log_split groups of an
// item take every (1 << log_split)-th of its rows and their sums meet in shared memory, in a fixed
// order (deterministic): the launcher splits an item whose rows are many and far apart (the predictor's
// sums over t) and keeps an item to one group when its rows are few and contiguous.
template <typename T, typename O, int VEC, bool PRED, bool ACCUMULATE, int ACT>
__global__ void __launch_bounds__(256)
    pack_grad_kernel(const T* __restrict__ grad_rows, const T* __restrict__ enc, const T* __restrict__ pred,
                     int max_t, int max_u1, const long long* __restrict__ table, int B, FastDivmod per_b,
                     int item_start, int num_items, int row_start, int row_end, int nvec, int log_tpr, int log_split,
                     O* __restrict__ grad) {
  using namespace ops;
  typedef typename AccOf<T>::type Acc;
  typedef Vec<T, VEC> V;
  typedef Vec<O, VEC> VO;
  __shared__ Acc partial[256][VEC];
  const int tpr = 1 << log_tpr, lane = threadIdx.x & (tpr - 1), group = threadIdx.x >> log_tpr;
  const int split = 1 << log_split, part = group & (split - 1);
  const int local = blockIdx.x * (256 >> log_tpr >> log_split) + (group >> log_split);
  const bool active = local < num_items;  // every thread reaches the barriers below
  const int item = item_start + (active ? local : 0);
  int b, k;  // k = t (enc) or u (pred)
  per_b.divmod(item, b, k);
  const td::Grids g{table, B};
  const int Tb = (int)g.T(b), Ub = (int)g.U(b);
  const long long st = g.stride(b);
  const long long D = (long long)nvec * VEC;
  // the rows summed: first + c * step for c in [0, count), then only those in [row_start, row_end)
  const long long first = PRED ? g.split(b) + k : g.split(b) + (long long)k * st;
  const long long step = PRED ? st : 1;
  const long long count = active ? (PRED ? (k <= Ub ? Tb : 0) : (k < Tb ? Ub + 1 : 0)) : 0;
  long long c0 = row_start > first ? (row_start - first + step - 1) / step : 0;
  long long c1 = row_end > first ? (row_end - first + step - 1) / step : 0;
  c1 = c1 < count ? c1 : count;
  VO* po = reinterpret_cast<VO*>(grad + (long long)item * D);
  for (int i0 = 0; i0 < nvec; i0 += tpr) {
    const int i = i0 + lane;
    Acc acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = Acc(0);
    if (i < nvec) {
      const T* p = grad_rows + (first - row_start) * D + (long long)i * VEC;
      // the item's own input row (enc[b, k] or pred[b, k]) and the other input's rows, the other
      // coordinate (u or t) being c: row first + c * step of the layout is (b, t, c) or (b, c, u); null
      // pointers for the identity
      V own;
      const T* other = nullptr;
      const int other_rows = PRED ? max_t : max_u1;
      if (ACT != td::kIdentity) {
        own = *reinterpret_cast<const V*>((PRED ? pred : enc) + (long long)item * D + (long long)i * VEC);
        other = (PRED ? enc + (long long)b * max_t * D : pred + (long long)b * max_u1 * D) + (long long)i * VEC;
      }
#pragma unroll 4
      for (long long c = c0 + part; c < c1; c += split) {
        const V x = *reinterpret_cast<const V*>(p + c * step * D);
        if (ACT == td::kIdentity) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[j] += to_acc(x.v[j]);
        } else {
          V h;
          if (c < other_rows) {
            h = td::joiner_input<ACT>(own, *reinterpret_cast<const V*>(other + c * D));
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) h.v[j] = from_acc<T>(Acc(0));
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[j] += to_acc(x.v[j]) * td::activation_slope<ACT>(to_acc(h.v[j]));
        }
      }
    }
    if (split > 1) {  // the item's parts meet in part 0, in order
#pragma unroll
      for (int j = 0; j < VEC; ++j) partial[threadIdx.x][j] = acc[j];
      __syncthreads();
      if (part == 0) {
        for (int q = 1; q < split; ++q)
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[j] += partial[threadIdx.x + q * tpr][j];
      }
      __syncthreads();
    }
    if (!active || part != 0 || i >= nvec) continue;
    VO o;
    if constexpr (ACCUMULATE) {
      o = po[i];
#pragma unroll
      for (int j = 0; j < VEC; ++j) o.v[j] += (O)acc[j];
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) o.v[j] = from_acc<O>(acc[j]);
    }
    po[i] = o;
  }
}
