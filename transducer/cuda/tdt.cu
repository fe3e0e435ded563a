// CUDA twin of the TDT stages (transducer/backend.py says the math and the contract), launched by
// transducer/cuda/stages.py on torch's current stream, each kernel with one parameter struct:
//
//   tdt_log_probs_kernel   one warp (or a 256-thread block) per row: the token logsumexp in one online
//                          pass over 16-byte vectors, the D duration scores by the first lanes
//                          (TdtLogProbsParams)
//   tdt_walk_kernel        2B blocks: alpha of utterance b in block b, its beta and loss in block B + b;
//                          one thread per u, one barrier per anti-diagonal (every arc of duration d moves
//                          d or d + 1 anti-diagonals, so earlier ones are final); log-probs read ahead
//                          (TdtWalkParams)
//   tdt_alpha_beta_kernel  the same for any U + 1 and D (a block loops over u; no read-ahead)
//   tdt_gradient_kernel    one warp (or block) per row: one read of the scores, one write of the gradient
//                          (TdtGradientParams)
//   tdt_row_log_probs_kernel, tdt_row_coefficients_kernel
//                          the fused loss's rows on the Hopper kernels, one thread per row
//                          (TdtRowLogProbsParams, TdtRowCoefficientsParams)
//
// Token scores and duration scores are two row-major arrays with their own row strides (two views of
// NeMo's (N, V + D) joint, or two heads). Rows: as in stages.cu (RowPass, the Layout table). The per-row terms
// (sigma, the delay penalty, FastEmit, omega, the clamp, the durations' arcs) are terms.cuh's.

#include "ops/reduce.cuh"
#include "transducer/cuda/arcs.cuh"
#include "transducer/cuda/layout.cuh"
#include "transducer/cuda/params.cuh"
#include "transducer/cuda/row_pass.cuh"
#include "transducer/cuda/terms.cuh"

