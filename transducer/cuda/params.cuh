// The parts of the kernels' parameter structs (CUTLASS's Params pattern: a kernel takes one struct, which
// transducer/cuda/stages.py fills by field name; tests/test_kernel_params.py checks both sides list the same
// fields). Each kernel's own struct is defined beside it, in stages.cu, tdt.cu or pack.cu.
#pragma once

namespace td {

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

// The D duration scores of each row: `ld` elements apart from `data`, the rows of the token scores'.
template <typename T>
struct DurationRows {
  const T* data;
  long long ld;
  int D;
};

// The labels: y_{u+1} of utterance b is targets[b * cols + u]; the blank's column.
template <typename I>
struct Labels {
  const I* targets;
  int cols;
  int blank;
};

// What forward kept for the gradient (transducer/lattices.py's Lattice): per row lp (N, 2), den (N,), alpha and
// beta (N,); per utterance nll (B,).
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

}  // namespace td
