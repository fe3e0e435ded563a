// The per-row terms of transducer/cuda/terms.cuh, compiled as host C++ (tests/test_terms.py builds this file with
// the C++ compiler and loads it with ctypes): each function below walks the rows of a batch as a kernel does and
// forms every value from terms.cuh's functions, in float64.

#include "transducer/cuda/terms.cuh"

using td::Terms;

namespace {

// A cell as layout.cuh's RowInfo gives it to the kernels.
struct Row {
  int t, u, T, U, st;
};

Row row_of(const int* cells, long long r) {
  const int* c = cells + 5 * r;
  return Row{c[0], c[1], c[2], c[3], c[4]};
}

template <bool RNA, bool SOFTMAX, bool CLAMP>
void rnnt_gradient_rows(const Terms& o, long long n, int V, int blank, const double* x, const double* den,
                        const double* lp, const double* alpha, const double* beta, const double* loss,
                        const double* scale, const int* cells, const int* labels, const int* live, int K,
                        const int* big_durations, const double* lp_arcs, double* grad, double* coefficients) {
  for (long long r = 0; r < n; ++r) {
    double* g = grad + r * V;
    double* c = coefficients + r * (5 + K);
    if (!live[r]) {
      for (int v = 0; v < V; ++v) g[v] = 0.0;
      for (int i = 0; i < 5 + K; ++i) c[i] = 0.0;
      continue;
    }
    const Row ri = row_of(cells, r);
    const double lognorm = alpha[r] + loss[r];
    const td::RnntArcs<double> arcs = td::rnnt_arcs<double, RNA>(beta, r, ri, lognorm, lp[2 * r], lp[2 * r + 1]);
    const td::TokenTerms<double> terms = td::rnnt_token_terms(o, arcs);
    const td::TokenGradient<double, SOFTMAX, CLAMP> token =
        td::token_gradient<double, SOFTMAX, CLAMP>(o, terms, SOFTMAX ? den[r] : 0.0, scale[r], blank, labels[r]);
    double big[16] = {0.0};
    for (int i = 0; i < K; ++i) big[i] = td::big_blank_arc(beta, lp_arcs[r * K + i], big_durations[i], r, ri, lognorm);
    for (int v = 0; v < V; ++v) {
      const int i = blank - 1 - v;
      g[v] = token(v, x[r * V + v], i >= 0 && i < K ? big[i] : 0.0);
    }
    // the Hopper path's row coefficients (row_coefficients_kernel)
    c[0] = den[r];
    c[1] = terms.factor;
    c[2] = terms.sub_blank;
    c[3] = terms.sub_label;
    c[4] = scale[r];
    for (int i = 0; i < K; ++i) c[4 + K - i] = big[i];
  }
}

template <bool OMEGA, bool CLAMP>
void tdt_gradient_rows(const Terms& o, long long n, int V, int D, int blank, const double* x, const double* den,
                       const double* lp, const double* lp_arcs, const double* alpha, const double* beta,
                       const double* loss, const double* alpha_r, const double* beta_r, const double* loss_r,
                       const double* scale, const int* cells, const int* labels, const int* live,
                       const int* durations, double* grad, double* grad_durations, double* coefficients) {
  for (long long r = 0; r < n; ++r) {
    double* g = grad + r * V;
    double* gd = grad_durations + r * D;
    double* c = coefficients + r * 5;
    if (!live[r]) {
      for (int v = 0; v < V; ++v) g[v] = 0.0;
      for (int k = 0; k < D; ++k) gd[k] = 0.0;
      for (int i = 0; i < 5; ++i) c[i] = 0.0;
      continue;
    }
    const Row ri = row_of(cells, r);
    const double lognorm = alpha[r] + loss[r];
    const double gamma = td::cell_posterior(beta, r, lognorm);
    const double lp_b = lp[2 * r], lp_l = lp[2 * r + 1];
    double sum_blank = 0.0, sum_label = 0.0;
    for (int k = 0; k < D; ++k) {
      const td::TdtArcPair<double> arc = td::tdt_arcs(beta, lp_arcs[r * D + k], durations[k], r, ri, lognorm, lp_b, lp_l);
      sum_blank += arc.blank;
      sum_label += arc.label;
    }
    const td::TokenTerms<double> terms = td::tdt_token_terms<double, OMEGA>(o, gamma, sum_blank, sum_label, beta_r,
                                                                            alpha_r, loss_r[r], r, ri, lp_b, lp_l);
    const td::TokenGradient<double, true, CLAMP> token =
        td::token_gradient<double, true, CLAMP>(o, terms, den[r], scale[r], blank, labels[r]);
    for (int v = 0; v < V; ++v) g[v] = token(v, x[r * V + v]);
    for (int k = 0; k < D; ++k) {
      const td::TdtArcPair<double> arc = td::tdt_arcs(beta, lp_arcs[r * D + k], durations[k], r, ri, lognorm, lp_b, lp_l);
      gd[k] = td::duration_gradient(o, lp_arcs[r * D + k], gamma, arc.blank + arc.label, scale[r]);
    }
    c[0] = den[r];
    c[1] = terms.factor;
    c[2] = terms.sub_blank;
    c[3] = terms.sub_label;
    c[4] = scale[r];
  }
}

}  // namespace

