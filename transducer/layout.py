"""Where cell (b, t, u) of each utterance's (T_b, U_b + 1) grid lives in the logits, the named structures the
stages pass around, and the stage contract that ``transducer.cpu`` and ``transducer.cuda`` both implement.

Both logits layouts are seen as a 2-D tensor ``logits2d`` of shape (N, V):

- compact ``(sum_b T_b*(U_b+1), V)``: N = sum_b T_b*(U_b+1), every row is a cell;
- padded ``(B, maxT, maxU+1, V)`` viewed as ``(B*maxT*(maxU+1), V)``: rows with t >= T_b or u > U_b are
  padding.

In both, cell (b, t, u) is row ``row_splits[b] + t * row_strides[b] + u`` (compact: row_splits = exclusive
cumsum of T_b*(U_b+1), strides = U_b + 1; padded: row_splits[b] = b*maxT*(maxU+1), strides = maxU + 1), and
the rows of utterance b are ``row_splits[b] <= r < row_splits[b+1]`` (k2's row_splits convention,
ragged/shape.py). Kernels find b by a binary search (compact) or one division by maxT*(maxU+1) (padded;
common.cuh's PaddedGrid), so no per-row index array exists. One set of stages serves both layouts, and the
per-row arrays (log-probs, den, alpha, beta) are indexed like the rows of ``logits2d``; on padding rows they
hold unspecified values that no stage reads.

The structures: ``Layout`` (the batch's grids, one int64 table), ``LossOptions`` (what a loss computes besides
its tensors), ``Walks`` (alpha, beta and the loss of one walk) and ``Lattice`` (what forward keeps for
backward). Every stage takes them whole and reads the fields it needs, so an option is one new field, not
a new argument of every stage.

The stage contract (``transducer.cpu`` and ``transducer.cuda``: same names, arguments and results;
``stages_for(device)`` gives the module). Per-row float arrays are float32, or float64 for float64 logits.

``layout(logit_lengths, target_lengths, max_u1, padded_t=0, targets=None, vocab_size=0, blank=0,
with_stats=True, big_blanks=0) -> Layout``
    One pass over the lengths (one launch on CUDA, no host synchronisation): padded (B, padded_t, max_u1)
    grids when ``padded_t > 0``, compact ones otherwise. With ``with_stats``, ``Layout.stats`` holds what
    the value checks need (``Stats``); ``targets`` (B, S) are then checked against ``[0, vocab_size)`` and
    the blanks, ``[blank - big_blanks, blank]``.

RNN-T and RNA:

``log_probs(logits2d, targets, layout, options, row_start=0, out=None) -> (lp, den)``
    lp (N, 2): lp[r, 0] = log P(blank | cell r), lp[r, 1] = log P(y_{u+1} | cell r) for u < U_b (-inf for
    u == U_b), plus k2's delay penalty ``options.delay_penalty * ((T_b - 1) / 2 - t)``; den (N,) =
    logsumexp_v logits2d[r] (zeros with ``options.from_log_softmax``); a NaN or infinite logit makes den NaN.
    With ``row_start``, logits2d holds the rows [row_start, row_start + N) of the layout and ``out`` = (lp,
    den) of every row is written there (the fused joiner loss's tiles; row_start > 0 needs out).
``alpha_beta(lp, layout, options) -> Walks``
    alpha, beta (N,) in lp's dtype, -inf at unreachable cells; nll (B,) = -beta(b, 0, 0), +inf where no
    alignment exists, NaN where lp has a NaN in a cell of the utterance. RNA when
    ``options.one_sym_per_frame``.
``gradient(logits2d, targets, lattice, scale, options, out, row_start=0) -> out``
    Writes into ``out`` (N, V), logits' dtype, the gradient of sum_b scale[b] * nll[b] with respect to
    logits2d (FastEmit's ``options.fastemit_lambda`` on the label arcs; each element clamped to [-clamp,
    clamp] for a unit scale when ``options.clamp > 0``); ``scale`` is (B,) in lp's dtype, any stride (an
    expanded scalar is fine). Zeros on padding rows and for utterances whose loss is not finite or whose
    scale is 0. ``out`` may be ``logits2d`` itself (each element is read before it is written), or rows of
    another stride (unit column stride). With ``row_start``, logits2d and out are the rows [row_start,
    row_start + N); the lattice's arrays hold every row.
``gradient_row_width(V, itemsize) -> int``
    The row width of a new gradient buffer for V-wide logits that an op made (V, or V padded so that the
    op's backward GEMMs read it faster; the gradient is then a view of its first V columns).

TDT (the Token-and-Duration Transducer, Xu et al. 2023, NeMo's semantics). Row r of ``tokens2d`` (N, V)
holds the V token scores of row r of the layout (blank among them), row r of ``durations2d`` (N, D) its D
duration scores (two views of NeMo's (N, V + D) joint, or two heads); ``options.durations`` holds D
distinct ints >= 0, at least one >= 1:

    tok(t,u,v) = z(t,u,v) - logsumexp_{v'<V} z(t,u,v') - sigma
    dur(t,u,i) = z(t,u,V+i) - logsumexp_{j<D} z(t,u,V+j)

From cell (t, u) a label y_{u+1} with duration d_i goes to (t + d_i, u + 1) if t + d_i < T_b (d_i may be 0);
a blank with duration d_i >= 1 goes to (t + d_i, u) if t + d_i < T_b, or ends the alignment if u == U_b and
t + d_i == T_b. Every arc goes from anti-diagonal s = t + u to s + d_i (blank) or s + d_i + 1 (label), so
alpha and beta walk the anti-diagonals as for RNN-T, reading up to max(d) + 1 of them back (ahead).

``tdt_log_probs(tokens2d, durations2d, targets, layout, options, row_start=0, out=None) -> (lp, lp_dur, den)``
    lp (N, 2) = [tok(blank), tok(y_{u+1})] (-inf for the label at u == U_b and on padding rows), lp_dur
    (N, D) = dur(., i), den (N, 2) = [logsumexp of the V token columns, of the D duration columns]. A NaN
    or infinite score anywhere in a row makes both den entries of the row, so its lp and lp_dur, NaN.
    ``row_start`` and ``out`` as for log_probs.
``tdt_alpha_beta(lp, lp_dur, layout, options) -> Walks``
    As alpha_beta; nll NaN where any lp or lp_dur entry of a cell of the utterance is NaN.
``tdt_gradient(tokens2d, durations2d, targets, lattice, scale, options, out_tokens, out_durations,
row_start=0)``
    Writes into out_tokens (N, V) and out_durations (N, D), the scores' dtype, the gradient of sum_b
    scale[b] * L_b with L_b = (1 - omega) * tdt_b + omega * rnnt_b; ``lattice.rnnt`` holds the walks of the
    plain RNN-T loss of the token columns without sigma (``alpha_beta(lp + sigma, layout, ...)``) when
    omega > 0. With gamma the cell posterior, B_i / L_i the posteriors of the blank / label arcs of
    duration d_i leaving the cell, p the softmax of the token columns, q that of the duration columns,
    lam = fastemit_lambda:

        token v:    (1 - omega) [p_v (gamma + lam sum_i L_i) - [v == blank] sum_i B_i - [v == y] (1 + lam) sum_i L_i]
                    + omega (the same for the RNN-T loss: p_v (gamma_r + lam L_r) - [blank] B_r - [y] (1 + lam) L_r)
        duration j: (1 - omega) [q_j gamma - B_j - L_j]

    clamped and scaled as for gradient. Zeros on padding rows and for utterances whose TDT loss (or, with
    omega > 0, RNN-T loss) is not finite or whose scale is 0. The outputs may be the inputs themselves.

Multi-blank RNN-T (Xu et al., ICASSP 2023, arXiv 2211.03541; NeMo's semantics): RNN-T plus K big blanks,
big blank i in column ``blank - 1 - i`` of the logits and of duration ``options.big_blank_durations[i]``
(distinct ints >= 2). Every log-prob is ``log_softmax - sigma``. From cell (t, u) the label y_{u+1} goes to
(t, u + 1), the blank to (t + 1, u) and big blank i to (t + d_i, u); an alignment ends on reaching t = T_b
with u = U_b through any blank. The walk is TDT's with blank arcs of durations (1, d_1, ..., d_K) and label
arcs of duration 0; the gradient is RNN-T's with the big blanks' arcs on their columns.

``multiblank_log_probs(logits2d, targets, layout, options, row_start=0, out=None) -> (lp, den, lp_big)``
    As log_probs (without the delay penalty), sigma subtracted, and lp_big (N, K) = the big blanks' log-probs
    (-inf on padding rows).
``multiblank_alpha_beta(lp, lp_big, layout, options) -> Walks``
    As tdt_alpha_beta.
``gradient(logits2d, targets, lattice, scale, options, out, row_start=0)``
    With ``options.big_blank_durations``, ``lattice.lp_dur`` holds lp_big and the big blanks' arc posteriors
    are subtracted on their columns.

The joiner input (``transducer.pack`` and the fused joiner loss):

``pack_forward(encoder_out, predictor_out, layout, num_rows, row_start=0, activation="identity", out=None)
-> out``
    Row r - row_start of ``out`` (num_rows, J) = act(encoder_out[b, t] + predictor_out[b, u]) for the rows
    r = (b, t, u) in [row_start, row_start + num_rows) of the compact layout: the sum and the activation
    in the promoted dtype of the two inputs (as ``enc + pred`` computes them), written in ``out``'s dtype
    (default: the promoted one); ``out`` may be the first J columns of a wider matrix.
``pack_backward(grad_rows, layout, max_t, max_u1) -> (grad_encoder_out, grad_predictor_out)``
    The sums of grad_rows over u and over t, in grad_rows' dtype.
``pack_backward_add(grad_rows, layout, row_start, utterances, grad_enc, grad_pred, inputs=None,
activation="identity")``
    grad_enc (B, maxT, J) and grad_pred (B, maxU+1, J), of the accumulation dtype, += the sums over u and
    over t of grad_rows * act'(h) for the rows [row_start, row_start + len(grad_rows)), which lie in the
    utterances [first, end) = ``utterances``; h is recomputed from ``inputs`` = (encoder_out, predictor_out)
    as pack_forward computes it (grad_rows alone for the identity).
"""

