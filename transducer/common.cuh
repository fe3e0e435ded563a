// What the transducer kernels (stages.cu, tdt.cu, pack.cu) share: where a row of the logits lives, and
// the pass over one row that the per-row kernels make.
//
// The element types, conversions and math come from ops/numeric.cuh, the row -> utterance search
// from ragged/row_ids.cuh, the division by a per-utterance stride from ops/fast_divmod.cuh.
#pragma once

#include "ops/fast_divmod.cuh"
#include "ops/numeric.cuh"
#include "ops/reduce.cuh"
#include "ragged/row_ids.cuh"

namespace td {

using namespace ops;

// The padded layout's grid, made by the host (transducer/cuda_stages.py): rows per utterance (maxT * (maxU + 1))
// and per frame (maxU + 1). A row's (b, t, u) is then two divisions by host-made constants, no search and no
// load, so a row kernel, which loads a padded row only once it knows the row is a cell, starts its loads
// sooner. utt.d == 0: Grids searches row_splits (the compact layout, or a padded one given without its maxT,
// whose rows the kernels then load before their cell test: right, but padding is read).
struct PaddedGrid {
  FastDivmod utt, frame;
  __device__ __forceinline__ bool padded() const { return utt.d != 0; }
};

// The Layout table (transducer/layout.py): [T_b (B) | U_b (B) | row_strides (B) | row_splits (B + 1) | stats].
// Cell (b, t, u) is row row_splits[b] + t * row_strides[b] + u of the (N, V) logits.
struct Grids {
  const long long* table;
  int B;
  PaddedGrid pad;  // zeros (the compact layout) unless the kernel was given the padded grid
  __device__ __forceinline__ long long T(int b) const { return __ldg(table + b); }
  __device__ __forceinline__ long long U(int b) const { return __ldg(table + B + b); }
  __device__ __forceinline__ long long stride(int b) const { return __ldg(table + 2 * B + b); }
  __device__ __forceinline__ long long split(int b) const { return __ldg(table + 3 * B + b); }  // b in [0, B]
  // (b, t, u) of row r (0 <= r < split(B)). Padded: two divisions by pad's constants. Compact: b by a binary
  // search over row_splits (B + 1 cached entries stand in for a per-row index array: no launch and no
  // N-sized buffer for it), t and u by a FastDivmod of b's stride (clamped to >= 1).
  __device__ __forceinline__ void coordinates(int r, int& b, int& t, int& u) const {
    if (pad.padded()) {
      int rest;
      pad.utt.divmod(r, b, rest);
      pad.frame.divmod(rest, t, u);
      return;
    }
    b = ragged::row_of(table + 3 * B, B, r);
    const long long st = stride(b);
    FastDivmod::make(st < 1 ? 1u : (unsigned int)st).divmod(r - (int)split(b), t, u);
  }
};

constexpr int kThreads = 256;  // block size of the per-row kernels (transducer/cuda_stages.py: THREADS)
constexpr int kUnroll = 4;     // vectors in flight per thread and loop trip (RowPass: 2 for 8-wide vectors)

// The parts of the kernels' parameter structs (CUTLASS's Params pattern: a kernel takes one struct, which
// transducer/cuda_stages.py fills by field name; tests/test_kernel_params.py checks both sides list the same fields).

// The rows a row kernel reads: rows [row_start, row_start + num_rows) of the layout, `ld` elements apart
// from `data`, V columns; `n`: the row's VEC-wide vectors when every row starts on a vector boundary (the
// kernel's ALIGNED), else its columns (RowPass).
template <typename T>
struct Rows {
  const T* data;
  long long ld;
  int row_start;
  int num_rows;
  int V;
  int n;
};

// The labels: y_{u+1} of utterance b is targets[b * cols + u]; the blank's column.
template <typename I>
struct Labels {
  const I* targets;
  int cols;
  int blank;
};

// What forward kept for the gradient (transducer/layout.py's Lattice): per row lp (N, 2), den (N,) (TDT:
// (N, 2)), alpha and beta (N,); per utterance nll (B,).
template <typename Acc>
struct Lattice {
  const Acc* lp;
  const Acc* den;
  const Acc* alpha;
  const Acc* beta;
  const Acc* nll;
};

// A walk kernel's outputs (Acc) or another walk's results read by a gradient kernel (const Acc): alpha,
// beta (N,) and nll (B,).
template <typename Acc>
struct Walks {
  Acc* alpha;
  Acc* beta;
  Acc* nll;
};

constexpr int kMaxDurations = 16;  // transducer/layout.py: MAX_DURATIONS

// Durations of the arcs that span several frames (TDT's, the big blanks'), by value: d[0, n), the rest zeros.
struct Durations {
  int n;
  int d[kMaxDurations];
};

// durs.d[i] for a runtime i: a dynamic index into the struct (a kernel parameter) would copy it to local
// memory in every thread, 17 stores before the first use
__device__ __forceinline__ int duration(const Durations& durs, int i) {
  int d = 0;
#pragma unroll
  for (int k = 0; k < kMaxDurations; ++k) d = k == i ? durs.d[k] : d;
  return d;
}

// The incoming gradient of utterance b: values[b * stride].
template <typename Acc>
struct Scale {
  const Acc* values;
  long long stride;
  __device__ __forceinline__ Acc operator[](int b) const { return __ldg(values + b * stride); }
};

template <int WPR>
struct RowGeometry {
  static_assert(WPR == 1 || WPR == 8, "one warp or one 256-thread block per row");
  static constexpr int G = 32 * WPR;                 // threads per row
  static constexpr int LOG_G = WPR == 1 ? 5 : 8;
  static constexpr int RPB = kThreads / G;           // rows per block
};

// (t, u) of row r and whether it is a cell of its utterance (not padding).
struct RowInfo {
  int b, t, u, T, U, st;
  bool cell;
};

__device__ __forceinline__ RowInfo row_info(int r, const Grids& g) {
  RowInfo ri;
  g.coordinates(r, ri.b, ri.t, ri.u);
  const long long st = g.pad.padded() ? (long long)g.pad.frame.d : g.stride(ri.b);
  ri.st = st < 1 ? 1 : (int)st;
  ri.T = (int)g.T(ri.b);
  ri.U = (int)g.U(ri.b);
  ri.cell = ri.t < ri.T && ri.u <= ri.U;
  return ri;
}

// The utterance of a block of the walks (alpha and beta, RNN-T and TDT): blocks [0, B) walk alpha over
// utterance b = blockIdx.x, blocks [B, 2B) beta over b = blockIdx.x - B.
struct WalkBlock {
  int b, T, U;
  bool is_beta;
  long long base, st;  // the row of cell (b, 0, 0) and the row stride of t
  __device__ __forceinline__ explicit WalkBlock(const Grids& g) {
    b = blockIdx.x;
    is_beta = b >= g.B;
    if (is_beta) b -= g.B;
    T = (int)g.T(b);
    U = (int)g.U(b);
    base = g.split(b);
    st = g.stride(b);
  }
};

// -inf into the rows of w's utterance in the padded layout that are not cells (u > U or t >= T), as the
// CPU twins leave them: the columns past U of the first T rows, then every row past T. Stays within the
// utterance's rows [split(b), split(b + 1)) whatever T and U hold (with check_inputs=False they are not
// checked against the padded sizes); one division a block, none a row.
template <typename Acc>
__device__ __forceinline__ void fill_non_cells(const Grids& g, const WalkBlock& w, Acc* out) {
  const Acc NINF = neg_inf<Acc>();
  const long long end = g.split(w.b + 1);
  if (w.st < 1 || end <= w.base) return;
  const long long rows = (end - w.base) / w.st;
  const int cells_t = (int)(w.T < 0 ? 0 : w.T < rows ? w.T : rows);
  const int u0 = w.U + 1 > 0 ? w.U + 1 : 0;
  if (u0 < w.st) {
#pragma unroll 1
    for (int t = 0; t < cells_t; ++t)
#pragma unroll 1
      for (long long u = u0 + (int)threadIdx.x; u < w.st; u += blockDim.x) out[w.base + t * w.st + u] = NINF;
  }
#pragma unroll 1
  for (long long i = w.base + cells_t * w.st + threadIdx.x; i < end; i += blockDim.x) out[i] = NINF;
}

// One row of the logits, read by a group of G threads in VEC-wide vectors, UNROLL vectors in flight
// per thread: what log_probs and gradient share. READ_ONLY: no thread writes the rows while the kernel
// runs (the log-probs kernels; a gradient may overwrite them), so they are loaded through ldg.
// ALIGNED: every row starts on a VEC boundary (the launcher checked the base and the row stride), `n` of
// begin() is the row's vectors. Otherwise (NeMo's TDT joint:
// V + D = 1029 scores a row) `n` is the row's columns: the first `head` columns up to the row's first
// VEC boundary and the `tail` columns after its last whole vector are one scalar each for the first
// head + tail (< 2 VEC) threads of the row, and the vectors between them are read as when aligned.
// `logits` holds the rows [row_start, row_start + num_rows) of the layout (all of them, or a tile of
// the fused joiner loss), `ld` apart (struct Rows); the per-row arrays (lp, den, alpha, beta) are indexed by the row of
// the layout. In the compact layout the first vectors are
// loaded before the row's (b, t, u) is known (`early`): they depend on r alone, so the search for b
// and the loads of strides, lengths and targets overlap them instead of delaying them.
template <typename T, int VEC, int WPR, bool ALIGNED = true, int DEEP = kUnroll, bool READ_ONLY = false>
struct RowPass {
  typedef RowGeometry<WPR> Geo;
  typedef Vec<T, VEC> VT;
  // Vectors in flight per thread: DEEP, but 2 for 16-byte vectors of 8 halves: they hold 4 registers each,
  // and 4 of them beside the gradient kernels' state spill (DESIGN.md: Two vectors in flight for 16-byte
  // vectors of halves).
  static constexpr int UNROLL = VEC >= 8 ? 2 : DEEP;
  int lane, r, nvec;  // r: the row of the layout (row_start + the row of `logits`)
  int head = 0;       // columns before the first vector (0 when ALIGNED)
  int col = -1;       // !ALIGNED: the column of this thread's scalar (-1: none)
  T x;                // and its value
  long long row;      // offset of the row's first element in `logits`
  const VT* p;
  VT buf[UNROLL];
  bool early;
  RowInfo ri;

