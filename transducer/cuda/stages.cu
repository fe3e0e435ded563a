// CUDA twin of the transducer stages (contract: transducer/backend.py), launched by transducer/cuda/stages.py
// on torch's current stream, one template instantiation per name expression. Each kernel takes one
// parameter struct, filled on the host by field name (transducer/cuda/stages.py mirrors them):
//
//   layout_kernel      one block: the Layout table (lengths, strides, row_splits) and the
//                      value-check stats (LayoutParams)
//   log_probs_kernel   8, 16 or 32 lanes (or a 256-thread block, long rows) per row: den = logsumexp_v in
//                      one online pass, lp = picked - den (LogProbsParams)
//   alpha_beta_kernel  2B blocks: block b walks alpha of utterance b, block B + b its beta (and
//                      loss), one thread per u (AlphaBetaParams)
//   gradient_kernel    8, 16 or 32 lanes (or a block) per row: one read of the logits, one write of the gradient
//                      (GradientParams)
//   row_labels_kernel, row_log_probs_kernel, row_coefficients_kernel
//                      one thread per row: what the fused loss's Hopper kernels take and give per row
//                      (RowLabelsParams, RowLogProbsParams, RowCoefficientsParams)
//
// Rows are (b, t, u) with row = row_splits[b] + t * stride_b + u (td::Grids in layout.cuh). The per-row terms
// (sigma, the delay penalty, FastEmit, the clamp, the big blanks) are terms.cuh's, read from each struct's Terms.
// Offsets into (N, V) arrays are 64-bit: N * V may exceed 2^31; rows themselves are below 2^31
// (the loss op checks it: check_rows, called in transducer/custom_ops.py).

#include "ops/reduce.cuh"
#include "transducer/cuda/arcs.cuh"
#include "transducer/cuda/layout.cuh"
#include "transducer/cuda/params.cuh"
#include "transducer/cuda/row_pass.cuh"
#include "transducer/cuda/terms.cuh"


// ---------------------------------------------------------------------------
// log_probs: den[r] = logsumexp_v logits[r, v]; lp[r] = (x_blank - den, x_{y_u} - den + penalty(t)) - sigma,
// penalty(t) = delay_penalty * ((T_b - 1) / 2 - t) (k2's delay penalty: later emissions cost more); with
// big blanks (the multi-blank loss), lp_arcs[r, i] = x_{blank - 1 - i} - den - sigma.
// A NaN or +-inf logit makes den (RowPass::logsumexp), the log-probs and so the utterance's loss NaN (the
// CPU twin alike). ALIGNED: as for RowPass (row_pass.cuh); when false, `logits.n` is the row's columns.
template <typename T, typename I>
struct LogProbsParams {
  td::Grids grids;
  td::Rows<T> logits;
  td::Labels<I> labels;
  bool from_log_softmax;  // den = 0: the logits are log-probabilities
  td::Terms terms;        // sigma, delay_penalty
  int big_blanks;                        // K (lanes 1 ... K of the row load them: the launcher gives it K + 1)
  typename ops::AccOf<T>::type* lp;      // (N, 2)
  typename ops::AccOf<T>::type* den;     // (N,)
  typename ops::AccOf<T>::type* lp_arcs;  // (N, K)
};

template <typename T, typename I, int VEC, int TPR, bool ALIGNED>
__global__ void __launch_bounds__(td::kThreads) log_probs_kernel(const LogProbsParams<T, I> p) {
  using namespace td;
  typedef typename AccOf<T>::type Acc;
  const Acc NINF = neg_inf<Acc>();
  const ReadOnly<T> logits{p.logits.data};
  const ReadOnly<I> targets{p.labels.targets};
  Acc* __restrict__ lp = p.lp;
  Acc* __restrict__ den = p.den;
  const int V = p.logits.V;
  RowPass<T, VEC, TPR, ALIGNED, kUnroll, true> pass;
  if (!pass.begin(p.logits.data, p.logits, p.grids, !p.grids.pad.padded() && !p.from_log_softmax)) return;
  const RowInfo& ri = pass.ri;
  const int r = pass.r;
  const int K = p.big_blanks, big = pass.lane - 1;  // lane 1 + i: big blank i
  if (!ri.cell) {  // padding: nothing reads these, but every entry is written
    if (pass.lane == 0) {
      lp[2ll * r] = NINF;
      lp[2ll * r + 1] = NINF;
      den[r] = Acc(0);
    }
    if (big >= 0 && big < K) p.lp_arcs[(long long)r * K + big] = NINF;
    return;
  }
  // Reads stay in bounds whatever the lengths and labels hold: with check_inputs the host checks them
  // while this kernel runs (the label index is clamped; for checked inputs the clamps change nothing).
  BlankAndLabel<Acc> picks;
  picks.load(logits, pass.row, ri, p.labels, targets, V, pass.lane);
  Acc x_big = Acc(0);
  if (big >= 0 && big < K) x_big = to_acc(logits[pass.row + p.labels.blank - 1 - big]);
  const Acc d = p.from_log_softmax ? Acc(0) : pass.logsumexp();
  if (pass.lane == 0) {
    den[r] = d;
    picks.store(lp, r, ri, d, p.terms);
  } else if (big < K) {
    p.lp_arcs[(long long)r * K + big] = big_blank_log_prob(p.terms, x_big, d);
  }
}

