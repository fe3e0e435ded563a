// Packing the joiner input straight into the compact layout, and its backward (launched by
// transducer/cuda_stages.py: pack_forward / pack_backward). Both work on the rows [row_start, row_start + n)
// of the layout, so that the fused joiner loss (transducer/fused.py) can go tile by tile:
//
//   pack_forward_kernel            out[r - row_start] = dropout(act(a)), a = enc[b, t] + pred[b, u], for
//                                  row r = (b, t, u) (out's rows ld_out apart: the fused loss packs into a
//                                  wider matrix)
//   pack_grad_kernel<..., false>   grad_enc[b, t]  (+)= sum_{u <= U_b}  d(b, t, u) in range   (t < T_b)
//   pack_grad_kernel<..., true>    grad_pred[b, u] (+)= sum_{t < T_b}   d(b, t, u) in range   (u <= U_b)
//
// with d = grad_rows * mask * act'(a), a and h = act(a) recomputed as pack_forward_kernel computes them (the
// same h), or, for the identity without dropout, d = grad_rows: the fused joiner loss's activation, dropout
// and their backward ride on these passes instead of passes of their own, and the tile's hidden need not be
// kept (or read back: the input rows a pass reads besides grad_rows are few and stay in cache). The
// activations and the dropout mask: transducer/joiner.py (the same table and the same hash).
//
// The inputs may have different types (TE, TP: an fp32 encoder output beside a 16-bit predictor output
// under autocast): the sum and the activation are rounded to their promoted type P, as `enc + pred` and
// act compute them, and the forward writes the result in the GEMMs' type TO (16 bits under autocast), with
// no tile of type P. Each output row of the backward is owned by one group of TPR threads (a power of
// two), each thread one VEC-wide slice of D at a time: no atomics, sums in P's accumulation type. With
// ACCUMULATE the sums are added to the output (of the accumulation type), else they overwrite it.

#include "transducer/layout.cuh"
#include "transducer/row_pass.cuh"  // kThreads: the pack kernels' block too

namespace td {
// transducer/joiner.py: ACTIVATIONS (each one's code)
enum Activation : int { kIdentity = 0, kTanh = 1, kRelu = 2, kSigmoid = 3, kGelu = 4, kSilu = 5, kLeakyRelu = 6 };

// activate and activation_slope take each code of enum Activation in a branch of its own; a code without one
// reaches the last branch, whose static_assert of this false constant stops the compilation
// (tests/test_kernels_compile.py instantiates the pack kernels for every activation of joiner.py's table).
template <int ACT>
constexpr bool kActivationWithoutCase = false;

// act(a). FAST: the result is rounded to a 16-bit type, whose half ulp (2^-9 at least) exceeds tanh.approx's
// error (2^-10.99, PTX ISA), so the one-instruction approximation (sm_75 and later) is as good there.
template <int ACT, bool FAST, typename A>
__device__ __forceinline__ A activate(A a) {
  if constexpr (ACT == kIdentity) {
    return a;
  } else if constexpr (ACT == kTanh) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    if constexpr (FAST && sizeof(A) == 4) {
      float r;
      asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(a));
      return r;
    }
#endif
    return tanh(a);
  } else if constexpr (ACT == kRelu) {
    return a > A(0) ? a : A(0);
  } else if constexpr (ACT == kSigmoid) {
    return A(1) / (A(1) + exp(-a));
  } else if constexpr (ACT == kGelu) {
    return A(0.5) * a * (A(1) + erf(a * A(0.70710678118654752440)));
  } else if constexpr (ACT == kSilu) {
    return a / (A(1) + exp(-a));
  } else if constexpr (ACT == kLeakyRelu) {
    return a > A(0) ? a : a * A(0.01);  // transducer/joiner.py: LEAKY_RELU_SLOPE
  } else {
    static_assert(kActivationWithoutCase<ACT>, "activate: a code of enum Activation without its case");
  }
}