  // false for the threads past the last row (uniform per row, per block when WPR == 8)
  // `logits`: rows.data, as the kernel's own (restrict) pointer
  __device__ __forceinline__ bool begin(const T* logits, const Rows<T>& rows, const Grids& g, bool load_early) {
    const int n = rows.n;
    lane = threadIdx.x & (Geo::G - 1);
    const int local = blockIdx.x * Geo::RPB + (threadIdx.x >> Geo::LOG_G);
    if (local >= rows.num_rows) return false;
    r = rows.row_start + local;
    row = (long long)local * rows.ld;
    if (ALIGNED) {
      nvec = n;
    } else {
      const int mis = (int)((reinterpret_cast<unsigned long long>(logits + row) / sizeof(T)) % VEC);
      head = min(mis ? VEC - mis : 0, n);
      nvec = (n - head) / VEC;
      const int tail = n - head - nvec * VEC;
      col = lane < head ? lane : (lane < head + tail ? lane + nvec * VEC : -1);
      if (col >= 0) x = READ_ONLY ? ldg(logits + row + col) : logits[row + col];
    }
    p = reinterpret_cast<const VT*>(logits + row + head);
    early = load_early;
    if (early) load(lane);
    ri = row_info(r, g);
    return true;
  }
  // UNROLL vectors from i0: [i0, i0 + G, ..., i0 + (UNROLL-1) G], those below nvec
  __device__ __forceinline__ void load(int i0) {
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const int i = i0 + k * Geo::G;
      if (i < nvec) buf[k] = READ_ONLY ? ldg(p + i) : p[i];
    }
  }
  // logsumexp of the row's scores (a warp per row: every lane gets it; a block per row: warp 0 does).
  // A NaN or +-inf score makes it NaN: x - x is 0 or NaN, and each vector's sum of it joins the state's
  // sum, which a NaN keeps NaN through every rescale and merge (no reduction of its own).
  __device__ __forceinline__ typename AccOf<T>::type logsumexp() {
    typedef typename AccOf<T>::type Acc;
    ReduceState<Acc> lse = identity<kLogSumExp, Acc>();
    for_each(true, [&](int, const VT& vt) {
      Acc x[VEC], nonfinite = Acc(0);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        x[j] = to_acc(vt.v[j]);
        nonfinite += x[j] - x[j];
      }
      push<kLogSumExp, Acc, FastExp, true, VEC>(lse, x);
      lse.s += nonfinite;
    });
    if (!ALIGNED && col >= 0) {
      const Acc xs = to_acc(x);
      push<kLogSumExp, Acc, FastExp, true>(lse, xs);
      lse.s += xs - xs;
    }
    if (WPR == 1) {
      lse = warp_merge<kLogSumExp, Acc, FastExp, true>(lse);
    } else {
      __shared__ ReduceState<Acc> smem[32];
      lse = block_merge<kLogSumExp, Acc, FastExp, true>(lse, smem);
    }
    return finish<kLogSumExp, Acc, true>(lse);
  }
  // the row's column of element j of vector i
  __device__ __forceinline__ int column(int i, int j) const { return head + i * VEC + j; }
  // f(i, vector) over the row's vectors, in order per thread; `loads` false: no reads (buf unused)
  template <typename F>
  __device__ __forceinline__ void for_each(bool loads, F f) {
    if (loads && !early) load(lane);
    for (int i0 = lane;;) {
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        if (i0 + k * Geo::G < nvec) f(i0 + k * Geo::G, buf[k]);
      }
      i0 += Geo::G * UNROLL;
      if (i0 >= nvec) break;
      if (loads) load(i0);
    }
  }
};