// ---------------------------------------------------------------------------
// alpha / beta walks: RNN-T over anti-diagonals n = t + u (T + U steps), RNA over frames (T steps: an
// RNA cell depends on the previous frame only); alpha forwards, beta backwards. One thread per u (looping when
// U + 1 > blockDim), one barrier per step. The previous step lives in shared
// memory (two buffers of `cap` entries) when U + 1 <= cap, else (with checked lengths,
// U + 1 > blockDim only) it is read back from the output in global memory. Cells outside the RNA band
// (u <= t, t - u <= T-1-U) are -inf; so is everything when U > T - 1.
namespace td {

constexpr int kRing = 8;  // alpha/beta: steps of log-probs loaded ahead

template <typename Acc, bool RNA, bool BETA>
struct Walk {
  ReadOnly<Acc> lp;
  Acc* out;
  Acc* loss;  // beta modes: where -beta(0, 0) goes
  Acc* S;     // shared buffers, 2 * cap
  int T, U, base, st, cap;
  bool sm;

  // the frame of cell u at step s
  __device__ __forceinline__ int t_of(int s, int u) const {
    if (RNA) return BETA ? T - 1 - s : s;
    return BETA ? T - 1 + U - s - u : s - u;
  }
  __device__ __forceinline__ bool in_band(int t, int u) const {
    return !RNA || (u <= t && t - u <= T - 1 - U);
  }
  // the two log-probabilities that step s of cell (t(s,u), u) adds
  __device__ __forceinline__ void load(int s, int u, Acc& x1, Acc& x2) const {
    const Acc NINF = neg_inf<Acc>();
    x1 = NINF;
    x2 = NINF;
    const int t = t_of(s, u);
    if (t < 0 || t >= T || !in_band(t, u)) return;
    const long long c = (long long)base + (long long)t * st + u;
    if (!RNA && !BETA) {
      if (t > 0) x1 = lp[2 * (c - st)];
      if (u > 0) x2 = lp[2 * (c - 1) + 1];
    } else if (RNA && !BETA) {
      if (t > 0) {
        x1 = lp[2 * (c - st)];
        if (u > 0) x2 = lp[2 * (c - st - 1) + 1];
      }
    } else {
      x1 = lp[2 * c];
      x2 = lp[2 * c + 1];
    }
  }
  __device__ __forceinline__ void step(int s, int u, Acc x1, Acc x2) const {
    const Acc NINF = neg_inf<Acc>();
    const int t = t_of(s, u);
    Acc val = NINF;
    if (t >= 0 && t < T) {
      const long long c = (long long)base + (long long)t * st + u;
      const Acc* prv = S + ((s & 1) ? 0 : cap);
      if (in_band(t, u)) {
        if (!BETA) {
          if (t == 0 && u == 0) {
            val = Acc(0);
          } else {
            Acc p1 = NINF, p2 = NINF;
            if (t > 0) p1 = sm ? prv[u] : out[c - st];
            if (!RNA) {
              if (u > 0) p2 = sm ? prv[u - 1] : out[c - 1];
            } else if (t > 0 && u > 0) {
              p2 = sm ? prv[u - 1] : out[c - st - 1];
            }
            val = log_add(p1 + x1, p2 + x2);
          }
        } else {
          if (t == T - 1 && u == U) {
            val = x1;  // the closing blank
          } else {
            Acc p1 = NINF, p2 = NINF;
            if (t < T - 1) p1 = sm ? prv[u] : out[c + st];
            if (!RNA) {
              if (u < U) p2 = sm ? prv[u + 1] : out[c + 1];
            } else if (t < T - 1 && u < U) {
              p2 = sm ? prv[u + 1] : out[c + st + 1];
            }
            val = log_add(p1 + x1, p2 + x2);
          }
        }
      }
      out[c] = val;
      if (BETA && t == 0 && u == 0) *loss = -val;
    }
    if (sm) S[((s & 1) ? cap : 0) + u] = val;
  }

