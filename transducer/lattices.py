"""The losses' lattices, one object each (RNN-T and RNA, TDT, multi-blank RNN-T): its log-probs, walks and
gradient stages, so that a loss's forward and backward, and the fused joiner loss's tiles, are written once
for all of them; ``check_supported`` refuses the options a lattice's stages do not read (the table of what each
reads: transducer/options.py, SUPPORTED).

A loss's scores are seen as two row-major views of the layout's rows: ``tokens`` (N, V) and ``extra`` (N, D),
TDT's D duration scores (two views of NeMo's (N, V + D) joint, or two heads), None for the others. The per-row
arrays a lattice keeps (``Lattice``) are ``lp`` (N, 2), ``den`` (N,), and for the lattices whose arcs may span
several frames ``lp_arcs`` (TDT's (N, D) duration log-probs, multi-blank's (N, K) big blanks') and, for TDT,
``den_arcs`` (N,).
"""

import functools
from typing import NamedTuple, Optional

import torch

from . import options as _options
from .layout import Layout
from .options import LossOptions


class Walks(NamedTuple):
    """alpha and beta over the rows (N,), and the per-utterance negative log-likelihood nll (B,)."""

    alpha: torch.Tensor
    beta: torch.Tensor
    nll: torch.Tensor


class Lattice(NamedTuple):
    """What forward keeps for backward: the per-row log-probs and the walks over them."""

    layout: Layout
    lp: torch.Tensor  # (N, 2): blank and label log-probs (TDT: token log-probs, sigma in)
    den: torch.Tensor  # (N,) logsumexp of each row's (token) scores
    alpha: torch.Tensor  # (N,)
    beta: torch.Tensor  # (N,)
    nll: torch.Tensor  # (B,)
    lp_arcs: Optional[torch.Tensor] = None  # the log-probs of the arcs of several frames: TDT's (N, D) duration
    #                                         log-probs, multi-blank's (N, K) big blanks' log-probs
    den_arcs: Optional[torch.Tensor] = None  # TDT: (N,) logsumexp of each row's duration scores
    rnnt: Optional[Walks] = None  # TDT with omega > 0: the walks of the plain RNN-T loss


__all__ = ["Kind", "RNNT", "TDT", "MULTIBLANK", "KINDS", "kind_of", "check_supported", "ARRAYS"]

_DEFAULTS = LossOptions()


def check_supported(options, kind, backend=None):
    """ValueError for a field of ``options`` (a LossOptions) set to other than its default that the lattice
    ``kind`` does not take on ``backend`` ("cpu" or "cuda"; None: on any backend)."""
    # the options a training run passes are checked once (the cache keeps those that pass); not while
    # torch.compile traces the call, which would trace around the cache
    if torch.compiler.is_compiling():
        return _supported(options, kind.name, backend)
    try:
        _cached_supported(options, kind.name, backend)
    except TypeError:  # options of unhashable values (a list of durations): checked as they are
        _supported(options, kind.name, backend)


def _supported(options, kind, backend):
    """check_supported's work, by the lattice's name."""
    table = _options.SUPPORTED[kind]
    for name, value in options._asdict().items():
        if value == getattr(_DEFAULTS, name) or (name in table and (backend is None or backend in table[name])):
            continue
        where = f"on {backend}" if name in table else "at all"
        raise ValueError(f"{name}: the {kind} loss does not take this option {where} (got {value!r})")


_cached_supported = functools.lru_cache(maxsize=256)(_supported)


#: The per-row arrays a lattice keeps, in the order the ops return them (custom_ops.lattice_outputs).
ARRAYS = ("lp", "den", "lp_arcs", "den_arcs")


class LogProbs(NamedTuple):
    """What a lattice's log-probs stage gives, per row; None where the lattice has no such array."""

    lp: torch.Tensor
    den: torch.Tensor
    lp_arcs: Optional[torch.Tensor] = None
    den_arcs: Optional[torch.Tensor] = None