// Where a gradient kernel writes the row its RowPass reads: `n` columns from `row`. STAGED false: the output
// row lies at the input row's offset from a 16-byte boundary (the logits themselves, or a tensor of their
// layout), so each vector of the pass is stored as it is, and the head and tail scalars likewise. STAGED
// true: the output rows start on 16-byte boundaries and the input rows do not (the loss returns the gradient
// of a 505-wide joint output in 512-wide rows, which cuBLAS's GEMMs read with wide loads; DESIGN.md: 16-byte
// rows for cuBLAS). The values are then stored into the row's copy in shared memory (RPB rows of `n` rounded
// up to VEC elements a block, 16-byte aligned), which the row's threads write out in whole vectors once
// every value is in (finish). A vector lands at the same offset from a 16-byte boundary for the whole row:
// it is stored in the widest pieces that offset allows (one 16-byte store, two of 8 or four of 4 bytes;
// 2-byte elements at an odd position: 2 + 4 + 4 + 4 + 2), not element by element, whose 2-byte stores
// conflict on the banks (DESIGN.md: Stage a row in the widest stores its offset allows).
template <typename T, int VEC, int WPR, bool STAGED>
struct RowOut {
  typedef RowGeometry<WPR> Geo;
  typedef Vec<T, VEC> VT;
  static_assert(!STAGED || sizeof(VT) == 16, "staged rows are written in 16-byte vectors");
  static_assert(sizeof(T) == 2 || sizeof(T) % 4 == 0, "put's pieces: 2-byte elements or whole words");
  T* row;    // the output row
  T* stage;  // STAGED: its copy in shared memory
  int head, n;
  int land;  // STAGED: bytes from a 16-byte boundary of the copy to where each vector of the pass lands

