// What the transducer kernels (stages.cu, pack.cu) share: where a row of the logits lives.
//
// The element types, conversions and math come from ops/numeric.cuh, the row -> utterance search
// from ragged/row_ids.cuh, the division by a per-utterance stride from ops/fast_divmod.cuh.
#pragma once

#include "ops/fast_divmod.cuh"
#include "ops/numeric.cuh"
#include "ragged/row_ids.cuh"

namespace td {

// The Layout table (transducer/layout.py): [T_b (B) | U_b (B) | row_strides (B) | row_splits (B + 1) | stats].
// Cell (b, t, u) is row row_splits[b] + t * row_strides[b] + u of the (N, V) logits.
struct Grids {
  const long long* __restrict__ table;
  int B;
  __device__ __forceinline__ long long T(int b) const { return table[b]; }
  __device__ __forceinline__ long long U(int b) const { return table[B + b]; }
  __device__ __forceinline__ long long stride(int b) const { return table[2 * B + b]; }
  __device__ __forceinline__ long long split(int b) const { return table[3 * B + b]; }  // b in [0, B]
  // (b, t, u) of row r (0 <= r < split(B)): b by a binary search over row_splits (B + 1 cached entries
  // stand in for a per-row index array: no launch and no N-sized buffer for it), t and u by a
  // FastDivmod of b's stride (clamped to >= 1).
  __device__ __forceinline__ void coordinates(int r, int& b, int& t, int& u) const {
    b = ragged::row_of(table + 3 * B, B, r);
    const long long st = stride(b);
    FastDivmod::make(st < 1 ? 1u : (unsigned int)st).divmod(r - (int)split(b), t, u);
  }
};

}  // namespace td