from typing import NamedTuple, Optional, Tuple

import torch

#: Entries of Layout.stats (stages.cu: enum Stat).
NUM_STATS = 6
#: The cell count in ``Layout.stats`` saturates here: lengths whose products or sum overflow 64 bits
#: read as this value instead of wrapping into a plausible count (stages.cu: kCellsCap).
CELLS_CAP = 1 << 61
#: Kernels index rows in 32 bits: the (N, V) logits may have at most this many rows.
MAX_ROWS = (1 << 31) - 1
#: Durations a TDT loss may have on CUDA (tdt.cu: kMaxDurations; struct Durations holds them by value).
MAX_DURATIONS = 16


def table_size(batch_size):
    """Entries of a Layout table for ``batch_size`` utterances."""
    return 4 * batch_size + 1 + NUM_STATS


class Stats(NamedTuple):
    """What the value checks need, computed with the layout (``Layout.stats``, read back as a list)."""
    min_t: int
    max_t: int
    min_u: int
    max_u: int
    cells: int       # sum_b T_b*(U_b+1), saturating at CELLS_CAP
    bad_labels: int  # targets[b, u] with u < U_b outside [0, V) or a blank (0 without label checks)


class Layout(NamedTuple):
    """The grids of one batch, all in one int64 tensor so that it is built by one launch:

    ``table = [T_b (B) | U_b (B) | row_strides (B) | row_splits (B + 1) | stats (NUM_STATS)]``, ``stats`` in
    the order of ``Stats`` (zeros on CUDA without ``with_stats``).
    """

    table: torch.Tensor  # int64 (table_size(B),)
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
        """The stats entries of the table (a tensor; ``Stats(*layout.stats.tolist())`` names them)."""
        return self.table[-NUM_STATS:]


