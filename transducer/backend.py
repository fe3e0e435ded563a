"""The stage contract that ``transducer.cpu.stages`` and ``transducer.cuda.stages`` both implement, as a
``typing.Protocol`` (the same names, arguments and results; tests/test_stages.py checks both signatures against it),
and the backend of a device (``stages_for``). The structures the stages take: Layout and the layouts of the logits in
transducer/layout.py, LossOptions in transducer/options.py, Walks and Lattice in transducer/lattices.py. Per-row
float arrays are float32, or float64 for float64 logits.

TDT (the Token-and-Duration Transducer, Xu et al. 2023, NeMo's semantics). Row r of ``tokens2d`` (N, V) holds
the V token scores of row r of the layout (blank among them), row r of ``duration_scores`` (N, D) its D
duration scores (two views of NeMo's (N, V + D) joint, or two heads); ``options.durations`` holds D distinct
ints >= 0, at least one >= 1:

    tok(t,u,v) = z(t,u,v) - logsumexp_{v'<V} z(t,u,v') - sigma
    dur(t,u,i) = z(t,u,V+i) - logsumexp_{j<D} z(t,u,V+j)

From cell (t, u) a label y_{u+1} with duration d_i goes to (t + d_i, u + 1) if t + d_i < T_b (d_i may be 0); a
blank with duration d_i >= 1 goes to (t + d_i, u) if t + d_i < T_b, or ends the alignment if u == U_b and
t + d_i == T_b. Every arc goes from anti-diagonal s = t + u to s + d_i (blank) or s + d_i + 1 (label), so
alpha and beta walk the anti-diagonals as for RNN-T, reading up to max(d) + 1 of them back (ahead).

Multi-blank RNN-T (Xu et al., ICASSP 2023, arXiv 2211.03541; NeMo's semantics): RNN-T plus K big blanks, big
blank i in column ``blank - 1 - i`` of the logits and of duration ``options.big_blank_durations[i]`` (distinct
ints >= 2). Every log-prob is ``log_softmax - sigma``. From cell (t, u) the label y_{u+1} goes to (t, u + 1),
the blank to (t + 1, u) and big blank i to (t + d_i, u); an alignment ends on reaching t = T_b with u = U_b
through any blank. The walk is TDT's with blank arcs of durations (1, d_1, ..., d_K) and label arcs of
duration 0; the gradient is RNN-T's with the big blanks' arcs on their columns.
"""

from typing import Optional, Protocol, Tuple

import torch
from torch import Tensor

from .joiner import Dropout
from .lattices import Lattice, Walks
from .layout import LabelCheck, Layout
from .options import LossOptions

__all__ = ["Stages", "stages_for", "BACKENDS"]

#: The backends, by device type.
BACKENDS = ("cpu", "cuda")