// act'(a), given a and h = act(a): from h where it gives it (tanh: 1 - h^2, relu: [h > 0], sigmoid:
// h (1 - h)), else from a (gelu: Phi(a) + a phi(a); silu: s + h (1 - s), s = sigmoid(a))
template <int ACT, typename A>
__device__ __forceinline__ A activation_slope(A a, A h) {
  if constexpr (ACT == kIdentity) {
    return A(1);
  } else if constexpr (ACT == kTanh) {
    return A(1) - h * h;
  } else if constexpr (ACT == kRelu) {
    return h > A(0) ? A(1) : A(0);
  } else if constexpr (ACT == kSigmoid) {
    return h * (A(1) - h);
  } else if constexpr (ACT == kGelu) {
    return A(0.5) * (A(1) + erf(a * A(0.70710678118654752440))) + a * exp(A(-0.5) * a * a) * A(0.39894228040143267794);
  } else if constexpr (ACT == kSilu) {
    const A sg = A(1) / (A(1) + exp(-a));
    return sg + h * (A(1) - sg);
  } else if constexpr (ACT == kLeakyRelu) {
    return h > A(0) ? A(1) : A(0.01);  // from h, as relu's
  } else {
    static_assert(kActivationWithoutCase<ACT>, "activation_slope: a code of enum Activation without its case");
  }
}

// The joiner's dropout (transducer/joiner.py: dropout_keep, the same arithmetic): element (row, col) is kept
// where h = fmix32(fmix32(row * 0x9E3779B1 ^ seed_lo) ^ col * 0x85EBCA77 ^ seed_hi) has h >> 8 >= threshold,
// and scaled by `scale` = 1 / (1 - p) (rounded to the hidden's type by the kernels, as the CPU twin's mask).
struct Dropout {
  unsigned int seed_lo;
  unsigned int seed_hi;
  unsigned int threshold;
  double scale;  // 1 / (1 - p), in double for float64 hiddens
};

__device__ __forceinline__ unsigned int fmix32(unsigned int h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  return h ^ (h >> 16);
}

__device__ __forceinline__ bool dropout_keep(const Dropout& d, unsigned int row, unsigned int col) {
  const unsigned int h = fmix32(fmix32(row * 0x9e3779b1u ^ d.seed_lo) ^ (col * 0x85ebca77u) ^ d.seed_hi);
  return (h >> 8) >= d.threshold;
}

// x of type A rounded to type T and back
template <typename T, typename A>
__device__ __forceinline__ A round_to(A x) {
  typedef typename ops::AccOf<T>::type TA;
  return (A)ops::to_acc(ops::from_acc<T>((TA)x));
}

// act(e + p) for one vector of the joiner input, in P's accumulation type, rounded to P after the sum and
// after act: pack_forward writes it (in its output type), pack_grad recomputes it (bit for bit, given the
// same FAST). FAST: the GEMMs that take h, or give its gradient, are 16-bit, so tanh.approx is as good (see
// activate).
//
// Two inputs of one 16-bit type (P is that type) go two elements at a time (sm_90 for bf16, sm_80 for half): a
// packed fma(e, 1, p) (the sum rounded to P once, as the float sum rounded to P is), then the packed max with
// 0; fewer instructions, which bound the pack passes otherwise. tanh is taken in fp32 (tanh.approx.f32, then
// rounded to P): the packed tanh.approx.bf16x2 / f16x2 are less accurate than P's rounding, and shifted the
// loss of a bf16 step by 8x the unfused step's error.
template <typename A, typename B>
struct SameType {
  static constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

template <typename P>
struct Packed {  // the packed instructions of P, where the architecture has them
  static constexpr bool kOn = false;
};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <>
struct Packed<ops::bf16_t> {
  static constexpr bool kOn = true;
  template <int ACT>
  static __device__ __forceinline__ unsigned int act(unsigned int e, unsigned int q) {
    unsigned int a;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(a) : "r"(e), "r"(0x3f803f80u), "r"(q));
    if (ACT == kRelu) asm("max.bf16x2 %0, %1, %2;" : "=r"(a) : "r"(a), "r"(0u));
    return a;
  }
};
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <>
struct Packed<ops::half_t> {
  static constexpr bool kOn = true;
  template <int ACT>
  static __device__ __forceinline__ unsigned int act(unsigned int e, unsigned int q) {
    unsigned int a;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(a) : "r"(e), "r"(0x3c003c00u), "r"(q));
    if (ACT == kRelu) asm("max.f16x2 %0, %1, %2;" : "=r"(a) : "r"(a), "r"(0u));
    return a;
  }
};
#endif