  // One u a thread, the previous step in shared memory (U + 1 <= blockDim and cap; the launcher makes cap at least
  // min(max U + 1, blockDim), so that every utterance of U + 1 <= blockDim comes here, its lengths checked), in few instructions a step
  // (the walk is a chain of dependent steps, each one barrier, on a few warps an SM, so that a step costs its
  // instructions' latencies). Thread u's cell moves by a constant each step, (t, row) += (dt, dt st) with dt = -1
  // for beta, +1 for alpha, so that no step multiplies. Every thread of a u <= U writes its value to shared memory
  // each step, -inf off the grid or the band, so that a neighbour before the grid's edge reads -inf there without a
  // test of its own; only the first step's cell ((0, 0) for alpha, (T - 1, U) for beta) reads nothing. The same
  // values as the loop of run() over load() and step(), which takes U + 1 > blockDim.
  __device__ void run_shared() const {
    const Acc NINF = neg_inf<Acc>();
    const int nsteps = RNA ? T : T + U;
    const int u = threadIdx.x, dt = BETA ? -1 : 1;
    const bool act = u <= U;
    const long long dc = (long long)dt * st;  // a step's move in rows
    int t = RNA ? (BETA ? T - 1 : 0) : (BETA ? T - 1 + U - u : -u);
    Acc* o = out + ((long long)base + (long long)t * st + u);  // the cell's entry of out, and below of lp
    // the log-probs of the cell k steps ahead, whose lp entries start at `at`, as load() reads them; q: the cell's,
    // then kRing steps ahead's
    const Acc* q = lp.p + 2 * ((long long)base + (long long)t * st + u);
    auto fetch = [&](int k, const Acc* at, Acc& x1, Acc& x2) {
      x1 = NINF;
      x2 = NINF;
      const int tk = t + k * dt;
      if (!act || (unsigned)tk >= (unsigned)T || !in_band(tk, u)) return;
      if (BETA) {
        x1 = ldg(at);
        x2 = ldg(at + 1);
      } else {
        if (tk > 0) x1 = ldg(at - 2 * st);  // the blank from (t - 1, u)
        // the label from (t, u - 1), or for RNA from (t - 1, u - 1)
        if (u > 0 && (!RNA || tk > 0)) x2 = ldg(at - (RNA ? 2 * st + 1 : 1));
      }
    };
    Acc r1[kRing], r2[kRing];
#pragma unroll
    for (int k = 0; k < kRing; ++k) fetch(k, q + 2 * k * dc, r1[k], r2[k]);
    q += 2 * kRing * dc;
    // the neighbour whose previous step an arc leaves: u - 1 (alpha's label arc) or u + 1 (beta's); none at the edge
    const int nb = BETA ? u + 1 : u - 1;
    const bool has_nb = BETA ? u < U : u > 0;
    for (int s0 = 0; s0 < nsteps; s0 += kRing) {
#pragma unroll
      for (int k = 0; k < kRing; ++k) {
        const int s = s0 + k;
        if (s < nsteps) {  // uniform over the block
          const Acc x1 = r1[k], x2 = r2[k];
          if (s + kRing < nsteps) fetch(kRing, q, r1[k], r2[k]);
          if (act) {
            const Acc* prv = S + ((s & 1) ? 0 : cap);
            Acc val = NINF;
            if ((unsigned)t < (unsigned)T) {
              if (in_band(t, u)) {
                if (s == 0) {
                  val = BETA ? x1 : Acc(0);  // beta: the closing blank
                } else {
                  const Acc p2 = has_nb ? prv[nb] : NINF;
                  val = log_add(prv[u] + x1, p2 + x2);
                }
              }
              *o = val;
              if (BETA && t == 0 && u == 0) *loss = -val;
            }
            S[((s & 1) ? cap : 0) + u] = val;
          }
          t += dt;
          o += dc;
          q += 2 * dc;
          __syncthreads();
        }
      }
    }
  }