namespace td {

using namespace ops;

// log(sum exp(x)) over terms pushed one at a time; -inf terms are skipped, a NaN term makes it NaN. Float
// uses the fast exp (on the recursions' critical path, as ops/numeric.cuh's log_add does), double the accurate one.
template <typename Acc>
struct LogSum {
  Acc m = neg_inf<Acc>(), s = Acc(0);
  __device__ __forceinline__ void add(Acc x) {
    if (x == neg_inf<Acc>() || m != m) return;
    if (x != x) {
      m = x;
    } else if (x > m) {
      s = s * exp_fast(m - x) + Acc(1);
      m = x;
    } else {
      s += exp_fast(x - m);
    }
  }
  __device__ __forceinline__ Acc value() const { return m == neg_inf<Acc>() || m != m ? m : m + log_acc(s); }
};

// What both walks below do first: -inf on the rows of w's utterance that are not cells (padded layout), the
// loss of an utterance without frames (+inf: no alignment), and when `scan` whether a log-prob of the grid
// is NaN: tdt_log_probs_kernel makes every log-prob of a row with a non-finite score NaN, its blank entry
// included, so that one is read. false (uniform over the block): T <= 0, nothing more to do.
template <typename Acc>
__device__ __forceinline__ bool walk_begin(const ReadOnly<Acc>& lp, const Grids& g, const WalkBlock& w, bool scan,
                                           int padded, Acc* out, Acc* loss, bool& nan_seen) {
  const Acc NINF = neg_inf<Acc>();
  const int b = w.b, T = w.T, U = w.U;
  const long long base = w.base, st = w.st;
  if (padded) fill_non_cells(g, w, out);
  if (T <= 0) {
    if (w.is_beta && threadIdx.x == 0) loss[b] = -NINF;
    return false;
  }
  bool seen = false;
  if (scan) {
    const FastDivmod cols = FastDivmod::make((unsigned int)(U + 1));
#pragma unroll 8
    for (int i = threadIdx.x; i < T * (U + 1); i += blockDim.x) {  // unrolled: 8 loads in flight
      int t, u;
      cols.divmod(i, t, u);
      const long long c = base + (long long)t * st + u;
      seen |= lp[2 * c] != lp[2 * c];
    }
  }
  nan_seen = __syncthreads_or(seen);
  return true;
}

// The weights of the arcs of duration index k leaving the cell of row i, -inf where there is no such arc: TDT's
// token log-prob plus the duration's, or the multi-blank lattice's (TdtWalkParams).
template <typename Acc, bool MULTIBLANK>
struct Arcs {
  ReadOnly<Acc> lp, lp_arcs;
  int D;
  __device__ __forceinline__ Acc blank(long long i, int k) const {
    if (MULTIBLANK) return k == 0 ? neg_inf<Acc>() : k == 1 ? lp[2 * i] : lp_arcs[i * (D - 2) + k - 2];
    return lp[2 * i] + lp_arcs[i * D + k];
  }
  __device__ __forceinline__ Acc label(long long i, int k) const {
    if (MULTIBLANK) return k == 0 ? lp[2 * i + 1] : neg_inf<Acc>();
    return lp[2 * i + 1] + lp_arcs[i * D + k];
  }
};

// tdt_walk_kernel's limits: a thread per u, and D a template parameter
constexpr int kWalkMaxThreads = 512;  // transducer/cuda/stages.py: WALK_MAX_THREADS
constexpr int kWalkMaxDurations = 8;  // transducer/cuda/stages.py: WALK_MAX_DURATIONS

// The partial logsumexp of x as (max M, sum of exp(x - M)) by pairwise trees (depth log2 N, not a chain of
// N); all terms -inf: (-inf, 0); a NaN term makes the sum NaN (fmax skips it, its exp does not).
template <typename Acc, int N>
__device__ __forceinline__ void tree_logsumexp(const Acc (&x)[N], Acc& M, Acc& S) {
  Acc m[N];
#pragma unroll
  for (int i = 0; i < N; ++i) m[i] = x[i];
#pragma unroll
  for (int w = 1; w < N; w *= 2)
#pragma unroll
    for (int i = 0; i + w < N; i += 2 * w) m[i] = fmax(m[i], m[i + w]);
  M = m[0];
  const Acc shift = M == neg_inf<Acc>() ? Acc(0) : M;  // exp(-inf - 0) = 0; exp(NaN) = NaN
#pragma unroll
  for (int i = 0; i < N; ++i) m[i] = exp_fast(x[i] - shift);
#pragma unroll
  for (int w = 1; w < N; w *= 2)
#pragma unroll
    for (int i = 0; i + w < N; i += 2 * w) m[i] += m[i + w];
  S = m[0];
}

// One block's walk (BETA: beta, else alpha) over T + U anti-diagonals, a thread a cell (u = threadIdx.x), the
// rings set up by the caller (tdt_walk_kernel). The walk is bound by its instructions, so a step has no
// branches (DESIGN.md: The TDT walk is bound by its instructions, not its loads):
// - Rings of `ring` steps (a power of two > max duration + 1: step s in slot s & (ring - 1)), `cap` columns,
//   cell u in column u + 1. Every thread writes its column every step, -inf when its cell is off the grid,
//   and columns 0 and cap - 1 stay -inf; so an arc from (alpha) or to (beta) a cell off the grid reads
//   -inf without a test, and so does a blank arc of duration 0 (read from column 0).
// - alpha: a cell's thread publishes its 2D arc terms (alpha + blank + duration_i, alpha + label +
//   duration_i) in the ring ([ring][cap][2D + 1]: an odd stride keeps a warp's loads off each other's banks);
//   the D steps that use them read one value an arc. beta: the ring holds beta twice, for blank arcs and for
//   label arcs ([2][ring][cap]), so that beta(T_b, U_b) = 0, the closing blank's end, sits in the blank copy
//   (step -1, column U_b + 1) and no label arc reaches it.
// - Every cell's 2 + D log-probs are read AHEAD steps before the step that needs them, as the sums
//   token + duration_i the step adds (-inf off the grid).
template <typename Acc, int D, int AHEAD, bool BETA, bool MULTIBLANK>
__device__ __forceinline__ void tdt_walk(const ReadOnly<Acc>& lp, const ReadOnly<Acc>& lp_arcs, const Durations& durs,
                                         long long base, long long st, int T, int U, int mask, int cap, Acc* S,
                                         Acc* out, bool& seen) {
  constexpr int kCell = BETA ? 1 : 2 * D + 1;
  const Acc NINF = neg_inf<Acc>();
  const int u = threadIdx.x, steps = T + U;
  const bool act = u <= U;
  // where arc (a, k) (a = 0 blank, 1 label) reads, relative to its ring slot's row: blank arcs of duration
  // 0 read column 0
  int d[D], col[2][D];
#pragma unroll
  for (int k = 0; k < D; ++k) {
    d[k] = durs.d[k];
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      const int c = a == 0 ? (d[k] >= 1 ? u + 1 : 0) : (BETA ? u + 2 : u);
      col[a][k] = BETA ? c + a * (mask + 1) * cap : c * kCell + 2 * k + a;
    }
  }
  struct Cell {
    Acc w[2][D];  // blank and label + duration_k log-probs, -inf off the grid
  };
  auto load = [&](int s, Cell& c) {
    const int t = (BETA ? steps - 1 - s : s) - u;
    if (act && t >= 0 && t < T) {
      const long long i = base + (long long)t * st + u;
      const Acc blank = lp[2 * i], label = lp[2 * i + 1];
      seen |= blank != blank;  // the log-probs kernels make a non-finite row's every log-prob NaN
#pragma unroll
      for (int k = 0; k < D; ++k) {
        if (MULTIBLANK) {  // TdtWalkParams: blank arcs of durations 1, d_1, ...; a label arc of duration 0
          c.w[0][k] = k == 0 ? NINF : k == 1 ? blank : lp_arcs[i * (D - 2) + k - 2];
          c.w[1][k] = k == 0 ? label : NINF;
        } else {
          const Acc dur = lp_arcs[i * D + k];
          c.w[0][k] = blank + dur;
          c.w[1][k] = label + dur;
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < D; ++k) c.w[0][k] = c.w[1][k] = NINF;
    }
  };
  const int row = cap * kCell;  // a ring slot
  auto step = [&](int s, const Cell& c) {
    Acc x[2 * D];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int k = 0; k < D; ++k) {  // alpha: from step s - d (blank) or s - d - 1 (label); beta: to them
        const Acc y = S[((s - d[k] - a) & mask) * row + col[a][k]];
        x[a * D + k] = BETA ? y + c.w[a][k] : y;
      }
    Acc M, Sum;
    tree_logsumexp(x, M, Sum);
    const int t = (BETA ? steps - 1 - s : s) - u;
    const bool live = act && t >= 0 && t < T;
    Acc v = Sum != Sum ? Sum : M == NINF ? M : M + log_fast(Sum);
    if (!BETA && s == 0) v = Acc(0);  // alpha(0, 0); the only cell of step 0
    v = live ? v : NINF;
    if (live) out[base + (long long)t * st + u] = v;
    Acc* q = S + (s & mask) * row + (u + 1) * kCell;
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      if (BETA)
        q[a * (mask + 1) * cap] = v;
      else
#pragma unroll
        for (int k = 0; k < D; ++k) q[2 * k + a] = v + c.w[a][k];
    }
  };
  Cell ahead[AHEAD];
