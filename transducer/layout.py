"""Where cell (b, t, u) of each utterance's (T_b, U_b + 1) grid lives in the logits.

Both logits layouts are seen as a 2-D tensor ``logits2d`` of shape (N, V):

- compact ``(sum_b T_b*(U_b+1), V)``: N = sum_b T_b*(U_b+1), every row is a cell;
- padded ``(B, maxT, maxU+1, V)`` viewed as ``(B*maxT*(maxU+1), V)``: rows with
  t >= T_b or u > U_b are padding.

In both, cell (b, t, u) is row ``row_splits[b] + t * row_strides[b] + u``
(compact: row_splits = exclusive cumsum of T_b*(U_b+1), strides = U_b + 1;
padded: row_splits[b] = b*maxT*(maxU+1), strides = maxU + 1), and the rows of
utterance b are ``row_splits[b] <= r < row_splits[b+1]``: kernels find b by a
binary search (compact) or one division by maxT*(maxU+1) (padded; common.cuh's
PaddedGrid), so no per-row index array exists. One set of stages (log-probs,
alpha/beta, gradient) serves both layouts, and per-row arrays (log-probs,
alpha, beta) are indexed like the rows of ``logits2d``; on padding rows they
hold unspecified values that no stage reads.

The stage contract, shared by ``transducer.cpu`` and ``transducer.cuda``
(same names, same arguments, same results):

``layout(logit_lengths, target_lengths, max_u1, padded_t=0, targets=None, vocab_size=0, blank=0,
         with_stats=True) -> Layout``
    One pass over the lengths (one launch on CUDA, no host synchronisation):
    padded (B, padded_t, max_u1) grids when ``padded_t > 0``, compact ones
    otherwise. With ``with_stats``, ``Layout.stats`` holds what the value checks
    need (see ``Layout``); ``targets`` (B, S) are then checked against
    ``[0, vocab_size)`` and ``blank``.
``log_probs(logits2d, targets, layout, blank, from_log_softmax, delay_penalty=0.0, row_start=0, out=None)
-> (lp, den)``
    lp (N, 2): lp[r, 0] = log P(blank | cell r), lp[r, 1] = log P(y_u | cell r)
    for u < U_b (-inf for u == U_b), plus k2's delay penalty
    ``delay_penalty * ((T_b - 1) / 2 - t)``; den (N,) = logsumexp_v logits2d[r]
    (zeros when ``from_log_softmax``); a NaN or infinite logit makes den NaN. float32,
    or float64 for float64 logits. With ``row_start``, logits2d holds the rows
    [row_start, row_start + N) of the layout and ``out`` = (lp, den) of every row
    is written there (the fused joiner loss's tiles; row_start > 0 needs out).
``alpha_beta(lp, layout, one_sym_per_frame) -> (alpha, beta, loss)``
    alpha, beta (N,) in lp's dtype, -inf at unreachable cells; loss (B,) =
    -beta(b, 0, 0), +inf where no alignment exists, NaN where lp has a NaN.
``gradient(logits2d, targets, layout, lp, den, alpha, beta, loss, scale, blank,
           from_log_softmax, one_sym_per_frame, out, fastemit_lambda=0.0, clamp=0.0, row_start=0) -> out``
    Writes into ``out`` (N, V), logits' dtype, the gradient of
    sum_b scale[b] * loss[b] with respect to logits2d (FastEmit's ``fastemit_lambda``
    on the label arcs; each element clamped to [-clamp, clamp] for a unit scale when
    clamp > 0); ``scale`` is (B,) in lp's dtype, any stride (an expanded scalar is
    fine). Zeros on padding rows and for utterances whose loss is not finite or whose
    scale is 0. ``out`` may be ``logits2d`` itself (each element is read before it
    is written), or rows of another stride (unit column stride). With ``row_start``,
    logits2d and out are the rows [row_start, row_start + N); lp, den, alpha and
    beta hold every row.
``gradient_row_width(V, itemsize) -> int``
    The row width of a new gradient buffer for V-wide logits that an op made (V, or
    V padded so that the op's backward GEMMs read it faster; the gradient is then a
    view of its first V columns).
``pack_forward(encoder_out, predictor_out, layout, num_rows, row_start=0, activation="identity", out=None)``
(``out``: a (num_rows, J) destination with unit column stride, such as the first J columns of a wider
matrix), ``pack_backward(grad_out, layout, max_t, max_u1)`` and
``pack_backward_add(grad_rows, layout, row_start, utterances, grad_enc, grad_pred, inputs=None,
activation="identity")`` (``inputs`` = (encoder_out, predictor_out) of grad_rows' dtype, from which the
activation's derivative is recomputed): see ``transducer.pack`` and ``transducer.cpu``.
``tdt_log_probs``, ``tdt_alpha_beta``, ``tdt_gradient``: the TDT stages; the contract is
their docstrings in ``transducer.cpu``.
"""

from typing import NamedTuple

import torch

NUM_STATS = 6
#: The cell count in ``Layout.stats`` saturates here: lengths whose products or sum overflow 64 bits
#: read as this value instead of wrapping into a plausible count (stages.cu: kCellsCap).
CELLS_CAP = 1 << 61
#: Kernels index rows in 32 bits: the (N, V) logits may have at most this many rows.
MAX_ROWS = (1 << 31) - 1


class Layout(NamedTuple):
    """The grids of one batch, all in one int64 tensor so that it is built by one launch:

    ``table = [T_b (B) | U_b (B) | row_strides (B) | row_splits (B + 1) | stats (6)]``, where
    ``stats = [min T_b, max T_b, min U_b, max U_b, sum_b T_b*(U_b+1), bad labels]`` (the sum saturates
    at ``CELLS_CAP``; bad labels:
    targets[b, u] with u < U_b outside [0, V) or equal to blank; zeros on CUDA without ``with_stats``).
    """

    table: torch.Tensor  # int64 (4B + 1 + NUM_STATS,)
    padded: bool         # True when some rows may be padding
    max_u1: int          # host-side bound on U_b + 1 (padded: logits.size(2); compact: targets.size(1) + 1)
    padded_t: int = 0    # padded: logits.size(1) when known (the CUDA row kernels then divide instead of search)

    @property
    def batch_size(self):
        return (self.table.numel() - 1 - NUM_STATS) // 4

    @property
    def logit_lengths(self):
        return self.table[:self.batch_size]

    @property
    def target_lengths(self):
        B = self.batch_size
        return self.table[B:2 * B]

    @property
    def row_strides(self):
        B = self.batch_size
        return self.table[2 * B:3 * B]

    @property
    def row_splits(self):
        B = self.batch_size
        return self.table[3 * B:4 * B + 1]

    @property
    def cell_offsets(self):
        B = self.batch_size
        return self.table[3 * B:4 * B]

    @property
    def stats(self):
        return self.table[-NUM_STATS:]