  __device__ void run() const {
    if (sm && U + 1 <= (int)blockDim.x) {
      run_shared();
      return;
    }
    // U + 1 > blockDim (or, with unchecked lengths, U + 1 > cap): a thread takes u, u + blockDim, ...; the previous
    // step in shared memory while it fits
    const int nsteps = RNA ? T : T + U;
    for (int s = 0; s < nsteps; ++s) {
      for (int u = threadIdx.x; u <= U; u += blockDim.x) {
        Acc x1, x2;
        load(s, u, x1, x2);
        step(s, u, x1, x2);
      }
      __syncthreads();
    }
  }
};

}  // namespace td

// The walks' parameters: alpha in blocks [0, B), beta and nll in [B, 2B).
template <typename Acc>
struct AlphaBetaParams {
  td::Grids grids;
  const Acc* lp;        // (N, 2)
  bool padded;          // fill the padding rows of alpha and beta with -inf
  int cap;              // entries of each of the two shared buffers (U + 1 > cap: the previous step from global memory)
  td::Walks<Acc> out;
};

template <typename Acc, bool RNA>
__global__ void __launch_bounds__(td::kMaxBlockThreads) alpha_beta_kernel(const AlphaBetaParams<Acc> p) {
  using namespace td;
  extern __shared__ double smem_raw[];  // 8-byte aligned, viewed as Acc
  const ReadOnly<Acc> lp{p.lp};
  const Grids& g = p.grids;
  const WalkBlock w(g);
  const int b = w.b, T = w.T, U = w.U, base = (int)w.base, st = (int)w.st, cap = p.cap;
  const bool is_beta = w.is_beta;
  Acc* out = is_beta ? p.out.beta : p.out.alpha;
  Acc* loss = p.out.nll;
  const Acc NINF = neg_inf<Acc>();
  if (p.padded) fill_non_cells(g, w, out);  // like the CPU twin
  if (is_beta && T <= 0 && threadIdx.x == 0) loss[b] = -NINF;  // no frames: no alignment
  Acc* S = reinterpret_cast<Acc*>(smem_raw);
  const bool sm = U + 1 <= cap;
  if (RNA) {
    if (is_beta) {
      // The RNA walk reads only the band, but a NaN log-probability anywhere in the grid (a non-finite
      // logit) makes the loss NaN, as it does in RNN-T, where every cell lies on some alignment.
      // Only the cells are read (u <= U): padding rows hold unspecified values.
      bool nan_seen = false;
      const FastDivmod cols = FastDivmod::make((unsigned int)(U + 1));
#pragma unroll 1
      for (int i = threadIdx.x; i < T * (U + 1); i += blockDim.x) {
        int t, u;
        cols.divmod(i, t, u);
        const Acc x = lp[2ll * (base + (long long)t * st + u)];
        nan_seen |= x != x;
      }
      nan_seen = __syncthreads_or(nan_seen);
      Walk<Acc, true, true>{lp, out, loss + b, S, T, U, base, st, cap, sm}.run();
      if (nan_seen && threadIdx.x == 0) loss[b] = quiet_nan<Acc>();
    } else {
      Walk<Acc, true, false>{lp, out, loss + b, S, T, U, base, st, cap, sm}.run();
    }
  } else {
    if (is_beta)
      Walk<Acc, false, true>{lp, out, loss + b, S, T, U, base, st, cap, sm}.run();
    else
      Walk<Acc, false, false>{lp, out, loss + b, S, T, U, base, st, cap, sm}.run();
  }
}