#pragma unroll
  for (int k = 0; k < AHEAD; ++k) load(k, ahead[k]);  // off the grid past the last step
#pragma unroll 1
  for (int s0 = 0; s0 < steps; s0 += AHEAD) {
#pragma unroll
    for (int k = 0; k < AHEAD; ++k) {
      const int s = s0 + k;
      if (s < steps) {  // uniform over the block
        const Cell c = ahead[k];
        load(s + AHEAD, ahead[k]);
        step(s, c);
        __syncthreads();
      }
    }
  }
}

}  // namespace td

// ---------------------------------------------------------------------------
// lp[r] = (tok(blank), tok(y_{u+1})) = x - den - sigma (the label's plus k2's delay penalty, as
// log_probs_kernel adds it), lp_arcs[r, i] = x_dur[i] - den_arcs, den[r] the
// logsumexp of the token scores and den_arcs[r] that of the duration scores; a NaN or +-inf score in the row
// makes both NaN (the sum of x - x, 0 or NaN, added to them).
template <typename T, typename I>
struct TdtLogProbsParams {
  td::Grids grids;
  td::Rows<T> tokens;
  td::DurationRows<T> duration_scores;
  td::Labels<I> labels;
  td::Terms terms;  // sigma, delay_penalty
  typename ops::AccOf<T>::type* lp;        // (N, 2)
  typename ops::AccOf<T>::type* lp_arcs;   // (N, D)
  typename ops::AccOf<T>::type* den;       // (N,)
  typename ops::AccOf<T>::type* den_arcs;  // (N,)
};