  __device__ __forceinline__ void begin(T* out_row, int pass_head, int columns) {
    row = out_row;
    head = pass_head;
    n = columns;
    if (STAGED) {
      extern __shared__ __align__(16) unsigned char row_out_stage[];
      stage = reinterpret_cast<T*>(row_out_stage) + (threadIdx.x >> Geo::LOG_G) * ((n + VEC - 1) / VEC * VEC);
      land = (int)(head * sizeof(T)) & 15;
    }
  }
  // vector i of the pass: columns head + i * VEC, ..., head + i * VEC + VEC - 1
  __device__ __forceinline__ void put(int i, const VT& o) {
    if (STAGED) {
      unsigned char* s = reinterpret_cast<unsigned char*>(stage + head + i * VEC);
      const uint4 w = *reinterpret_cast<const uint4*>(&o);
      if (land == 0) {
        *reinterpret_cast<uint4*>(s) = w;
      } else if ((land & 7) == 0) {
        reinterpret_cast<uint2*>(s)[0] = make_uint2(w.x, w.y);
        reinterpret_cast<uint2*>(s)[1] = make_uint2(w.z, w.w);
      } else if ((land & 3) == 0) {
        unsigned int* s4 = reinterpret_cast<unsigned int*>(s);
        s4[0] = w.x;
        s4[1] = w.y;
        s4[2] = w.z;
        s4[3] = w.w;
      } else {  // 2-byte elements starting at an odd position: the pairs (1, 2), (3, 4), (5, 6) are words
        *reinterpret_cast<unsigned short*>(s) = (unsigned short)(w.x & 0xffffu);
        *reinterpret_cast<unsigned int*>(s + 2) = __byte_perm(w.x, w.y, 0x5432);
        *reinterpret_cast<unsigned int*>(s + 6) = __byte_perm(w.y, w.z, 0x5432);
        *reinterpret_cast<unsigned int*>(s + 10) = __byte_perm(w.z, w.w, 0x5432);
        *reinterpret_cast<unsigned short*>(s + 14) = (unsigned short)(w.w >> 16);
      }
    } else {
      reinterpret_cast<VT*>(row + head)[i] = o;
    }
  }
  __device__ __forceinline__ void put_scalar(int col, T x) { (STAGED ? stage : row)[col] = x; }
  // after the row's last put, by every thread of the row
  __device__ __forceinline__ void finish(int lane) {
    if (!STAGED) return;
    if (WPR == 1)
      __syncwarp();
    else
      __syncthreads();
    const int nvec = n / VEC;
    const VT* s = reinterpret_cast<const VT*>(stage);
    VT* q = reinterpret_cast<VT*>(row);
    for (int i = lane; i < nvec; i += Geo::G) q[i] = s[i];
    for (int c = nvec * VEC + lane; c < n; c += Geo::G) row[c] = stage[c];
  }
  // zeros over the whole row, by every thread of the row; pass_nvec and pass_col: the pass's (unstaged:
  // the vectors are the pass's, at its head, and the scalar at its column)
  __device__ __forceinline__ void zero(int lane, int pass_nvec, int pass_col) {
    VT z;
#pragma unroll
    for (int j = 0; j < VEC; ++j) z.v[j] = from_acc<T>(typename AccOf<T>::type(0));
    if (STAGED) {
      const int nvec = n / VEC;
      VT* q = reinterpret_cast<VT*>(row);
      for (int i = lane; i < nvec; i += Geo::G) q[i] = z;
      for (int c = nvec * VEC + lane; c < n; c += Geo::G) row[c] = z.v[0];
    } else {
      VT* q = reinterpret_cast<VT*>(row + head);
      for (int i = lane; i < pass_nvec; i += Geo::G) q[i] = z;
      if (pass_col >= 0) row[pass_col] = z.v[0];
    }
  }
};