// ---------------------------------------------------------------------------
// gradient of sum_b scale[b] * loss[b] w.r.t. the logits, one pass. With the posteriors of the cell,
// gamma = exp(alpha + loss + beta), and of its arcs, occ_blank = exp(alpha + loss + lp_blank +
// beta(after blank)) and occ_label = exp(alpha + loss + lp_label + beta(after label)):
//   g = softmax_v * (gamma + lambda * occ_label)       (not FROM_LOG_SOFTMAX)
//       - [v == blank] occ_blank - [v == y_u] (1 + lambda) occ_label
//   grad = scale * clamp(g, -c, c)
// lambda = fastemit_lambda (FastEmit, Yu et al. 2021: the gradient w.r.t. each label log-prob scaled
// by 1 + lambda, and so its share of the softmax term); c = clamp (torchaudio's gradient clamp, for a
// unit incoming gradient; CLAMP false: none). RNN-T: blank -> (t+1, u), label -> (t, u+1); RNA: blank ->
// (t+1, u), label -> (t+1, u+1); the blank from (T-1, U) ends the alignment (beta = 0). Zeros on
// padding rows and for utterances whose loss is not finite or whose scale is 0. `out` may be
// `logits` (each element is read before it is written). ALIGNED: as for log_probs_kernel; when false, `out`'s
// rows lie at the logits' rows' offsets from a 16-byte boundary (the launcher checks it), or, STAGED, start
// on one (row_pass.cuh's RowOut). FROM_LOG_SOFTMAX reads no logits: the launcher passes the output rows as
// `logits` then, so that only their alignment sets the vectors.
//
// BIG_BLANKS (the multi-blank loss): big blank i, of duration d_i = big_blank_durations.d[i], in column blank - 1 - i,
// goes to (t + d_i, u) or ends the alignment from (T - d_i, U); its arc posterior occ_big_i = exp(alpha + loss +
// lp_arcs_i + beta(after it)) is subtracted on its column. Lanes 0 ... K - 1 of the row compute them into shared
// memory, which every lane of the row reads on those columns.
template <typename T, typename I>
struct GradientParams {
  td::Grids grids;
  td::Rows<T> logits;
  td::Labels<I> labels;
  td::Lattice<typename ops::AccOf<T>::type> lattice;
  td::Scale<typename ops::AccOf<T>::type> scale;
  td::Terms terms;  // fastemit_lambda, clamp (> 0 with CLAMP)
  const typename ops::AccOf<T>::type* lp_arcs;  // BIG_BLANKS: (N, K)
  td::Durations big_blank_durations;            // BIG_BLANKS: K = big_blank_durations.n and the durations
  T* out;
  long long ld_out;
};

template <typename T, typename I, int VEC, int TPR, bool FROM_LOG_SOFTMAX, bool RNA, bool CLAMP, bool ALIGNED,
          bool STAGED, bool BIG_BLANKS>
__global__ void __launch_bounds__(td::kThreads) gradient_kernel(const GradientParams<T, I> p) {
  using namespace td;
  typedef typename AccOf<T>::type Acc;
  typedef RowGeometry<TPR> Geo;
  const Acc NINF = neg_inf<Acc>();
  const ReadOnly<I> targets{p.labels.targets};
  const ReadOnly<Acc> lp{p.lattice.lp}, den{p.lattice.den}, alpha{p.lattice.alpha}, beta{p.lattice.beta},
      loss{p.lattice.nll};
  const int V = p.logits.V, blank = p.labels.blank;
  RowPass<T, VEC, TPR, ALIGNED> pass;
  if (!pass.begin(p.logits.data, p.logits, p.grids, !FROM_LOG_SOFTMAX && !p.grids.pad.padded())) return;
  const RowInfo& ri = pass.ri;
  const int r = pass.r;
  RowOut<T, VEC, TPR, STAGED> dst;
  dst.begin(p.out + (long long)(r - p.logits.row_start) * p.ld_out, pass.head, V);
  bool live = ri.cell;
  Acc l = Acc(0), sc = Acc(0);
  if (live) {
    l = loss[ri.b];
    sc = p.scale[ri.b];
    live = is_finite(l) && sc != Acc(0);
    if (RNA) live = live && ri.u <= ri.t && ri.t - ri.u <= ri.T - 1 - ri.U;
  }
  if (!live) {
    dst.zero(pass.lane, pass.nvec, pass.col);
    return;
  }
  // per-row coefficients (every thread of the row computes them; the loads broadcast)
  const Acc lognorm = alpha[r] + l;
  const RnntArcs<Acc> arcs = rnnt_arcs<Acc, RNA>(beta, r, ri, lognorm, lp[2ll * r], lp[2ll * r + 1]);
  const int label = ri.u < ri.U ? (int)targets[(long long)ri.b * p.labels.cols + ri.u] : -1;
  const TokenGradient<Acc, !FROM_LOG_SOFTMAX, CLAMP> grad = token_gradient<Acc, !FROM_LOG_SOFTMAX, CLAMP>(
      p.terms, rnnt_token_terms(p.terms, arcs), FROM_LOG_SOFTMAX ? Acc(0) : den[r], sc, blank, label);
  __shared__ Acc sub_big[BIG_BLANKS ? Geo::RPB : 1][BIG_BLANKS ? kMaxDurations : 1];
  const int K = BIG_BLANKS ? p.big_blank_durations.n : 0;
  Acc* row_big = sub_big[BIG_BLANKS ? threadIdx.x >> Geo::LOG_G : 0];
  if (BIG_BLANKS) {
    if (pass.lane < K)
      row_big[pass.lane] = big_blank_arc(beta, ldg(p.lp_arcs + (long long)r * K + pass.lane),
                                         duration(p.big_blank_durations, pass.lane), r, ri, lognorm);
    Geo::sync();
  }
  map_row(pass, dst, !FROM_LOG_SOFTMAX, [&](int v, T x) {
    return from_acc<T>(
        grad(v, to_acc(x), BIG_BLANKS && (unsigned)(blank - 1 - v) < (unsigned)K ? row_big[blank - 1 - v] : Acc(0)));
  });
}