template <typename T, typename I, int VEC, int TPR, bool ALIGNED, int DEEP>
__global__ void __launch_bounds__(td::kThreads) tdt_log_probs_kernel(const TdtLogProbsParams<T, I> p) {
  using namespace td;
  static_assert(TPR >= 32, "the durations take lanes of the row's first warp: a warp or a block a row");
  typedef typename AccOf<T>::type Acc;
  const Acc NINF = neg_inf<Acc>();
  const ReadOnly<T> tok{p.tokens.data}, dur{p.duration_scores.data};
  const ReadOnly<I> targets{p.labels.targets};
  Acc* __restrict__ lp = p.lp;
  Acc* __restrict__ lp_arcs = p.lp_arcs;
  Acc* __restrict__ den = p.den;
  Acc* __restrict__ den_arcs = p.den_arcs;
  const int D = p.duration_scores.D, V = p.tokens.V;
  // DEEP vectors in flight (RowPass; 16-byte vectors of halves: 2): the launcher takes 8 for the compact
  // layout, whose rows are loaded before their (b, t, u) is known, and 4 for the padded layout, which loads
  // a row once it knows the row is a cell (DESIGN.md: Eight vectors in flight where a row is loaded before
  // its cell test).
  RowPass<T, VEC, TPR, ALIGNED, DEEP, true> pass;
  if (!pass.begin(p.tokens.data, p.tokens, p.grids, !p.grids.pad.padded())) return;
  const RowInfo& ri = pass.ri;
  const int r = pass.r;
  const long long local = r - p.tokens.row_start;
  if (!ri.cell) {
    if (pass.lane == 0) {
      lp[2ll * r] = NINF;
      lp[2ll * r + 1] = NINF;
      den[r] = Acc(0);
      den_arcs[r] = Acc(0);
    }
    if (pass.lane < D) lp_arcs[(long long)r * D + pass.lane] = NINF;
    return;
  }
  BlankAndLabel<Acc> picks;
  picks.load(tok, pass.row, ri, p.labels, targets, V, pass.lane);
  Acc x_dur = NINF;
  if (pass.lane < D) x_dur = to_acc(dur[local * p.duration_scores.ld + pass.lane]);
  const Acc d_tok = pass.logsumexp();
  // the durations: a logsumexp over the first D lanes of warp 0 (D <= 16 < 32)
  ReduceState<Acc> lsd = identity<kLogSumExp, Acc>();
  if (pass.lane < D) {
    push<kLogSumExp, Acc, AccurateExp, true>(lsd, x_dur);
    lsd.s += x_dur - x_dur;
  }
  if (threadIdx.x < 32 || TPR == 32) lsd = warp_merge<kLogSumExp, Acc, AccurateExp, true>(lsd);
  // every lane of the row's first warp now holds both (warp 0 of the block when a block takes the row)
  const Acc d_dur = finish<kLogSumExp, Acc, true>(lsd);
  const Acc bad = (d_tok - d_tok) + (d_dur - d_dur);  // 0, or NaN when either is
  if (pass.lane == 0) {
    den[r] = d_tok + bad;
    den_arcs[r] = d_dur + bad;
    picks.store(lp, r, ri, d_tok, p.terms, bad);
  }
  if (pass.lane < D) lp_arcs[(long long)r * D + pass.lane] = duration_log_prob(x_dur, d_dur, bad);
}

// ---------------------------------------------------------------------------
// alpha and beta over anti-diagonals n = t + u; the NaN scan and the loss as in stages.cu's
// alpha_beta_kernel. alpha(t, u) = logsum over i of [d_i >= 1] alpha(t - d_i, u) + blank(t - d_i, u, i) and
// [u >= 1] alpha(t - d_i, u - 1) + label(t - d_i, u - 1, i); beta the other way, with the closing blank
// from (t, U) of duration T - t.
// The last `ring` anti-diagonals (max duration + 2 of them: every predecessor or successor) stay in shared
// memory, ring * ring_cols entries, when the launcher could allot them (ring > 0) and the utterance fits
// (U + 1 <= ring_cols); else they are read back from global memory.
// Both walk kernels' parameters: alpha in blocks [0, B), beta and nll in [B, 2B).
//
// MULTIBLANK: the multi-blank lattice (transducer/backend.py) on the same walk. `durations` are then
// (0, 1, d_1, ..., d_K) and `lp_arcs` (N, K) the big blanks' log-probs: blank arcs of duration 1 weigh lp's
// blank entry, those of duration d_i the big blank's; the one label arc has duration 0 and weighs lp's label
// entry (td::Arcs<Acc, true>).
template <typename Acc>
struct TdtWalkParams {
  td::Grids grids;
  const Acc* lp;         // (N, 2)
  const Acc* lp_arcs;     // (N, D); MULTIBLANK: (N, D - 2)
  td::Durations durations;
  bool padded;           // fill the padding rows of alpha and beta with -inf
  int ring;              // anti-diagonals kept in shared memory (0: none)
  int cols;              // columns of each
  td::Walks<Acc> out;
};