// The blank's and the label's scores of a row, as both log-probs kernels pick them: lane 0 loads them before
// the row's logsumexp (their latency overlaps it) and, once den is known, writes lp[r] = (x_blank - den - sigma,
// x_y - den - sigma + k2's delay penalty delay_penalty * ((T_b - 1) / 2 - t)), -inf without a label. The label's
// column is clamped into [0, V): with check_inputs the host checks the labels while the kernel runs.
template <typename Acc>
struct BlankAndLabel {
  bool has_label;
  Acc x_blank, x_label;

  template <typename T, typename I>
  __device__ __forceinline__ void load(const ReadOnly<T>& rows, long long row, const RowInfo& ri,
                                       const Labels<I>& labels, const ReadOnly<I>& targets, int V, int lane) {
    has_label = ri.u >= 0 && ri.u < ri.U && ri.u < labels.cols;
    x_blank = Acc(0);
    x_label = neg_inf<Acc>();
    if (lane != 0) return;
    x_blank = to_acc(rows[row + labels.blank]);
    if (has_label) {
      const long long y = (long long)targets[(long long)ri.b * labels.cols + ri.u];
      x_label = to_acc(rows[row + (y < 0 ? 0 : y >= V ? V - 1 : y)]);
    }
  }
  // `bad`: 0, or NaN to make both entries NaN
  __device__ __forceinline__ void store(Acc* lp, long long r, const RowInfo& ri, Acc den, Acc sigma,
                                        double delay_penalty, Acc bad = Acc(0)) const {
    const Acc penalty = Acc(delay_penalty) * (Acc(0.5) * (ri.T - 1) - ri.t);
    lp[2 * r] = x_blank - den - sigma + bad;
    lp[2 * r + 1] = has_label ? x_label - den - sigma + penalty + bad : neg_inf<Acc>();
  }
};

