// The pass over one row of the logits that the per-row kernels (log-probs, gradient) make: RowPass reads a row's
// columns in 16-byte vectors, some lanes of a warp, a warp or a block a row (RowGeometry), RowOut writes the
// gradient's row, map_row joins them.
//
// The element types, conversions and math come from ops/numeric.cuh, the logsumexp states from ops/reduce.cuh.
#pragma once

#include "ops/numeric.cuh"
#include "ops/reduce.cuh"
#include "transducer/cuda/layout.cuh"
#include "transducer/cuda/params.cuh"

namespace td {

using namespace ops;

constexpr int kThreads = 256;  // block size of the per-row kernels (transducer/cuda/stages.py: THREADS)
constexpr int kUnroll = 4;     // vectors in flight per thread and loop trip (RowPass: 2 for 8-wide vectors)

// The threads of a row, TPR: a group of 8 or 16 lanes of a warp (4 or 2 rows a warp), a warp, or a block of
// kThreads (transducer/cuda/stages.py's _row_pass picks one: threads_per_row's, more where the pass gives lanes
// work of their own; tests/test_kernel_params.py checks they pick no other). A short row's fixed work (its
// utterance's search, the label's load, the merge of its state, the stores) is then done once for 32 / TPR rows by
// each warp instruction, instead of once for one row.
template <int TPR>
struct RowGeometry {
  static_assert(TPR == 8 || TPR == 16 || TPR == 32 || TPR == kThreads, "8, 16 or 32 lanes or one block per row");
  static constexpr int G = TPR;                                          // threads per row
  static constexpr int LOG_G = TPR == 8 ? 3 : TPR == 16 ? 4 : TPR == 32 ? 5 : 8;
  static_assert(1 << LOG_G == G, "LOG_G: log2 of the threads per row");
  static constexpr int RPB = kThreads / G;                               // rows per block
  static constexpr bool IN_WARP = G <= 32;                               // a row's threads are lanes of one warp
  // the lanes of the calling thread's row within its warp (its shuffles' and syncs' mask: the rows of a warp
  // may part ways, a padding row's lanes returning early)
  static __device__ __forceinline__ unsigned int lanes() {
    return G >= 32 ? 0xffffffffu : ((1u << G) - 1u) << ((threadIdx.x & 31) & ~(G - 1));
  }
  // every thread of the row at one point
  static __device__ __forceinline__ void sync() {
    if (IN_WARP)
      __syncwarp(lanes());
    else
      __syncthreads();
  }
};

// One row of the logits, read by a group of G threads in VEC-wide vectors, UNROLL vectors in flight
// per thread: what log_probs and gradient share. READ_ONLY: no thread writes the rows while the kernel
// runs (the log-probs kernels; a gradient may overwrite them), so they are loaded through ldg.
// ALIGNED: every row starts on a VEC boundary (the launcher checked the base and the row stride), `n` of
// begin() is the row's vectors. Otherwise (NeMo's TDT joint:
// V + D = 1029 scores a row) `n` is the row's columns: the first `head` columns up to the row's first
// VEC boundary and the `tail` columns after its last whole vector are one scalar each for the first
// head + tail (<= 2 VEC - 2; VEC - 1 where every row starts on a VEC boundary) threads of the row (the launcher
// gives it that many at least: stages.unaligned_scalars), and the vectors
// between them are read as when aligned.
// `logits` holds the rows [row_start, row_start + num_rows) of the layout (all of them, or a tile of
// the fused joiner loss), `ld` apart (struct Rows); the per-row arrays (lp, den, alpha, beta) are indexed by the row of
// the layout. In the compact layout the first vectors are
// loaded before the row's (b, t, u) is known (`early`): they depend on r alone, so the search for b
// and the loads of strides, lengths and targets overlap them instead of delaying them.
template <typename T, int VEC, int TPR, bool ALIGNED = true, int DEEP = kUnroll, bool READ_ONLY = false>
struct RowPass {
  typedef RowGeometry<TPR> Geo;
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

  // false for the threads past the last row (uniform per row: over the block when a block takes a row)
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
  // logsumexp of the row's scores (a row in a warp: each of its lanes gets it; a block per row: warp 0 does).
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
    if (Geo::IN_WARP) {
      lse = warp_merge<kLogSumExp, Acc, FastExp, true, Geo::IN_WARP ? Geo::G : 32>(lse, Geo::lanes());
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
template <typename T, int VEC, int TPR, bool STAGED>
struct RowOut {
  typedef RowGeometry<TPR> Geo;
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
    Geo::sync();
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