template <typename Acc, bool MULTIBLANK>
__global__ void __launch_bounds__(td::kMaxBlockThreads) tdt_alpha_beta_kernel(const TdtWalkParams<Acc> p) {
  using namespace td;
  extern __shared__ double smem_raw[];  // 8-byte aligned, viewed as Acc
  Acc* S = reinterpret_cast<Acc*>(smem_raw);
  const ReadOnly<Acc> lp{p.lp}, lp_arcs{p.lp_arcs};
  const Durations& durs = p.durations;
  const Arcs<Acc, MULTIBLANK> arcs{lp, lp_arcs, durs.n};
  const int ring = p.ring, ring_cols = p.cols;
  Acc* loss = p.out.nll;
  const Grids& g = p.grids;
  const WalkBlock w(g);
  const int b = w.b, T = w.T, U = w.U, D = durs.n;
  const long long base = w.base, st = w.st;
  const bool is_beta = w.is_beta;
  Acc* out = is_beta ? p.out.beta : p.out.alpha;
  const Acc NINF = neg_inf<Acc>();
  bool nan_seen;
  if (!walk_begin(lp, g, w, is_beta, p.padded, out, loss, nan_seen)) return;
  const int steps = T + U, cols = U + 1;
  const bool sm = ring > 0 && cols <= ring_cols;  // shared memory holds ring x ring_cols entries
  // the value at cell (t, u) of anti-diagonal n = t + u (computed at an earlier step)
  auto at = [&](int t, int u) -> Acc {
    return sm ? S[((t + u) % ring) * cols + u] : out[base + (long long)t * st + u];
  };
#pragma unroll 1
  for (int step = 0; step < steps; ++step) {
    const int n = is_beta ? steps - 1 - step : step;
#pragma unroll 1
    for (int u = threadIdx.x; u <= U; u += blockDim.x) {
      const int t = n - u;
      if (t < 0 || t >= T) continue;
      const long long c = base + (long long)t * st + u;
      LogSum<Acc> acc;
      if (!is_beta) {
        if (t == 0 && u == 0) {  // alpha(0, 0) = 0 = 0 + log(1)
          acc.m = Acc(0);
          acc.s = Acc(1);
        }
        for (int k = 0; k < D; ++k) {
          const int d = duration(durs, k), s = t - d;
          if (s < 0 || (t == 0 && u == 0)) continue;
          if (d >= 1) {
            const long long from = base + (long long)s * st + u;
            acc.add(at(s, u) + arcs.blank(from, k));
          }
          if (u >= 1) {
            const long long from = base + (long long)s * st + u - 1;
            acc.add(at(s, u - 1) + arcs.label(from, k));
          }
        }
      } else {
        for (int k = 0; k < D; ++k) {
          const int d = duration(durs, k), s = t + d;
          if (d >= 1) {
            if (s < T)
              acc.add(at(s, u) + arcs.blank(c, k));
            else if (s == T && u == U)
              acc.add(arcs.blank(c, k));  // the closing blank
          }
          if (u < U && s < T) acc.add(at(s, u + 1) + arcs.label(c, k));
        }
      }
      const Acc v = acc.value();
      out[c] = v;
      if (sm) S[(n % ring) * cols + u] = v;
    }
    __syncthreads();
  }
  if (is_beta && threadIdx.x == 0) loss[b] = nan_seen ? quiet_nan<Acc>() : -out[base];
}

// ---------------------------------------------------------------------------
// The same alpha, beta and loss, faster (tdt_walk): used when a block has a thread per u (U + 1 <= blockDim <=
// kWalkMaxThreads), D <= kWalkMaxDurations (a template parameter: the loops over durations unroll) and the
// launcher could allot the shared rings.
template <typename Acc, int D, int AHEAD, bool MULTIBLANK>
__global__ void __launch_bounds__(td::kWalkMaxThreads) tdt_walk_kernel(const TdtWalkParams<Acc> p) {
  using namespace td;
  extern __shared__ double smem_raw[];  // 8-byte aligned, viewed as Acc
  Acc* S = reinterpret_cast<Acc*>(smem_raw);
  const ReadOnly<Acc> lp{p.lp}, lp_arcs{p.lp_arcs};
  const Durations& durs = p.durations;
  const int ring = p.ring, cap = p.cols;
  Acc* loss = p.out.nll;
  const Grids& g = p.grids;
  const WalkBlock w(g);
  const int b = w.b, T = w.T, U = w.U;
  const long long base = w.base, st = w.st;
  const bool is_beta = w.is_beta;
  Acc* out = is_beta ? p.out.beta : p.out.alpha;
  bool nan_seen, seen = false;  // beta reads every cell's log-probs once: the NaN scan rides on its loads
  if (!walk_begin(lp, g, w, false, p.padded, out, loss, nan_seen)) return;
  const int entries = ring * cap * (is_beta ? 2 : 2 * D + 1);
  for (int i = threadIdx.x; i < entries; i += blockDim.x) S[i] = neg_inf<Acc>();
  __syncthreads();
  // beta(T, U), step -1: blank copy. The launcher sized the columns for U + 1 <= cap - 2 (the targets' columns,
  // or the padded U + 1); the guard keeps a U_b that breaks that (check_inputs=False) inside shared memory.
  if (is_beta && threadIdx.x == 0 && U >= 0 && U + 2 < cap) S[(ring - 1) * cap + U + 1] = Acc(0);
  __syncthreads();
  if (is_beta)
    tdt_walk<Acc, D, AHEAD, true, MULTIBLANK>(lp, lp_arcs, durs, base, st, T, U, ring - 1, cap, S, out, seen);
  else
    tdt_walk<Acc, D, AHEAD, false, MULTIBLANK>(lp, lp_arcs, durs, base, st, T, U, ring - 1, cap, S, out, seen);
  nan_seen = __syncthreads_or(seen);
  if (is_beta && threadIdx.x == 0) loss[b] = nan_seen ? quiet_nan<Acc>() : -out[base];
}