class Stages(Protocol):
    """The stages of one backend (a module: ``transducer.cpu.stages`` or ``transducer.cuda.stages``)."""

    def layout(
        self,
        logit_lengths: Tensor,
        target_lengths: Tensor,
        max_u1: int,
        padded_t: int = 0,
        labels: Optional[LabelCheck] = None,
        with_stats: bool = True,
    ) -> Layout:
        """One pass over the lengths (one launch on CUDA, no host synchronisation): padded (B, padded_t, max_u1)
        grids when ``padded_t > 0``, compact ones otherwise. With ``with_stats``, ``Layout.stats`` holds what the
        value checks need (``Stats``); with ``labels`` (a LabelCheck) the labels are then checked too."""

    def log_probs(
        self,
        logits2d: Tensor,
        targets: Tensor,
        layout: Layout,
        options: LossOptions,
        row_start: int = 0,
        out: Optional[Tuple[Tensor, Tensor]] = None,
    ) -> Tuple[Tensor, Tensor]:
        """RNN-T and RNA: (lp, den). lp (N, 2): lp[r, 0] = log P(blank | cell r), lp[r, 1] = log P(y_{u+1} | cell
        r) for u < U_b (-inf for u == U_b), plus k2's delay penalty ``options.delay_penalty * ((T_b - 1) / 2 -
        t)``; den (N,) = logsumexp_v logits2d[r] (zeros with ``options.from_log_softmax``); a NaN or infinite
        logit makes den NaN. With ``row_start``, logits2d holds the rows [row_start, row_start + N) of the layout
        and ``out`` = (lp, den) of every row is written there (the fused joiner loss's tiles; row_start > 0
        needs out)."""

    def multiblank_log_probs(
        self,
        logits2d: Tensor,
        targets: Tensor,
        layout: Layout,
        options: LossOptions,
        row_start: int = 0,
        out: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """(lp, den, lp_arcs): as log_probs (the delay penalty on the label's entry too), sigma subtracted, and
        lp_arcs (N, K) = the big blanks' log-probs (-inf on padding rows)."""

    def tdt_log_probs(
        self,
        tokens2d: Tensor,
        duration_scores: Tensor,
        targets: Tensor,
        layout: Layout,
        options: LossOptions,
        row_start: int = 0,
        out: Optional[Tuple[Tensor, Tensor, Tensor, Tensor]] = None,
    ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """(lp, den, lp_arcs, den_arcs): lp (N, 2) = [tok(blank), tok(y_{u+1})] (-inf for the label at u == U_b
        and on padding rows), den (N,) the logsumexp of the V token columns, lp_arcs (N, D) = dur(., i),
        den_arcs (N,) the logsumexp of the D duration columns. A NaN or infinite score anywhere in a row makes
        both den entries of the row, so its lp and lp_arcs, NaN. ``row_start`` and ``out`` as for log_probs."""

    def alpha_beta(self, lp: Tensor, layout: Layout, options: LossOptions) -> Walks:
        """alpha, beta (N,) in lp's dtype, -inf at unreachable cells; nll (B,) = -beta(b, 0, 0), +inf where no
        alignment exists, NaN where lp has a NaN in a cell of the utterance. RNA when
        ``options.one_sym_per_frame``."""

    def tdt_alpha_beta(self, lp: Tensor, lp_arcs: Tensor, layout: Layout, options: LossOptions) -> Walks:
        """As alpha_beta over TDT's lattice; nll NaN where any lp or lp_arcs entry of a cell of the utterance
        is NaN."""

    def multiblank_alpha_beta(self, lp: Tensor, lp_arcs: Tensor, layout: Layout, options: LossOptions) -> Walks:
        """As tdt_alpha_beta over the multi-blank lattice."""

    def gradient(
        self,
        logits2d: Tensor,
        targets: Tensor,
        lattice: Lattice,
        scale: Tensor,
        options: LossOptions,
        out: Tensor,
        row_start: int = 0,
    ) -> Tensor:
        """Writes into ``out`` (N, V), logits' dtype, the gradient of sum_b scale[b] * nll[b] with respect to
        logits2d (FastEmit's ``options.fastemit_lambda`` on the label arcs; each element clamped to [-clamp,
        clamp] for a unit scale when ``options.clamp > 0``); ``scale`` is (B,) in lp's dtype, any stride (an
        expanded scalar is fine). Zeros on padding rows and for utterances whose loss is not finite or whose
        scale is 0. ``out`` may be ``logits2d`` itself (each element is read before it is written), or rows of
        another stride (unit column stride). With ``row_start``, logits2d and out are the rows [row_start,
        row_start + N); the lattice's arrays hold every row. With ``options.big_blank_durations``,
        ``lattice.lp_arcs`` holds the big blanks' log-probs and their arcs' posteriors are subtracted on their
        columns. Returns ``out``."""

    def tdt_gradient(
        self,
        tokens2d: Tensor,
        duration_scores: Tensor,
        targets: Tensor,
        lattice: Lattice,
        scale: Tensor,
        options: LossOptions,
        out: Tuple[Tensor, Tensor],
        row_start: int = 0,
    ) -> None:
        """Writes into ``out`` = (out_tokens (N, V), out_duration_scores (N, D)), the scores' dtype, the gradient of sum_b
        scale[b] * L_b with L_b = (1 - omega) * tdt_b + omega * rnnt_b; ``lattice.rnnt`` holds the walks of the
        plain RNN-T loss of the token columns without sigma (``alpha_beta(lp + sigma, layout, ...)``) when
        omega > 0. With gamma the cell posterior, B_i / L_i the posteriors of the blank / label arcs of duration
        d_i leaving the cell, p the softmax of the token columns, q that of the duration columns,
        lam = fastemit_lambda:

            token v:    (1 - omega) [p_v (gamma + lam sum_i L_i) - [v == blank] sum_i B_i - [v == y] (1 + lam) sum_i L_i]
                        + omega (the same for the RNN-T loss: p_v (gamma_r + lam L_r) - [blank] B_r - [y] (1 + lam) L_r)
            duration j: (1 - omega) [q_j gamma - B_j - L_j]

        clamped and scaled as for gradient. Zeros on padding rows and for utterances whose TDT loss (or, with
        omega > 0, RNN-T loss) is not finite or whose scale is 0. The outputs may be the inputs themselves."""

    def gradient_row_width(self, V: int, itemsize: int) -> int:
        """The row width of a new gradient buffer for V-wide logits that an op made (V, or V padded so that the
        op's backward GEMMs read it faster; the gradient is then a view of its first V columns)."""

    def pack_forward(
        self,
        encoder_out: Tensor,
        predictor_out: Tensor,
        layout: Layout,
        num_rows: int,
        row_start: int = 0,
        activation: str = "identity",
        out: Optional[Tensor] = None,
        dropout: Optional[Dropout] = None,
    ) -> Tensor:
        """Row r - row_start of ``out`` (num_rows, J) = dropout(act(encoder_out[b, t] + predictor_out[b, u])) for
        the rows r = (b, t, u) in [row_start, row_start + num_rows) of the compact layout: the sum, the
        activation and the mask's factor (transducer/joiner.py) in the promoted dtype of the two inputs (as
        ``enc + pred`` computes them), written in ``out``'s dtype (default: the promoted one); ``out`` may be
        the first J columns of a wider matrix. An ``out`` of (R, C), R >= num_rows and C >= J, gets ones in its
        columns past J (a bias's columns in the fused loss's GEMM operand) and zeros in its rows past num_rows
        (the GEMMs' padding rows). Rows past the layout's last one are zeros too: num_rows may reach past it (the
        fused loss packs its first tile before the host knows the layout's row count). Returns ``out``."""

    def pack_backward(self, grad_rows: Tensor, layout: Layout, max_t: int, max_u1: int) -> Tuple[Tensor, Tensor]:
        """(grad_encoder_out, grad_predictor_out): the sums of grad_rows over u and over t, in grad_rows'
        dtype."""

    def pack_backward_add(
        self,
        grad_rows: Tensor,
        layout: Layout,
        row_start: int,
        utterances: Tuple[int, int],
        grads: Tuple[Tensor, Tensor],
        inputs: Optional[Tuple[Tensor, Tensor]] = None,
        activation: str = "identity",
        dropout: Optional[Dropout] = None,
    ) -> Tuple[Tensor, Tensor]:
        """``grads`` = (grad_enc (B, maxT, J), grad_pred (B, maxU+1, J)), of the accumulation dtype, += the sums over u and
        over t of grad_rows * mask * act'(a) for the rows [row_start, row_start + len(grad_rows)), which lie in
        the utterances [first, end) = ``utterances``; a, h = act(a) and the mask are recomputed from ``inputs``
        = (encoder_out, predictor_out) as pack_forward computes them (grad_rows alone for the identity without
        dropout). Returns (grad_enc, grad_pred)."""


_stages: dict = {}


def stages_for(device: torch.device) -> Stages:
    """The stages (``transducer.cpu.stages`` or ``transducer.cuda.stages``) for tensors on ``device``."""
    stages = _stages.get(device.type)
    if stages is not None:
        return stages
    if device.type == "cuda":
        from .cuda import stages
    elif device.type == "cpu":
        from .cpu import stages
    else:
        raise ValueError(f"logits: expected a CPU or CUDA tensor, got device {device}")
    return _stages.setdefault(device.type, stages)
