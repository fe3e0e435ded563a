// Where a row of the logits lives, on the device: the Layout table of transducer/layout.py (Grids), the cell of
// a row (RowInfo), and the utterance of a walk's block (WalkBlock). Shared by stages.cu, tdt.cu and pack.cu.
//
// The row -> utterance search comes from ragged/row_ids.cuh, the division by a per-utterance stride from
// ops/fast_divmod.cuh.
#pragma once

#include "ops/fast_divmod.cuh"
#include "ops/numeric.cuh"
#include "ragged/row_ids.cuh"

namespace td {

using namespace ops;

// The padded layout's grid, made by the host (transducer/cuda/stages.py): rows per utterance (maxT * (maxU + 1))
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

// CUDA's limit of threads per block: the walks' blocks (a thread per u, up to this many) and layout_kernel's
// one block (transducer/cuda/stages.py: MAX_BLOCK_THREADS)
constexpr int kMaxBlockThreads = 1024;

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

}  // namespace td