// ---------------------------------------------------------------------------
// The gradient of sum_b scale[b] * ((1 - omega) tdt_b + omega rnnt_b) w.r.t. the token and duration scores
// (cpu_stages.tdt_gradient's formula), its token part clamped for a unit incoming gradient when CLAMP (NeMo's TDT
// clamp). Zeros on padding rows and for utterances whose loss (or, with OMEGA, RNN-T loss) is not finite or
// whose scale is 0. The token gradient's rows lie at the token rows' offsets from a 16-byte boundary, or,
// STAGED, start on one (row_pass.cuh's RowOut; the launcher checked which).
template <typename T, typename I>
struct TdtGradientParams {
  td::Grids grids;
  td::Rows<T> tokens;
  td::DurationRows<T> duration_scores;
  td::Durations durations;
  td::Labels<I> labels;
  td::Lattice<typename ops::AccOf<T>::type> lattice;
  const typename ops::AccOf<T>::type* lp_arcs;   // (N, D)
  const typename ops::AccOf<T>::type* den_arcs;  // (N,)
  td::Walks<const typename ops::AccOf<T>::type> rnnt;  // OMEGA: the plain RNN-T loss of the token scores
  td::Scale<typename ops::AccOf<T>::type> scale;
  td::Terms terms;  // sigma, fastemit_lambda, omega, clamp (> 0 with CLAMP)
  T* out_tokens;
  long long ld_out_tokens;
  T* out_duration_scores;
  long long ld_out_duration_scores;
};

template <typename T, typename I, int VEC, int TPR, bool OMEGA, bool CLAMP, bool ALIGNED, bool STAGED>
__global__ void __launch_bounds__(td::kThreads) tdt_gradient_kernel(const TdtGradientParams<T, I> p) {
  using namespace td;
  static_assert(TPR >= 32, "the durations take lanes of the row's first warp: a warp or a block a row");
  typedef typename AccOf<T>::type Acc;
  const Acc NINF = neg_inf<Acc>();
  const T* dur = p.duration_scores.data;
  const ReadOnly<I> targets{p.labels.targets};
  const ReadOnly<Acc> lp{p.lattice.lp}, lp_arcs{p.lp_arcs}, den{p.lattice.den}, den_arcs{p.den_arcs},
      alpha{p.lattice.alpha},
      beta{p.lattice.beta}, loss{p.lattice.nll}, alpha_r{p.rnnt.alpha}, beta_r{p.rnnt.beta}, loss_r{p.rnnt.nll};
  const Durations& durs = p.durations;
  const int D = durs.n, V = p.tokens.V, blank = p.labels.blank;
  RowPass<T, VEC, TPR, ALIGNED> pass;
  if (!pass.begin(p.tokens.data, p.tokens, p.grids, !p.grids.pad.padded())) return;
  const RowInfo& ri = pass.ri;
  const int r = pass.r, lane = pass.lane;
  const long long local = r - p.tokens.row_start;
  RowOut<T, VEC, TPR, STAGED> dst;
  dst.begin(p.out_tokens + local * p.ld_out_tokens, pass.head, V);
  T* qd = p.out_duration_scores + local * p.ld_out_duration_scores;
  bool live = ri.cell;
  Acc l = Acc(0), sc = Acc(0), l_r = Acc(0);
  if (live) {
    l = loss[ri.b];
    sc = p.scale[ri.b];
    live = is_finite(l) && sc != Acc(0);
    if (OMEGA) {
      l_r = loss_r[ri.b];
      live = live && is_finite(l_r);
    }
  }
  if (!live) {
    dst.zero(lane, pass.nvec, pass.col);
    if (lane < D) qd[lane] = from_acc<T>(Acc(0));
    return;
  }
  // per-row coefficients: every thread of the row computes them (the loads broadcast)
  const Acc lognorm = alpha[r] + l;
  const Acc gamma = cell_posterior(beta, r, lognorm);
  const Acc lp_b = lp[2ll * r], lp_l = lp[2ll * r + 1];
  // the arcs of duration d_k: lane k of the row's first warp computes them, a warp sum shares them
  TdtArcPair<Acc> arc{Acc(0), Acc(0)};
  if (lane < D)
    arc = tdt_arcs(beta, lp_arcs[(long long)r * D + lane], duration(durs, lane), r, ri, lognorm, lp_b, lp_l);
  const Acc own = arc.blank + arc.label;  // B_j + L_j of this lane's duration j
  Acc sum_blank = arc.blank, sum_label = arc.label;  // sums over the durations, on warp 0's lanes
  if (threadIdx.x < 32 || TPR == 32) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sum_blank += __shfl_xor_sync(0xffffffffu, sum_blank, o);
      sum_label += __shfl_xor_sync(0xffffffffu, sum_label, o);
    }
  }
  if (TPR > 32) {  // a block per row: warp 0 hands the sums to the others
    __shared__ Acc shared_sums[2];
    if (threadIdx.x == 0) {
      shared_sums[0] = sum_blank;
      shared_sums[1] = sum_label;
    }
    __syncthreads();
    sum_blank = shared_sums[0];
    sum_label = shared_sums[1];
  }
  const TokenTerms<Acc> terms = tdt_token_terms<Acc, OMEGA>(p.terms, gamma, sum_blank, sum_label, beta_r, alpha_r,
                                                            l_r, r, ri, lp_b, lp_l);
  const int label = ri.u < ri.U ? (int)targets[(long long)ri.b * p.labels.cols + ri.u] : -1;
  const TokenGradient<Acc, true, CLAMP> grad =
      token_gradient<Acc, true, CLAMP>(p.terms, terms, den[r], sc, blank, label);
  map_row(pass, dst, true, [&](int v, T x) { return from_acc<T>(grad(v, to_acc(x))); });
  if (lane < D) {
    const Acc x = to_acc(dur[local * p.duration_scores.ld + lane]);
    qd[lane] = from_acc<T>(duration_gradient(p.terms, x - den_arcs[r], gamma, own, sc));
  }
}