class LossOptions(NamedTuple):
    """What a loss computes besides its tensors (the public functions check them; transducer/checks.py)."""
    blank: int = 0                   # the blank's column, in [0, V) (TDT: among the token columns)
    one_sym_per_frame: bool = False  # RNA: a label consumes a frame too, (t, u) -> (t+1, u+1)
    from_log_softmax: bool = False   # the logits are already log-probabilities
    clamp: float = 0.0               # > 0: each gradient element, for a unit incoming gradient, in [-clamp, clamp]
    fastemit_lambda: float = 0.0     # FastEmit: the label log-probs' gradient times 1 + fastemit_lambda
    delay_penalty: float = 0.0       # k2's delay penalty on the label log-probs
    durations: Tuple[int, ...] = ()  # TDT: the durations (empty: RNN-T or RNA)
    sigma: float = 0.0               # TDT, multi-blank: logit under-normalisation, subtracted from the log-probs
    omega: float = 0.0               # TDT: weight of the plain RNN-T loss of the token scores
    big_blank_durations: Tuple[int, ...] = ()  # multi-blank: big blank i, in column blank - 1 - i, spans d_i frames


class Walks(NamedTuple):
    """alpha and beta over the rows (N,), and the per-utterance negative log-likelihood nll (B,)."""
    alpha: torch.Tensor
    beta: torch.Tensor
    nll: torch.Tensor


class Lattice(NamedTuple):
    """What forward keeps for backward: the per-row log-probabilities and the walks over them."""
    layout: Layout
    lp: torch.Tensor                      # (N, 2): blank and label log-probs (TDT: token log-probs, sigma in)
    den: torch.Tensor                     # (N,) logsumexp of each row (TDT: (N, 2): tokens, durations)
    alpha: torch.Tensor                   # (N,)
    beta: torch.Tensor                    # (N,)
    nll: torch.Tensor                     # (B,)
    lp_dur: Optional[torch.Tensor] = None  # TDT: (N, D) duration log-probs; multi-blank: (N, K) the big blanks'
    #                                        log-probs (the arcs of several frames either way)
    rnnt: Optional[Walks] = None          # TDT with omega > 0: the walks of the plain RNN-T loss


_stages: dict = {}


def stages_for(device):
    """The stage module (``transducer.cpu`` or ``transducer.cuda``) for tensors on ``device``."""
    stages = _stages.get(device.type)
    if stages is not None:
        return stages
    if device.type == "cuda":
        from . import cuda as stages
    elif device.type == "cpu":
        from . import cpu as stages
    else:
        raise ValueError(f"logits: expected a CPU or CUDA tensor, got device {device}")
    return _stages.setdefault(device.type, stages)