extern "C" {

// lp (n, 2) of the cells from their blank's and label's scores and their row's logsumexp; lp_arcs (n, K) of the
// big blanks (or the durations when `durations`, with den_arcs the logsumexp of the duration scores).
void token_log_probs(const Terms* o, long long n, const double* x_blank, const double* x_label,
                     const int* has_label, const double* den, const int* cells, double* lp) {
  for (long long r = 0; r < n; ++r) {
    const Row ri = row_of(cells, r);
    const td::TokenLogProbs<double> v =
        td::token_log_probs(*o, x_blank[r], x_label[r], has_label[r] != 0, den[r], ri.t, ri.T);
    lp[2 * r] = v.blank;
    lp[2 * r + 1] = v.label;
  }
}

void arc_log_probs(const Terms* o, long long n, int K, int durations, const double* x, const double* den,
                   double* lp_arcs) {
  for (long long r = 0; r < n; ++r)
    for (int i = 0; i < K; ++i)
      lp_arcs[r * K + i] = durations ? td::duration_log_prob(x[r * K + i], den[r], 0.0)
                                     : td::big_blank_log_prob(*o, x[r * K + i], den[r]);
}

void rnnt_gradient(const Terms* o, int rna, int softmax, int clamp, long long n, int V, int blank, const double* x,
                   const double* den, const double* lp, const double* alpha, const double* beta, const double* loss,
                   const double* scale, const int* cells, const int* labels, const int* live, int K,
                   const int* big_durations, const double* lp_arcs, double* grad, double* coefficients) {
#define ROWS(R, S, C)                                                                                          \
  rnnt_gradient_rows<R, S, C>(*o, n, V, blank, x, den, lp, alpha, beta, loss, scale, cells, labels, live, K, \
                              big_durations, lp_arcs, grad, coefficients)
  const int which = (rna ? 4 : 0) + (softmax ? 2 : 0) + (clamp ? 1 : 0);
  switch (which) {
    case 0: ROWS(false, false, false); break;
    case 1: ROWS(false, false, true); break;
    case 2: ROWS(false, true, false); break;
    case 3: ROWS(false, true, true); break;
    case 4: ROWS(true, false, false); break;
    case 5: ROWS(true, false, true); break;
    case 6: ROWS(true, true, false); break;
    default: ROWS(true, true, true); break;
  }
#undef ROWS
}

void tdt_gradient(const Terms* o, int omega, int clamp, long long n, int V, int D, int blank, const double* x,
                  const double* den, const double* lp, const double* lp_arcs, const double* alpha, const double* beta,
                  const double* loss, const double* alpha_r, const double* beta_r, const double* loss_r,
                  const double* scale, const int* cells, const int* labels, const int* live, const int* durations,
                  double* grad, double* grad_durations, double* coefficients) {
#define ROWS(W, C)                                                                                               \
  tdt_gradient_rows<W, C>(*o, n, V, D, blank, x, den, lp, lp_arcs, alpha, beta, loss, alpha_r, beta_r, loss_r, \
                          scale, cells, labels, live, durations, grad, grad_durations, coefficients)
  if (omega && clamp) ROWS(true, true);
  else if (omega) ROWS(true, false);
  else if (clamp) ROWS(false, true);
  else ROWS(false, false);
#undef ROWS
}

}  // extern "C"