// ---------------------------------------------------------------------------
// The fused TDT loss's rows on the Hopper kernels (transducer/hopper/__init__.py), one thread per row r of [0, num_rows),
// as stages.cu's row kernels for RNN-T (Acc = float: the kernels' GEMMs are 16-bit):
//   tdt_row_log_probs_kernel     lp, den, lp_arcs and den_arcs from the statistics (den, z_blank, z_label and the
//                                D duration scores without their bias), as tdt_log_probs_kernel stores them
//   tdt_row_coefficients_kernel  a tile's rows' token gradient coefficients (den, occupancy, blank arc, label arc,
//                                scale), labels and duration scores' gradient: tdt_gradient_kernel's per-row terms
//                                (a row without a gradient getting den = +inf and zeros)
template <typename I>
struct TdtRowLogProbsParams {
  td::Grids grids;
  td::Labels<I> labels;
  int num_rows;
  int D;
  const float* statistics;  // (3 + D, ld_statistics): den, z_blank, z_label, then the duration scores less their bias
  long long ld_statistics;
  const float* duration_bias;  // (D,), or null
  td::Terms terms;             // sigma, delay_penalty
  float* lp;        // (N, 2)
  float* lp_arcs;   // (N, D)
  float* den;       // (N,)
  float* den_arcs;  // (N,)
};

template <typename I>
__global__ void __launch_bounds__(td::kThreads) tdt_row_log_probs_kernel(const TdtRowLogProbsParams<I> p) {
  using namespace td;
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= p.num_rows) return;
  const int D = p.D;
  const long long ld = p.ld_statistics;
  const RowInfo ri = row_info(r, p.grids);
  float* lp_arcs = p.lp_arcs + (long long)r * D;
  if (!ri.cell) {  // padding, as tdt_log_probs_kernel writes it
    p.lp[2ll * r] = neg_inf<float>();
    p.lp[2ll * r + 1] = neg_inf<float>();
    p.den[r] = 0.0f;
    p.den_arcs[r] = 0.0f;
    for (int k = 0; k < D; ++k) lp_arcs[k] = neg_inf<float>();
    return;
  }
  BlankAndLabel<float> picks;
  picks.has_label = row_label(ri, p.labels) >= 0;
  picks.x_blank = __ldg(p.statistics + ld + r);
  picks.x_label = picks.has_label ? __ldg(p.statistics + 2 * ld + r) : neg_inf<float>();
  const float d_tok = __ldg(p.statistics + r);
  ReduceState<float> lsd = identity<kLogSumExp, float>();
  for (int k = 0; k < D; ++k) {
    const float x = __ldg(p.statistics + (3 + k) * ld + r) + (p.duration_bias ? __ldg(p.duration_bias + k) : 0.0f);
    push<kLogSumExp, float, AccurateExp, true>(lsd, x);
    lsd.s += x - x;  // NaN for a non-finite score
    lp_arcs[k] = x;
  }
  const float d_dur = finish<kLogSumExp, float, true>(lsd);
  const float bad = (d_tok - d_tok) + (d_dur - d_dur);  // 0, or NaN when either is
  p.den[r] = d_tok + bad;
  p.den_arcs[r] = d_dur + bad;
  picks.store(p.lp, r, ri, d_tok, p.terms, bad);
  for (int k = 0; k < D; ++k) lp_arcs[k] = duration_log_prob(lp_arcs[k], d_dur, bad);
}