template <int ACT, bool FAST, typename P, typename TE, typename TP, int VEC>
__device__ __forceinline__ void joiner_input(const ops::Vec<TE, VEC>& e, const ops::Vec<TP, VEC>& p,
                                             typename ops::AccOf<P>::type (&a)[VEC],
                                             typename ops::AccOf<P>::type (&h)[VEC]) {
  typedef typename ops::AccOf<P>::type A;
  if constexpr (SameType<TE, TP>::value && SameType<TE, P>::value && sizeof(P) == 2 && VEC % 2 == 0 &&
                Packed<P>::kOn && (ACT == kIdentity || ACT == kTanh || ACT == kRelu)) {
    // a is not kept: these activations' slopes read h alone
    const unsigned int* pe = reinterpret_cast<const unsigned int*>(&e);
    const unsigned int* pp = reinterpret_cast<const unsigned int*>(&p);
#pragma unroll
    for (int j = 0; j < VEC / 2; ++j) {
      const unsigned int a = Packed<P>::template act<ACT>(pe[j], pp[j]);
      P lo, hi;
      lo.bits = (unsigned short)(a & 0xffffu);
      hi.bits = (unsigned short)(a >> 16);
      h[2 * j] = (A)ops::to_acc(lo);
      h[2 * j + 1] = (A)ops::to_acc(hi);
      if (ACT == kTanh) {
        h[2 * j] = round_to<P>(activate<kTanh, true>(h[2 * j]));
        h[2 * j + 1] = round_to<P>(activate<kTanh, true>(h[2 * j + 1]));
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      a[j] = round_to<P>((A)ops::to_acc(e.v[j]) + (A)ops::to_acc(p.v[j]));
      h[j] = ACT == kIdentity ? a[j] : round_to<P>(activate<ACT, FAST || sizeof(P) == 2>(a[j]));
    }
  }
}

// x of accumulation type A in type T
template <typename T, typename A>
__device__ __forceinline__ T convert(A x) {
  return ops::from_acc<T>((typename ops::AccOf<T>::type)x);
}

// kPackRows consecutive rows per group of threads: a group finds the first row's (b, t, u) by the search
// and steps to the next rows (a search again only where a row starts another utterance), and has the
// rows' loads in flight together (DESIGN.md: Several rows per thread group in pack_forward).
constexpr int kPackRows = 4;  // transducer/cuda_stages.py: PACK_ROWS
}  // namespace td

template <typename TE, typename TP, typename TO>
struct PackForwardParams {
  const TE* enc;   // (B, max_t, D)
  const TP* pred;  // (B, max_u1, D)
  int max_t;
  int max_u1;
  td::Grids grids;  // the compact layout
  int row_start;
  int num_rows;
  int nvec;     // D / VEC
  int log_tpr;  // log2 of the threads of a group
  td::Dropout dropout;  // DROPOUT
  TO* out;
  long long ld_out;
};

