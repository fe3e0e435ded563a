// The lattices' per-row terms, each written once: the log-probs of a cell's arcs (sigma, k2's delay penalty, the big
// blanks, TDT's durations), the posteriors of its arcs (blank and label, the big blanks', TDT's per duration), the
// softmax term's factor and the arcs' shares of a token score's gradient (FastEmit, TDT's omega), a token score's
// gradient (the clamp, the incoming scale) and a duration score's. Every kernel that forms one of them calls these
// functions with the options struct Terms, taken whole from its parameter struct, so that no kernel applies a term
// of its own or leaves one out: the stage kernels (stages.cu, tdt.cu) and the Hopper path's row kernels alike.
//
// The functions are __host__ __device__ and need nothing else from CUDA: tests/test_terms.py compiles this header
// as host C++ and checks them against the CPU stages for every option. On the device their math is
// ops/numeric.cuh's; in host C++, <math.h>'s.
#pragma once

#if defined(__CUDACC__)
#include "ops/numeric.cuh"
#define TD_TERM __host__ __device__ __forceinline__
#else
#include <math.h>
#define TD_TERM inline
#endif

namespace td {

// The options the terms read (transducer/cuda/stages.py: TERMS), one field each, in the parameter struct of every
// kernel that forms a term.
struct Terms {
  double sigma;            // subtracted from every token log-prob (TDT and multi-blank; 0 for RNN-T)
  double delay_penalty;    // k2's delay penalty: delay_penalty * ((T_b - 1) / 2 - t) on a label log-prob
  double fastemit_lambda;  // FastEmit (Yu et al. 2021): a label log-prob's gradient scaled by 1 + lambda
  double omega;            // TDT: the weight of the plain RNN-T loss in (1 - omega) tdt + omega rnnt
  double clamp;            // the token gradient clamped to [-clamp, clamp] (kernels instantiated with CLAMP; > 0)
};

// The math of the terms: ops/numeric.cuh's functions on the device, the same functions of <math.h> on the host.
namespace hd {
TD_TERM float exp_acc(float x) {
#if defined(__CUDA_ARCH__)
  return ops::exp_acc(x);
#else
  return expf(x);
#endif
}
TD_TERM double exp_acc(double x) {
#if defined(__CUDA_ARCH__)
  return ops::exp_acc(x);
#else
  return exp(x);
#endif
}
TD_TERM float log_acc(float x) {
#if defined(__CUDA_ARCH__)
  return ops::log_acc(x);
#else
  return logf(x);
#endif
}
TD_TERM double log_acc(double x) {
#if defined(__CUDA_ARCH__)
  return ops::log_acc(x);
#else
  return log(x);
#endif
}
TD_TERM float exp_fast(float x) {
#if defined(__CUDA_ARCH__)
  return ops::exp_fast(x);
#else
  return expf(x);
#endif
}
TD_TERM double exp_fast(double x) {
#if defined(__CUDA_ARCH__)
  return ops::exp_fast(x);
#else
  return exp(x);
#endif
}
template <typename A>
TD_TERM A neg_inf() {
#if defined(__CUDA_ARCH__)
  return ops::neg_inf<A>();
#else
  return A(-__builtin_huge_val());
#endif
}
}  // namespace hd

// ------------------------------------------------------------------------------------------------- log-probs

// The blank's and the label's log-probs of a cell of frame t (of T) from their scores and the row's logsumexp den:
// x_blank - den - sigma and x_label - den - sigma + delay_penalty * ((T - 1) / 2 - t), -inf without a label.
// `bad`: 0, or NaN to make both NaN.
template <typename Acc>
struct TokenLogProbs {
  Acc blank, label;
};

template <typename Acc>
TD_TERM TokenLogProbs<Acc> token_log_probs(const Terms& o, Acc x_blank, Acc x_label, bool has_label, Acc den, int t,
                                           int T, Acc bad = Acc(0)) {
  const Acc sigma = Acc(o.sigma);
  const Acc penalty = Acc(o.delay_penalty) * (Acc(0.5) * (T - 1) - t);
  TokenLogProbs<Acc> lp;
  lp.blank = x_blank - den - sigma + bad;
  lp.label = has_label ? x_label - den - sigma + penalty + bad : hd::neg_inf<Acc>();
  return lp;
}

// The log-prob of a big blank (the multi-blank loss) from its score: x - den - sigma.
template <typename Acc>
TD_TERM Acc big_blank_log_prob(const Terms& o, Acc x, Acc den) {
  return x - den - Acc(o.sigma);
}

// The log-prob of a TDT duration from its score and the logsumexp den of the row's duration scores (`bad` as for
// token_log_probs).
template <typename Acc>
TD_TERM Acc duration_log_prob(Acc x, Acc den, Acc bad) {
  return x - den + bad;
}

// ------------------------------------------------------------------------------------------- arc posteriors
//
// `beta` (and `alpha`): a walk's values by row (ReadOnly on the device, a pointer on the host); `ri`: the cell of
// row r, with t, T, u, U and st (the row stride of t), layout.cuh's RowInfo on the device; lognorm = alpha(r) + loss.

// A posterior's log, alpha + [arc] + beta - log Z, capped at 0 (a NaN stays NaN), and the posterior: its rounding
// (|log Z| ulps) can exceed 0 where |log Z| * eps > 1 (fp32 logits of about 1e10), and exp of it would overflow
// and give the gradient inf - inf or 0 * inf (transducer/cpu/stages.py's _posterior caps it alike).
template <typename Acc>
TD_TERM Acc log_posterior(Acc x) { return x > Acc(0) ? Acc(0) : x; }
template <typename Acc>
TD_TERM Acc posterior(Acc x) { return hd::exp_acc(log_posterior(x)); }

// The posterior of the cell of row r: exp(lognorm + beta(r)) (TDT's gamma).
template <typename Acc, typename Walk>
TD_TERM Acc cell_posterior(const Walk& beta, long long r, Acc lognorm) {
  return posterior(lognorm + beta[r]);
}

// The RNN-T arcs leaving the cell of row r: the log of the cell's posterior, lognorm + beta(r), and the posteriors
// of its blank arc (to (t + 1, u), or the end from (T - 1, U)) and its label arc (to (t, u + 1); RNA: (t + 1, u +
// 1)), whose log-probs are lp_blank and lp_label. Also TDT's omega term (tdt_token_terms).
template <typename Acc>
struct RnntArcs {
  Acc log_gamma, blank, label;
};

template <typename Acc, bool RNA, typename Walk, typename Row>
TD_TERM RnntArcs<Acc> rnnt_arcs(const Walk& beta, long long r, const Row& ri, Acc lognorm, Acc lp_blank,
                                Acc lp_label) {
  const Acc NINF = hd::neg_inf<Acc>();
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

// The posterior of a blank arc of duration d >= 2 leaving row r's cell (to (t + d, u), or the end from (T - d, U)),
// whose log-prob is lp_arc: the multi-blank loss's big blank arcs.
template <typename Acc, typename Walk, typename Row>
TD_TERM Acc big_blank_arc(const Walk& beta, Acc lp_arc, int d, long long r, const Row& ri, Acc lognorm) {
  const int s = ri.t + d;
  const Acc after = s < ri.T ? beta[r + (long long)d * ri.st]
                             : (s == ri.T && ri.u == ri.U ? Acc(0) : hd::neg_inf<Acc>());
  return posterior(lognorm + lp_arc + after);
}

// The posteriors of TDT's two arcs of duration d leaving the cell of row r (blank: to (t + d, u), or the end from
// (T - d, U), none for d = 0; label: to (t + d, u + 1)), whose token log-probs are lp_b and lp_l and duration
// log-prob lp_dur.
template <typename Acc>
struct TdtArcPair {
  Acc blank, label;
};

template <typename Acc, typename Walk, typename Row>
TD_TERM TdtArcPair<Acc> tdt_arcs(const Walk& beta, Acc lp_dur, int d, long long r, const Row& ri, Acc lognorm,
                                 Acc lp_b, Acc lp_l) {
  TdtArcPair<Acc> a{Acc(0), Acc(0)};
  const int s = ri.t + d;
  const long long st = ri.st;
  const Acc w = lognorm + lp_dur;
  if (d >= 1) {
    if (s < ri.T)
      a.blank = posterior(w + lp_b + beta[r + d * st]);
    else if (s == ri.T && ri.u == ri.U)
      a.blank = posterior(w + lp_b);
  }
  if (ri.u < ri.U && s < ri.T) a.label = posterior(w + lp_l + beta[r + d * st + 1]);
  return a;
}

// ------------------------------------------------------------------------------------------ gradient terms

// A row's terms of its token scores' gradient g_v = softmax_v * factor - [v == blank] sub_blank - [v == label]
// sub_label: the gradient kernels take log_factor (TokenGradient's coef, less den), the row coefficients kernels
// factor.
template <typename Acc>
struct TokenTerms {
  Acc factor, log_factor, sub_blank, sub_label;
};

// RNN-T, RNA and multi-blank, from the cell's arcs: factor = gamma + lambda * label, sub_blank = blank, sub_label =
// (1 + lambda) label (FastEmit; log_factor is log gamma itself when lambda = 0).
template <typename Acc>
TD_TERM TokenTerms<Acc> rnnt_token_terms(const Terms& o, const RnntArcs<Acc>& a) {
  const Acc lambda = Acc(o.fastemit_lambda);
  TokenTerms<Acc> t;
  t.factor = hd::exp_acc(a.log_gamma) + lambda * a.label;
  t.log_factor = lambda == Acc(0) ? a.log_gamma : hd::log_acc(t.factor);
  t.sub_blank = a.blank;
  t.sub_label = (Acc(1) + lambda) * a.label;
  return t;
}

// TDT, from the cell's posterior gamma and its arcs' sums over the durations, weighted (1 - omega), and with OMEGA
// the plain RNN-T loss's (walks alpha_r, beta_r, loss l_r over the log-probs lp + sigma), weighted omega;
// FastEmit's lambda in both.
template <typename Acc, bool OMEGA, typename Walk, typename Row>
TD_TERM TokenTerms<Acc> tdt_token_terms(const Terms& o, Acc gamma, Acc sum_blank, Acc sum_label, const Walk& beta_r,
                                        const Walk& alpha_r, Acc l_r, long long r, const Row& ri, Acc lp_b,
                                        Acc lp_l) {
  const Acc lam = Acc(o.fastemit_lambda), omega = Acc(o.omega), sigma = Acc(o.sigma);
  const Acc keep = Acc(1) - omega;
  TokenTerms<Acc> t;
  t.factor = keep * (gamma + lam * sum_label);
  t.sub_blank = keep * sum_blank;
  t.sub_label = keep * sum_label;
  if (OMEGA) {
    const RnntArcs<Acc> rnnt = rnnt_arcs<Acc, false>(beta_r, r, ri, alpha_r[r] + l_r, lp_b + sigma, lp_l + sigma);
    t.factor += omega * (hd::exp_acc(rnnt.log_gamma) + lam * rnnt.label);
    t.sub_blank += omega * rnnt.blank;
    t.sub_label += omega * rnnt.label;
  }
  t.sub_label *= Acc(1) + lam;
  t.log_factor = hd::log_acc(t.factor);
  return t;
}

// The gradient of one token score x of a row: g = exp(x + coef) (SOFTMAX) - [v == blank] sub_blank - [v == label]
// sub_label - `more` (multi-blank's big blank arcs), clamped to [-clamp, clamp] (CLAMP), times the incoming scale.
template <typename Acc, bool SOFTMAX, bool CLAMP>
struct TokenGradient {
  Acc coef, sub_blank, sub_label, clamp, scale;
  int blank, label;
  TD_TERM Acc operator()(int v, Acc x, Acc more = Acc(0)) const {
    Acc g = SOFTMAX ? hd::exp_fast(x + coef) : Acc(0);
    if (v == blank) g -= sub_blank;
    if (v == label) g -= sub_label;
    g -= more;
    if (CLAMP) g = g > clamp ? clamp : (g < -clamp ? -clamp : g);
    return g * scale;
  }
};

// The TokenGradient of a row from its terms, its logsumexp den (unused without SOFTMAX), the incoming scale and
// its blank's and label's columns (label -1: none).
template <typename Acc, bool SOFTMAX, bool CLAMP>
TD_TERM TokenGradient<Acc, SOFTMAX, CLAMP> token_gradient(const Terms& o, const TokenTerms<Acc>& t, Acc den,
                                                          Acc scale, int blank, int label) {
  TokenGradient<Acc, SOFTMAX, CLAMP> g;
  g.coef = SOFTMAX ? t.log_factor - den : Acc(0);
  g.sub_blank = t.sub_blank;
  g.sub_label = t.sub_label;
  g.clamp = Acc(o.clamp);
  g.scale = scale;
  g.blank = blank;
  g.label = label;
  return g;
}

// The gradient of a TDT duration score of log-prob lp_dur: (1 - omega) (exp(lp_dur) gamma - own) times the incoming
// scale, `own` being the posteriors of the duration's two arcs (not clamped: NeMo's TDT clamp bounds the token
// scores' gradient only).
template <typename Acc>
TD_TERM Acc duration_gradient(const Terms& o, Acc lp_dur, Acc gamma, Acc own, Acc scale) {
  const Acc keep = Acc(1) - Acc(o.omega);
  return keep * (hd::exp_acc(lp_dur) * gamma - own) * scale;
}

}  // namespace td