// ---------------------------------------------------------------------------
// layout: the Layout table of transducer/layout.py in one launch of one block,
//   table = [T_b (B) | U_b (B) | row_strides (B) | row_splits (B + 1) | stats (kNumStats)],
// for padded (B, padded_t, max_u1) grids when padded_t > 0, else compact ones (stride U_b + 1).
// With STATS, the stats (enum Stat) are all that the value checks need, read back in one transfer. Each
// thread owns a contiguous run of utterances, so row_splits is one block-wide exclusive sum.
namespace td {
// The entries of the table's stats (transducer/layout.py's Stats): min and max T_b and U_b, the cell count
// sum_b T_b*(U_b+1), the labels (u < U_b) outside [0, V) or equal to a blank, and the first of them
// (b * targets' columns + u; the int64 maximum when none).
enum Stat : int { kMinT, kMaxT, kMinU, kMaxU, kCells, kBadLabels, kFirstBadLabel, kNumStats };
// The cell count saturates at 2^61 (transducer/layout.py's CELLS_CAP), so lengths whose products or sums
// overflow 64 bits are reported instead of wrapping into a plausible count.
constexpr long long kCellsCap = 1ll << 61;
__device__ __forceinline__ long long cells_of(long long T, long long U) {
  if (T > 0 && U >= 0 && (double)T * ((double)U + 1.0) >= (double)kCellsCap) return kCellsCap;
  return T * (U + 1);
}
__device__ __forceinline__ long long cells_add(long long a, long long b) {
  return a + b >= kCellsCap ? kCellsCap : a + b;  // a, b <= kCellsCap: no overflow
}
// how two partial values of stat k merge
__device__ __forceinline__ long long merge_stat(int k, long long a, long long b) {
  if (k == kMinT || k == kMinU || k == kFirstBadLabel) return a < b ? a : b;
  if (k == kMaxT || k == kMaxU) return a > b ? a : b;
  if (k == kCells) return cells_add(a, b);
  return a + b;
}
}  // namespace td

template <typename IT, typename IU, typename I>
struct LayoutParams {
  const IT* logit_lengths;
  const IU* target_lengths;
  td::Labels<I> labels;  // targets null: no label check
  int B;
  int padded_t;  // > 0: padded (B, padded_t, max_u1) grids
  int max_u1;
  int V;
  int big_blanks;  // the blanks are the columns blank - big_blanks ... blank
  long long* table;
};