// P: the promoted type of TE and TP
template <typename TE, typename TP, typename P, typename TO, int VEC, int ACT, bool DROPOUT>
__global__ void __launch_bounds__(td::kThreads) pack_forward_kernel(const PackForwardParams<TE, TP, TO> p) {
  using namespace ops;
  typedef typename AccOf<P>::type A;
  constexpr int R = td::kPackRows;
  const TE* __restrict__ enc = p.enc;
  const TP* __restrict__ pred = p.pred;
  TO* __restrict__ out = p.out;
  const int max_t = p.max_t, max_u1 = p.max_u1, num_rows = p.num_rows, log_tpr = p.log_tpr, nvec = p.nvec;
  const int lane = threadIdx.x & ((1 << log_tpr) - 1);
  const int first = (blockIdx.x * (blockDim.x >> log_tpr) + (threadIdx.x >> log_tpr)) * R;
  if (first >= num_rows) return;
  const td::Grids& g = p.grids;
  const long long D = (long long)nvec * VEC;
  int b, t, u;
  g.coordinates(p.row_start + first, b, t, u);
  long long end = g.split(b + 1);  // the first row past utterance b
  long long st = g.stride(b);
  const Vec<TE, VEC>* pe[R];
  const Vec<TP, VEC>* pp[R];
  bool inside[R], cell[R];  // a row of the tile; and a cell of the inputs (else zeros: inconsistent lengths)
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int r = p.row_start + first + k;
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
    pe[k] = reinterpret_cast<const Vec<TE, VEC>*>(enc + ((long long)b * max_t + t) * D);
    pp[k] = reinterpret_cast<const Vec<TP, VEC>*>(pred + ((long long)b * max_u1 + u) * D);
  }
  for (int i = lane; i < nvec; i += (1 << log_tpr)) {
    Vec<TE, VEC> e[R];
    Vec<TP, VEC> q[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (cell[k]) e[k] = ldg(pe[k] + i), q[k] = ldg(pp[k] + i);
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (!inside[k]) continue;
      A a[VEC], h[VEC];
      if (cell[k]) {
        td::joiner_input<ACT, sizeof(TO) == 2, P>(e[k], q[k], a, h);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) h[j] = A(0);
      }
      if (DROPOUT) {
        const A scale = td::round_to<P>((A)p.dropout.scale);
        const unsigned int row = (unsigned int)(p.row_start + first + k);
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          h[j] = td::dropout_keep(p.dropout, row, (unsigned int)(i * VEC + j)) ? td::round_to<P>(h[j] * scale) : A(0);
      }
      Vec<TO, VEC> o;
#pragma unroll
      for (int j = 0; j < VEC; ++j) o.v[j] = td::convert<TO>(h[j]);
      reinterpret_cast<Vec<TO, VEC>*>(out + (long long)(first + k) * p.ld_out)[i] = o;
    }
  }
}

template <typename T, typename TE, typename TP, typename O>
struct PackGradParams {
  const T* grad_rows;  // the rows [row_start, row_end), D wide
  const TE* enc;       // (B, max_t, D): read for an activation only
  const TP* pred;      // (B, max_u1, D)
  int max_t;
  int max_u1;
  td::Grids grids;
  FastDivmod per_b;    // items per utterance: max_t (encoder) or max_u1 (predictor)
  int item_start;
  int num_items;
  int row_start;
  int row_end;
  int nvec;       // D / VEC
  int log_tpr;    // log2 of the threads of a group
  int log_split;  // log2 of the groups of an item
  td::Dropout dropout;  // DROPOUT
  O* grad;        // (B, max_t or max_u1, D)
};

// PRED == false: item = b * max_t + t, summing over u; PRED == true: item = b * max_u1 + u, summing over t. Items
// [item_start, item_start + num_items); rows [row_start, row_end), grad_rows holding them; enc (B, max_t, D) and pred
// (B, max_u1, D) are read only for an activation (a and h; a row whose t or u lies past them, possible with unchecked
// lengths, had a = h = 0 in forward, as here); DROPOUT: the mask too. A block of kThreads threads is kThreads >>
// log_tpr groups of 1 << log_tpr threads; the 1 << log_split groups of an item take every (1 << log_split)-th of its
// rows and their sums meet in shared memory, in a fixed order (deterministic): the launcher splits an item whose rows
// are many and far apart (the predictor's sums over t) and keeps an item to one group when its rows are few and
// contiguous. P: the promoted type of TE and TP.
template <typename T, typename TE, typename TP, typename P, typename O, int VEC, bool PRED, bool ACCUMULATE,
          int ACT, bool DROPOUT>