class Kind:
    """A lattice: RNN-T (and RNA, its ``one_sym_per_frame`` walk), TDT or multi-blank RNN-T."""

    name = ""

    def extra_columns(self, options):
        """D: the extra score columns each row has beside the V token scores (TDT's durations), else 0."""
        return 0

    def arcs(self, options):
        """The columns of ``lp_arcs`` (0: none)."""
        return 0

    def new_arrays(self, new, rows, options):
        """The LogProbs arrays for ``rows`` rows, made by ``new(*shape)`` (the fused loss's tiles write them)."""
        K = self.arcs(options)
        return LogProbs(
            new(rows, 2), new(rows), new(rows, K) if K else None, new(rows) if self.extra_columns(options) else None
        )

    def log_probs(self, stages, tokens, extra, targets, layout, options, row_start=0, out=None):
        raise NotImplementedError

    def lattice(self, stages, layout, log_probs, options):
        """The Lattice of the log-probs: the walks over them (and what the gradient needs beside them)."""
        raise NotImplementedError

    def gradient(self, stages, scores, targets, lattice, scale, options, out, row_start=0):
        """The gradient of sum_b scale[b] * loss_b w.r.t. ``scores`` = (tokens, extra or None) into ``out`` =
        (out_tokens, out_extra or None)."""
        raise NotImplementedError

    def nll(self, lattice, options):
        """The loss of each utterance: a new tensor (op outputs may not alias each other)."""
        return lattice.nll.clone()


class _RNNT(Kind):
    name = "RNN-T"

    def log_probs(self, stages, tokens, extra, targets, layout, options, row_start=0, out=None):
        lp, den = stages.log_probs(tokens, targets, layout, options, row_start, None if out is None else out[:2])
        return LogProbs(lp, den)

    def lattice(self, stages, layout, log_probs, options):
        walks = stages.alpha_beta(log_probs.lp, layout, options)
        return Lattice(layout, log_probs.lp, log_probs.den, *walks)

    def gradient(self, stages, scores, targets, lattice, scale, options, out, row_start=0):
        stages.gradient(scores[0], targets, lattice, scale, options, out[0], row_start)


class _Multiblank(_RNNT):
    name = "multi-blank RNN-T"

    def arcs(self, options):
        return len(options.big_blank_durations)

    def log_probs(self, stages, tokens, extra, targets, layout, options, row_start=0, out=None):
        return LogProbs(
            *stages.multiblank_log_probs(tokens, targets, layout, options, row_start, None if out is None else out[:3])
        )

    def lattice(self, stages, layout, log_probs, options):
        walks = stages.multiblank_alpha_beta(log_probs.lp, log_probs.lp_arcs, layout, options)
        return Lattice(layout, log_probs.lp, log_probs.den, *walks, lp_arcs=log_probs.lp_arcs)


class _TDT(Kind):
    name = "TDT"

    def extra_columns(self, options):
        return len(options.durations)

    def arcs(self, options):
        return len(options.durations)

    def log_probs(self, stages, tokens, extra, targets, layout, options, row_start=0, out=None):
        return LogProbs(*stages.tdt_log_probs(tokens, extra, targets, layout, options, row_start, out))

    def lattice(self, stages, layout, log_probs, options):
        # with omega > 0 also the walks of the plain RNN-T loss of the token scores (log-probs without sigma)
        walks = stages.tdt_alpha_beta(log_probs.lp, log_probs.lp_arcs, layout, options)
        rnnt = stages.alpha_beta(log_probs.lp + options.sigma, layout, options) if options.omega else None
        return Lattice(
            layout,
            log_probs.lp,
            log_probs.den,
            *walks,
            lp_arcs=log_probs.lp_arcs,
            den_arcs=log_probs.den_arcs,
            rnnt=rnnt,
        )

    def gradient(self, stages, scores, targets, lattice, scale, options, out, row_start=0):
        stages.tdt_gradient(*scores, targets, lattice, scale, options, out, row_start)

    def nll(self, lattice, options):
        if options.omega:
            return (1 - options.omega) * lattice.nll + options.omega * lattice.rnnt.nll
        return lattice.nll.clone()


RNNT, TDT, MULTIBLANK = _RNNT(), _TDT(), _Multiblank()
KINDS = (RNNT, TDT, MULTIBLANK)


def kind_of(options):
    """The lattice of ``options``: TDT with durations, multi-blank with big blanks, else RNN-T (or RNA)."""
    if options.durations:
        return TDT
    if options.big_blank_durations:
        return MULTIBLANK
    return RNNT