template <typename IT, typename IU, typename I, bool STATS>
__global__ void __launch_bounds__(td::kMaxBlockThreads) layout_kernel(const LayoutParams<IT, IU, I> p) {
  using namespace td;
  __shared__ long long scan[32];
  __shared__ long long part[kNumStats][32];
  const ReadOnly<IT> logit_lengths{p.logit_lengths};
  const ReadOnly<IU> target_lengths{p.target_lengths};
  const ReadOnly<I> targets{p.labels.targets};
  long long* __restrict__ table = p.table;
  const int B = p.B, padded_t = p.padded_t, max_u1 = p.max_u1, target_cols = p.labels.cols;
  const long long kMax = 0x7fffffffffffffffll, kMin = -kMax - 1;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  long long* Ts = table;
  long long* Us = table + B;
  long long* strides = table + 2 * B;
  long long* splits = table + 3 * B;
  const int per = (B + blockDim.x - 1) / blockDim.x;
  const int b0 = min(tid * per, B), b1 = min(b0 + per, B);
  long long v[kNumStats] = {kMax, kMin, kMax, kMin, 0, 0, kMax};  // the identities of merge_stat
  long long cells = 0;
  for (int b = b0; b < b1; ++b) {
    const long long T = (long long)logit_lengths[b], U = (long long)target_lengths[b];
    const long long st = padded_t > 0 ? (long long)max_u1 : U + 1;
    Ts[b] = T;
    Us[b] = U;
    strides[b] = st;
    cells += padded_t > 0 ? (long long)padded_t * max_u1 : T * st;
    if (STATS) {
      v[kMinT] = merge_stat(kMinT, v[kMinT], T);
      v[kMaxT] = merge_stat(kMaxT, v[kMaxT], T);
      v[kMinU] = merge_stat(kMinU, v[kMinU], U);
      v[kMaxU] = merge_stat(kMaxU, v[kMaxU], U);
      v[kCells] = cells_add(v[kCells], cells_of(T, U));
    }
  }
  long long total;
  long long run = block_exclusive_sum(cells, scan, &total);
  for (int b = b0; b < b1; ++b) {
    splits[b] = run;
    run += padded_t > 0 ? (long long)padded_t * max_u1 : Ts[b] * strides[b];
  }
  if (tid == 0) splits[B] = total;
  long long* stats = table + 4 * B + 1;
  if (!STATS) {  // not computed, but written: the table is an output of transducer::loss
    if (tid < kNumStats) stats[tid] = 0;
    return;
  }

  if (target_cols > 0) {
    const long long n = (long long)B * target_cols;
    for (long long i = tid; i < n; i += blockDim.x) {
      const int b = (int)(i / target_cols), u = (int)(i - (long long)b * target_cols);
      if (u < (long long)target_lengths[b]) {
        const long long y = (long long)targets[i];
        if (y < 0 || y >= p.V || (y >= p.labels.blank - p.big_blanks && y <= p.labels.blank)) {
          v[kBadLabels] += 1;
          v[kFirstBadLabel] = i < v[kFirstBadLabel] ? i : v[kFirstBadLabel];
        }
      }
    }
  }
  // over the warp, then over the warps
#pragma unroll
  for (int k = 0; k < kNumStats; ++k) {
    for (int o = 16; o > 0; o >>= 1) v[k] = merge_stat(k, v[k], __shfl_xor_sync(0xffffffffu, v[k], o));
    if (lane == 0) part[k][warp] = v[k];
  }
  __syncthreads();
  if (tid < kNumStats) {
    const int k = tid;
    long long acc = part[k][0];
    for (int w = 1; w < warps; ++w) acc = merge_stat(k, acc, part[k][w]);
    stats[k] = acc;
  }
}

// ---------------------------------------------------------------------------
// The fused loss's rows on the Hopper kernels (transducer/hopper/__init__.py; transducer/fused/hopper_tiles.py): their GEMMs
// keep the logits on the chip, so these kernels hand them each row's label and take from them each row's
// statistics, one thread per row r of [0, num_rows) (Acc = float: the kernels' GEMMs are 16-bit):
//   row_labels_kernel        labels[r] = y_{u+1} for u < U_b, else -1: the column the statistics pick
//   row_log_probs_kernel     den and lp (and multi-blank's lp_arcs) from the statistics (den, z_blank, z_label,
//                            and the big blanks' logits less their bias), as log_probs_kernel stores them
//                            (BlankAndLabel)
//   row_coefficients_kernel  a tile's rows' labels and gradient coefficients (den, occupancy, blank arc, label arc,
//                            scale, and the big blank arcs): gradient_kernel's per-row terms (terms.cuh's rnnt_arcs,
//                            rnnt_token_terms, big_blank_arc), a row without a gradient (a loss not finite, a zero
//                            scale, off RNA's band) getting den = +inf and zeros
template <typename I>
struct RowLabelsParams {
  td::Grids grids;
  td::Labels<I> labels;
  int num_rows;
  int* out;  // (num_rows,)
};

template <typename I>
__global__ void __launch_bounds__(td::kThreads) row_labels_kernel(const RowLabelsParams<I> p) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= p.num_rows) return;
  p.out[r] = td::row_label(td::row_info(r, p.grids), p.labels);
}

template <typename I>
struct RowLogProbsParams {
  td::Grids grids;
  td::Labels<I> labels;
  int num_rows;
  int big_blanks;           // K
  const float* statistics;  // (3 + K, ld_statistics): den, z_blank, z_label, then the logits of the columns
                            // blank - K ... blank - 1 (big blanks K - 1 ... 0) less their bias
  long long ld_statistics;
  const float* big_blank_bias;  // (K,): the bias of those columns, or null
  td::Terms terms;              // sigma, delay_penalty
  float* lp;       // (N, 2)
  float* den;      // (N,)
  float* lp_arcs;  // (N, K)
};