__global__ void __launch_bounds__(td::kThreads) pack_grad_kernel(const PackGradParams<T, TE, TP, O> p) {
  using namespace ops;
  typedef typename AccOf<P>::type Acc;
  typedef Vec<T, VEC> V;
  typedef Vec<O, VEC> VO;
  __shared__ Acc partial[td::kThreads][VEC];
  const T* __restrict__ grad_rows = p.grad_rows;
  const TE* __restrict__ enc = p.enc;
  const TP* __restrict__ pred = p.pred;
  O* __restrict__ grad = p.grad;
  const int max_t = p.max_t, max_u1 = p.max_u1, nvec = p.nvec, row_start = p.row_start, row_end = p.row_end;
  const int tpr = 1 << p.log_tpr, lane = threadIdx.x & (tpr - 1), group = threadIdx.x >> p.log_tpr;
  const int split = 1 << p.log_split, part = group & (split - 1);
  const int local = blockIdx.x * (td::kThreads >> p.log_tpr >> p.log_split) + (group >> p.log_split);
  const bool active = local < p.num_items;  // every thread reaches the barriers below
  const int item = p.item_start + (active ? local : 0);
  int b, k;  // k = t (enc) or u (pred)
  p.per_b.divmod(item, b, k);
  const td::Grids& g = p.grids;
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
      const T* rows = grad_rows + (first - row_start) * D + (long long)i * VEC;
      // the item's own encoder (predictor) row, and the other input's rows, c being the other coordinate
      // (u or t): row first + c * step of the layout is (b, k, c) or (b, c, k); unread for the identity
      const int other_rows = PRED ? max_t : max_u1;
      Vec<TE, VEC> e;
      Vec<TP, VEC> q;
      const TE* enc_rows = enc + (long long)b * max_t * D + (long long)i * VEC;
      const TP* pred_rows = pred + (long long)b * max_u1 * D + (long long)i * VEC;
      if (ACT != td::kIdentity) {
        if (PRED)
          q = ldg(reinterpret_cast<const Vec<TP, VEC>*>(pred_rows + (long long)k * D));
        else
          e = ldg(reinterpret_cast<const Vec<TE, VEC>*>(enc_rows + (long long)k * D));
      }
      const Acc scale = DROPOUT ? td::round_to<P>((Acc)p.dropout.scale) : Acc(1);
#pragma unroll 4
      for (long long c = c0 + part; c < c1; c += split) {
        const V x = ldg(reinterpret_cast<const V*>(rows + c * step * D));
        Acc slope[VEC];
        if (ACT == td::kIdentity) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) slope[j] = Acc(1);
        } else {
          Acc a[VEC], h[VEC];
          if (c < other_rows) {
            if (PRED)
              e = ldg(reinterpret_cast<const Vec<TE, VEC>*>(enc_rows + c * D));
            else
              q = ldg(reinterpret_cast<const Vec<TP, VEC>*>(pred_rows + c * D));
            td::joiner_input<ACT, sizeof(T) == 2, P>(e, q, a, h);
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) a[j] = h[j] = Acc(0);
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j) slope[j] = td::activation_slope<ACT>(a[j], h[j]);
        }
        if (DROPOUT) {
          const unsigned int row = (unsigned int)(first + c * step);
#pragma unroll
          for (int j = 0; j < VEC; ++j)
            slope[j] = td::dropout_keep(p.dropout, row, (unsigned int)(i * VEC + j)) ? slope[j] * scale : Acc(0);
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          acc[j] += ACT == td::kIdentity && !DROPOUT ? (Acc)to_acc(x.v[j]) : (Acc)to_acc(x.v[j]) * slope[j];
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
      for (int j = 0; j < VEC; ++j) o.v[j] = td::convert<O>(acc[j]);
    }
    po[i] = o;
  }
}
