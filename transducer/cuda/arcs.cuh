// What the RNN-T and TDT kernels read alike for a cell: the scores of its blank and label arcs (BlankAndLabel, the
// log-probs kernels) and its label's column (row_label, the row kernels). The terms formed from them are
// terms.cuh's.
#pragma once

#include "ops/numeric.cuh"
#include "transducer/cuda/layout.cuh"
#include "transducer/cuda/params.cuh"
#include "transducer/cuda/terms.cuh"

namespace td {

using namespace ops;

// The blank's and the label's scores of a row, as both log-probs kernels pick them: lane 0 loads them before
// the row's logsumexp (their latency overlaps it) and, once den is known, writes their log-probs lp[r]
// (token_log_probs: sigma, the delay penalty). The label's column is clamped into [0, V): with check_inputs the host
// checks the labels while the kernel runs.
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
  __device__ __forceinline__ void store(Acc* lp, long long r, const RowInfo& ri, Acc den, const Terms& terms,
                                        Acc bad = Acc(0)) const {
    const TokenLogProbs<Acc> v = token_log_probs(terms, x_blank, x_label, has_label, den, ri.t, ri.T, bad);
    lp[2 * r] = v.blank;
    lp[2 * r + 1] = v.label;
  }
};

// The label column of row r's cell, y_{u+1} for u < U_b, else -1 (the column the Hopper kernels' statistics pick).
template <typename I>
__device__ __forceinline__ int row_label(const RowInfo& ri, const Labels<I>& labels) {
  if (!ri.cell || ri.u >= ri.U || ri.u >= labels.cols) return -1;
  return (int)__ldg(labels.targets + (long long)ri.b * labels.cols + ri.u);
}

}  // namespace td