template <typename T, typename I>
struct TdtRowCoefficientsParams {
  td::Grids grids;
  td::Labels<I> labels;
  td::Durations durations;
  td::Lattice<float> lattice;
  const float* lp_arcs;     // (N, D)
  td::Walks<const float> rnnt;  // OMEGA: the plain RNN-T loss of the token scores
  td::Scale<float> scale;
  td::Terms terms;           // sigma, fastemit_lambda, omega
  int row_start;             // the rows [row_start, row_start + num_rows): a tile's
  int num_rows;
  float* coefficients;       // (5, num_rows): den, the softmax term's factor (tdt_token_terms), blank arc, label
                             // arc, scale: hopper.gradient_tile's den, occupancy, blank arc, label arc, scale
  int* labels_out;           // (num_rows,)
  T* duration_gradient;      // (num_rows, D), in the GEMMs' dtype
};

template <typename T, typename I, bool OMEGA>
__global__ void __launch_bounds__(td::kThreads) tdt_row_coefficients_kernel(const TdtRowCoefficientsParams<T, I> p) {
  using namespace td;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;  // the tile's row j, the layout's row r
  const int n = p.num_rows;
  if (j >= n) return;
  const int r = p.row_start + j;
  const int D = p.durations.n;
  const RowInfo ri = row_info(r, p.grids);
  p.labels_out[j] = row_label(ri, p.labels);
  bool live = ri.cell;
  float l = 0.0f, sc = 0.0f, l_r = 0.0f;
  if (live) {
    l = __ldg(p.lattice.nll + ri.b);
    sc = p.scale[ri.b];
    live = is_finite(l) && sc != 0.0f;
    if (OMEGA) {
      l_r = __ldg(p.rnnt.nll + ri.b);
      live = live && is_finite(l_r);
    }
  }
  float* c = p.coefficients + j;  // c[i * n]: the row's coefficient i
  T* g = p.duration_gradient + (long long)j * D;
  if (!live) {
    c[0] = -neg_inf<float>();
    for (int i = 1; i < 5; ++i) c[(long long)i * n] = 0.0f;
    for (int k = 0; k < D; ++k) g[k] = from_acc<T>(0.0f);
    return;
  }
  const ReadOnly<float> beta{p.lattice.beta}, lp_arcs{p.lp_arcs}, alpha_r{p.rnnt.alpha}, beta_r{p.rnnt.beta};
  const float lognorm = __ldg(p.lattice.alpha + r) + l;
  const float gamma = cell_posterior(beta, r, lognorm);
  const float lp_b = __ldg(p.lattice.lp + 2ll * r), lp_l = __ldg(p.lattice.lp + 2ll * r + 1);
  float sum_blank = 0.0f, sum_label = 0.0f;
  for (int k = 0; k < D; ++k) {
    const TdtArcPair<float> arc =
        tdt_arcs(beta, lp_arcs[(long long)r * D + k], duration(p.durations, k), r, ri, lognorm, lp_b, lp_l);
    sum_blank += arc.blank;
    sum_label += arc.label;
  }
  const TokenTerms<float> terms = tdt_token_terms<float, OMEGA>(p.terms, gamma, sum_blank, sum_label, beta_r, alpha_r,
                                                                l_r, r, ri, lp_b, lp_l);
  c[0] = __ldg(p.lattice.den + r);
  c[n] = terms.factor;
  c[2ll * n] = terms.sub_blank;
  c[3ll * n] = terms.sub_label;
  c[4ll * n] = sc;
  for (int k = 0; k < D; ++k) {  // this duration's own arcs again (no array of D in registers); not clamped (NeMo's)
    const float lp_dur = lp_arcs[(long long)r * D + k];
    const TdtArcPair<float> arc = tdt_arcs(beta, lp_dur, duration(p.durations, k), r, ri, lognorm, lp_b, lp_l);
    g[k] = from_acc<T>(duration_gradient(p.terms, lp_dur, gamma, arc.blank + arc.label, sc));
  }
}
