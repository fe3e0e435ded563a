// What the RNN-T and TDT kernels compute alike for a cell: the log-probs of its blank and label arcs
// (BlankAndLabel, the log-probs kernels), the posteriors of its RNN-T arcs (rnnt_arcs) and a token score's
// gradient from them (TokenGradient, the gradient kernels).
#pragma once

#include "ops/numeric.cuh"
#include "transducer/cuda/layout.cuh"
#include "transducer/cuda/params.cuh"

namespace td {

using namespace ops;

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

// A posterior's log, alpha + [arc] + beta - log Z, capped at 0 (a NaN stays NaN), and the posterior: its rounding
// (|log Z| ulps) can exceed 0 where |log Z| * eps > 1 (fp32 logits of about 1e10), and exp of it would overflow
// and give the gradient inf - inf or 0 * inf (transducer/cpu/stages.py's _posterior caps it alike).
template <typename Acc>
__device__ __forceinline__ Acc log_posterior(Acc x) { return x > Acc(0) ? Acc(0) : x; }
template <typename Acc>
__device__ __forceinline__ Acc posterior(Acc x) { return exp_acc(log_posterior(x)); }

// The posterior of a blank arc of duration d >= 2 leaving row r's cell (to (t + d, u), or the end from (T - d, U)),
// whose log-prob is lp_arc, with lognorm = alpha(r) + loss: the multi-blank loss's big blank arcs (gradient_kernel,
// row_coefficients_kernel).
template <typename Acc>
__device__ __forceinline__ Acc big_blank_arc(const ReadOnly<Acc>& beta, Acc lp_arc, int d, long long r,
                                             const RowInfo& ri, Acc lognorm) {
  const int s = ri.t + d;
  const Acc after = s < ri.T ? beta[r + (long long)d * ri.st] : (s == ri.T && ri.u == ri.U ? Acc(0) : neg_inf<Acc>());
  return posterior(lognorm + lp_arc + after);
}

// The label column of row r's cell, y_{u+1} for u < U_b, else -1 (the column the Hopper kernels' statistics pick).
template <typename I>
__device__ __forceinline__ int row_label(const RowInfo& ri, const Labels<I>& labels) {
  if (!ri.cell || ri.u >= ri.U || ri.u >= labels.cols) return -1;
  return (int)__ldg(labels.targets + (long long)ri.b * labels.cols + ri.u);
}

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
  a.log_gamma = log_posterior(lognorm + beta[r]);
  const Acc after_blank = ri.t + 1 < ri.T ? beta[r + st] : (ri.u == ri.U ? Acc(0) : NINF);
  a.blank = posterior(lognorm + lp_blank + after_blank);
  a.label = Acc(0);
  if (ri.u < ri.U) {
    const Acc after_label = RNA ? (ri.t + 1 < ri.T ? beta[r + st + 1] : NINF) : beta[r + 1];
    a.label = posterior(lognorm + lp_label + after_label);
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

}  // namespace td
