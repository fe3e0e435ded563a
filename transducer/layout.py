"""Where cell (b, t, u) of each utterance's (T_b, U_b + 1) grid lives in the logits.

Both logits layouts are seen as a 2-D tensor ``logits2d`` of shape (N, V):

- compact ``(sum_b T_b*(U_b+1), V)``: N = sum_b T_b*(U_b+1), every row is a cell;
- padded ``(B, maxT, maxU+1, V)`` viewed as ``(B*maxT*(maxU+1), V)``: rows with
  t >= T_b or u > U_b are padding.

In both, cell (b, t, u) is row ``cell_offsets[b] + t * row_strides[b] + u``
(compact: offsets = row_splits[:-1], strides = U_b + 1; padded: offsets =
b*maxT*(maxU+1), strides = maxU + 1), and ``row_ids[r]`` is the utterance of
row r. So one set of stages (log-probs, alpha/beta, gradient) serves both
layouts, and per-row arrays (log-probs, alpha, beta) are indexed like the rows
of ``logits2d``; on padding rows they hold unspecified values that no stage reads.

The stage contract, shared by ``transducer.cpu`` and ``transducer.cuda``
(same names, same arguments, same results):

``log_probs(logits2d, targets, layout, blank, from_log_softmax) -> (lp, den)``
    lp (N, 2): lp[r, 0] = log P(blank | cell r), lp[r, 1] = log P(y_u | cell r)
    for u < U_b (-inf for u == U_b); den (N,) = logsumexp_v logits2d[r]
    (zeros when ``from_log_softmax``). float32, or float64 for float64 logits.
``alpha_beta(lp, layout, one_sym_per_frame) -> (alpha, beta, loss)``
    alpha, beta (N,) in lp's dtype, -inf at unreachable cells; loss (B,) =
    -beta(b, 0, 0), +inf where no alignment exists.
``gradient(logits2d, targets, layout, lp, den, alpha, beta, loss, scale, blank,
           from_log_softmax, one_sym_per_frame, out) -> out``
    Writes into ``out`` (N, V), logits' dtype, the gradient of
    sum_b scale[b] * loss[b] with respect to logits2d; zeros on padding rows
    and for utterances whose loss is not finite or whose scale is 0. ``out``
    may be ``logits2d`` itself (each element is read before it is written).
"""

from typing import NamedTuple

import torch


class Layout(NamedTuple):
    logit_lengths: torch.Tensor   # (B,) int64, T_b
    target_lengths: torch.Tensor  # (B,) int64, U_b
    cell_offsets: torch.Tensor    # (B,) int64, row of cell (b, 0, 0)
    row_strides: torch.Tensor     # (B,) int64, rows between (b, t, u) and (b, t+1, u)
    row_ids: torch.Tensor         # (N,) int32, utterance of each row
    padded: bool                  # True when some rows may be padding
    max_u1: int                   # host-side bound on U_b + 1 (padded: logits.size(2); compact: targets.size(1) + 1)