// The RNN-T arcs leaving the cell of row r, as both gradient kernels need them (tdt.cu's for its omega term):
// with lognorm = alpha(r) + loss, the log of the cell's posterior, lognorm + beta(r), and the posteriors of its
// blank arc (to (t + 1, u), or the end from (T - 1, U)) and its label arc (to (t, u + 1); RNA: (t + 1, u + 1)),
// whose log-probs are lp_blank and lp_label.
template <typename Acc>
struct RnntArcs {
  Acc log_gamma, blank, label;
};

template <typename Acc, bool RNA>
__device__ __forceinline__ RnntArcs<Acc> rnnt_arcs(const ReadOnly<Acc>& beta, long long r, const RowInfo& ri,
                                                   Acc lognorm, Acc lp_blank, Acc lp_label) {
  const Acc NINF = neg_inf<Acc>();
  const long long st = ri.st;
  RnntArcs<Acc> a;
  a.log_gamma = lognorm + beta[r];
  const Acc after_blank = ri.t + 1 < ri.T ? beta[r + st] : (ri.u == ri.U ? Acc(0) : NINF);
  a.blank = exp_acc(lognorm + lp_blank + after_blank);
  a.label = Acc(0);
  if (ri.u < ri.U) {
    const Acc after_label = RNA ? (ri.t + 1 < ri.T ? beta[r + st + 1] : NINF) : beta[r + 1];
    a.label = exp_acc(lognorm + lp_label + after_label);
  }
  return a;
}

// The gradient of one token score x of a row from the row's terms, as both gradient kernels form it:
// g = exp(x + coef) (SOFTMAX: coef is the log of the softmax term's factor less den) - [v == blank] sub_blank -
// [v == label] sub_label - `more` (multi-blank's big blank arcs), clamped to [-clamp, clamp] (CLAMP), times
// the incoming scale.
template <typename Acc, bool SOFTMAX, bool CLAMP>
struct TokenGradient {
  Acc coef, sub_blank, sub_label, clamp, scale;
  int blank, label;
  template <typename T>
  __device__ __forceinline__ T operator()(int v, T x, Acc more = Acc(0)) const {
    Acc g = SOFTMAX ? exp_fast(to_acc(x) + coef) : Acc(0);
    if (v == blank) g -= sub_blank;
    if (v == label) g -= sub_label;
    g -= more;
    if (CLAMP) g = g > clamp ? clamp : (g < -clamp ? -clamp : g);
    return from_acc<T>(g * scale);
  }
};

// out's row = f(column, score) over the row's columns, as both gradient kernels write it (`loads`: whether the
// pass reads its row).
template <typename Pass, typename Out, typename F>
__device__ __forceinline__ void map_row(Pass& pass, Out& dst, bool loads, F f) {
  typedef typename Pass::VT VT;
  pass.for_each(loads, [&](int i, const VT& vt) {
    VT o;
#pragma unroll
    for (int j = 0; j < (int)(sizeof(VT) / sizeof(vt.v[0])); ++j) o.v[j] = f(pass.column(i, j), vt.v[j]);
    dst.put(i, o);
  });
  if (pass.col >= 0) dst.put_scalar(pass.col, f(pass.col, pass.x));
  dst.finish(pass.lane);
}

}  // namespace td