template <typename I>
__global__ void __launch_bounds__(td::kThreads) row_log_probs_kernel(const RowLogProbsParams<I> p) {
  using namespace td;
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= p.num_rows) return;
  const RowInfo ri = row_info(r, p.grids);
  const int K = p.big_blanks;
  if (!ri.cell) {  // padding, as log_probs_kernel writes it
    p.lp[2ll * r] = neg_inf<float>();
    p.lp[2ll * r + 1] = neg_inf<float>();
    p.den[r] = 0.0f;
    for (int i = 0; i < K; ++i) p.lp_arcs[(long long)r * K + i] = neg_inf<float>();
    return;
  }
  BlankAndLabel<float> picks;
  picks.has_label = row_label(ri, p.labels) >= 0;
  picks.x_blank = __ldg(p.statistics + p.ld_statistics + r);
  picks.x_label = picks.has_label ? __ldg(p.statistics + 2 * p.ld_statistics + r) : neg_inf<float>();
  const float d = __ldg(p.statistics + r);
  p.den[r] = d;
  picks.store(p.lp, r, ri, d, p.terms);
  for (int i = 0; i < K; ++i) {  // big blank i: column blank - 1 - i, the statistics' extra entry K - 1 - i
    const int e = K - 1 - i;
    const float bias = p.big_blank_bias ? __ldg(p.big_blank_bias + e) : 0.0f;
    const float x = __ldg(p.statistics + (3 + e) * p.ld_statistics + r) + bias;
    p.lp_arcs[(long long)r * K + i] = big_blank_log_prob(p.terms, x, d);
  }
}

template <typename I>
struct RowCoefficientsParams {
  td::Grids grids;
  td::Labels<I> labels;
  td::Lattice<float> lattice;
  td::Scale<float> scale;
  td::Terms terms;               // fastemit_lambda
  const float* lp_arcs;          // (N, K): the big blanks' log-probs
  td::Durations big_blank_durations;  // K = big_blank_durations.n, and their durations
  int row_start;        // the rows [row_start, row_start + num_rows): a tile's
  int num_rows;
  float* coefficients;  // (5 + K, num_rows): den, occupancy, blank arc, label arc, scale, then the arcs of the
                        // columns blank - K ... blank - 1 (big blanks K - 1 ... 0)
  int* labels_out;      // (num_rows,)
};

template <typename I, bool RNA>
__global__ void __launch_bounds__(td::kThreads) row_coefficients_kernel(const RowCoefficientsParams<I> p) {
  using namespace td;
  const int k = blockIdx.x * blockDim.x + threadIdx.x;  // the tile's row k, the layout's row r
  const int n = p.num_rows;
  if (k >= n) return;
  const int r = p.row_start + k;
  const RowInfo ri = row_info(r, p.grids);
  p.labels_out[k] = row_label(ri, p.labels);
  bool live = ri.cell;
  float l = 0.0f, sc = 0.0f;
  if (live) {
    l = __ldg(p.lattice.nll + ri.b);
    sc = p.scale[ri.b];
    live = is_finite(l) && sc != 0.0f;
    if (RNA) live = live && ri.u <= ri.t && ri.t - ri.u <= ri.T - 1 - ri.U;
  }
  float* c = p.coefficients + k;  // c[i * n]: the row's coefficient i
  const int K = p.big_blank_durations.n;
  if (!live) {
    c[0] = -neg_inf<float>();
    for (int i = 1; i < 5 + K; ++i) c[(long long)i * n] = 0.0f;
    return;
  }
  const ReadOnly<float> beta{p.lattice.beta};
  const float lognorm = __ldg(p.lattice.alpha + r) + l;
  const RnntArcs<float> arcs =
      rnnt_arcs<float, RNA>(beta, r, ri, lognorm, __ldg(p.lattice.lp + 2ll * r), __ldg(p.lattice.lp + 2ll * r + 1));
  const TokenTerms<float> terms = rnnt_token_terms(p.terms, arcs);
  c[0] = __ldg(p.lattice.den + r);
  c[n] = terms.factor;
  c[2ll * n] = terms.sub_blank;
  c[3ll * n] = terms.sub_label;
  c[4ll * n] = sc;
  for (int i = 0; i < K; ++i)
    c[(long long)(4 + K - i) * n] =
        big_blank_arc(beta, __ldg(p.lp_arcs + (long long)r * K + i), duration(p.big_blank_durations, i), r, ri,
                      lognorm);
}
