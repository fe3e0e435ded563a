"""The transducer loss: the functional form, the module, and torchaudio's spelling of both.

The work happens in the op ``transducer::loss`` (transducer/library.py); this
module checks the arguments (types, shapes, options: everything that needs no look at tensor values),
makes logits and targets contiguous where autograd sees the copy, and reduces the per-utterance
losses with plain torch ops, so that torch.compile traces all of it.
"""

import torch

from . import library
from .checks import (FLOAT_DTYPES, check_batch, check_blank, check_module_blank, check_options, check_reduction,
                     check_tensor)


def _check_arguments(logits, targets, logit_lengths, target_lengths, blank, reduction, clamp, fastemit_lambda,
                     delay_penalty, inplace_grad):
    """The blank's column, once every argument is checked."""
    check_tensor("logits", logits, FLOAT_DTYPES, (2, 4), None)
    check_batch(logits, targets, logit_lengths, target_lengths)
    blank = check_blank(blank, logits.size(-1))
    check_reduction(reduction)
    check_options(clamp, fastemit_lambda, delay_penalty)
    if inplace_grad and not torch.compiler.is_compiling():
        check_inplace_grad(logits)
    return blank


def check_inplace_grad(logits):
    """inplace_grad writes the gradient over the logits' values: refused for a leaf that requires grad (or a
    view of one), whose values are the caller's and whose ``.grad`` autograd copies into a tensor of its
    own."""
    base = logits._base if logits._base is not None else logits
    if base.requires_grad and base.is_leaf:
        raise ValueError("inplace_grad: the logits are (a view of) a leaf tensor that requires grad; the gradient "
                         "would overwrite their values and autograd would copy it into .grad anyway. Use "
                         "inplace_grad=True only for logits an op produced (a joiner Linear's output that feeds "
                         "only this loss)")


def transducer_loss(logits, targets, logit_lengths, target_lengths, blank=0, reduction="mean",
                    one_sym_per_frame=False, from_log_softmax=False, zero_infinity=False, check_inputs=True,
                    inplace_grad=False, clamp=-1.0, fastemit_lambda=0.0, delay_penalty=0.0):
    r"""Transducer (RNN-T) loss, or with ``one_sym_per_frame`` the RNA loss, over compact or padded logits.

    Args:
        logits: unnormalised scores, float16 / bfloat16 / float32 / float64, either compact
            ``(sum_b T_b*(U_b+1), V)`` (utterance b's (T_b, U_b+1) grid stored row-major, utterances
            one after another) or padded ``(B, maxT, maxU+1, V)``; picked by ``logits.dim()``.
            Non-contiguous logits are copied once to be made contiguous.
        targets: ``(B, S)`` int32 / int64 label ids, ``S >= max_b U_b``; entries past ``U_b`` are ignored.
            Labels must lie in ``[0, V)`` and differ from ``blank``.
        logit_lengths: ``(B,)`` int32 / int64, ``T_b >= 1`` frames of each utterance.
        target_lengths: ``(B,)`` int32 / int64, ``U_b >= 0`` labels of each utterance.
        blank: index of the blank symbol in ``[0, V)``. Default 0.
        reduction: ``"none"`` gives the ``(B,)`` negative log-likelihoods, ``"sum"`` their sum,
            ``"mean"`` (default) their mean over the batch (torchaudio's convention).
        one_sym_per_frame: RNA topology: every step consumes a frame, so a label moves
            (t, u) -> (t+1, u+1). Utterances with ``U_b > T_b - 1`` have no alignment: loss ``+inf``.
        from_log_softmax: the logits are already log-probabilities (log_softmax done by the caller);
            the loss skips its own normalisation and the gradient is w.r.t. those log-probabilities.
        zero_infinity: replace infinite losses by 0. Utterances whose loss is not finite get zero
            gradient either way; a NaN loss (a NaN or infinite logit) stays NaN.
        check_inputs: check lengths and label values against the tensors (on CUDA this costs one
            small device-to-host transfer, which overlaps the first pass over the logits). ``False``
            skips it: no host synchronisation, so a step can be captured in a CUDA graph;
            out-of-range values then give undefined results.
        inplace_grad: write the gradient into the logits' own storage in backward instead of a new
            tensor, saving one logits-sized buffer. Only valid when nothing else needs the logits'
            values afterwards (true for a joiner ``Linear`` whose output feeds only this loss). On leaf
            logits, ``logits.grad`` then shares their storage. Autograd is told the logits changed,
            so a backward that still needs them raises instead of reading the gradient.
        clamp: if > 0, each element of the gradient w.r.t. the logits, for a unit incoming gradient,
            is clamped to ``[-clamp, clamp]`` before the incoming gradient scales it (torchaudio's
            ``clamp``). Default -1: no clamp.
        fastemit_lambda: FastEmit (Yu et al., 2021; warp-rnnt's and NeMo's ``fastemit_lambda``): the
            returned loss is unchanged; its gradient w.r.t. every label (emission) log-probability is
            scaled by ``1 + fastemit_lambda``, which favours early emission. Default 0.
        delay_penalty: k2's delay penalty: the label log-probability of cell (t, u) of utterance b
            gets ``delay_penalty * ((T_b - 1) / 2 - t)`` before the recursion; loss and gradient are
            those of this penalised lattice. Default 0.

    Returns:
        float32 loss (float64 for float64 logits): ``(B,)`` for ``"none"``, else a scalar. The gradient
        flows to ``logits`` only and has the logits' dtype. On CUDA, for 16-bit logits that an op produced
        and whose rows are not a multiple of 16 bytes (up to 4 KiB), it comes in rows padded to one (a
        non-contiguous view: ``library.gradient_buffer``), which the op's backward GEMMs read faster.

    Example::

        >>> logits = torch.randn(2 * 4 + 3 * 2, 6, requires_grad=True)      # compact: T = [2, 3], U = [3, 1]
        >>> loss = transducer_loss(logits, torch.tensor([[1, 2, 3], [4, 0, 0]]), torch.tensor([2, 3]),
        ...                        torch.tensor([3, 1]))
        >>> loss.backward()
    """
    blank = _check_arguments(logits, targets, logit_lengths, target_lengths, blank, reduction, clamp,
                             fastemit_lambda, delay_penalty, inplace_grad)
    nll = library.loss(logits.contiguous(), targets.contiguous(), logit_lengths, target_lengths,
                       blank, bool(one_sym_per_frame), bool(from_log_softmax), bool(check_inputs),
                       float(delay_penalty), float(fastemit_lambda), float(clamp), bool(inplace_grad))[0]
    return _reduce(nll, reduction, zero_infinity)


def _reduce(nll, reduction, zero_infinity):
    """The per-utterance losses as the caller asked for them. Backward sees the true losses (an infinite one
    gets zero gradient); the caller may see zeros. What is returned is a new tensor, never the op's output
    that backward keeps, so it may be changed in place."""
    if zero_infinity:
        nll = torch.where(torch.isinf(nll), 0.0, nll)
    if reduction == "sum":
        return nll.sum()
    if reduction == "mean":
        return nll.mean()
    return nll if zero_infinity else nll.clone()


class TransducerLoss(torch.nn.Module):
    """Module form of :func:`transducer_loss`: ``TransducerLoss(blank=0)(logits, targets, T, U)``."""

    def __init__(self, blank=0, reduction="mean", one_sym_per_frame=False, from_log_softmax=False,
                 zero_infinity=False, check_inputs=True, inplace_grad=False, clamp=-1.0, fastemit_lambda=0.0,
                 delay_penalty=0.0):
        super().__init__()
        check_reduction(reduction)
        check_options(clamp, fastemit_lambda, delay_penalty)
        self.blank = check_module_blank(blank)
        self.reduction = reduction
        self.one_sym_per_frame = one_sym_per_frame
        self.from_log_softmax = from_log_softmax
        self.zero_infinity = zero_infinity
        self.check_inputs = check_inputs
        self.inplace_grad = inplace_grad
        self.clamp = clamp
        self.fastemit_lambda = fastemit_lambda
        self.delay_penalty = delay_penalty

    def forward(self, logits, targets, logit_lengths, target_lengths):
        return transducer_loss(logits, targets, logit_lengths, target_lengths, blank=self.blank,
                               reduction=self.reduction, one_sym_per_frame=self.one_sym_per_frame,
                               from_log_softmax=self.from_log_softmax, zero_infinity=self.zero_infinity,
                               check_inputs=self.check_inputs, inplace_grad=self.inplace_grad, clamp=self.clamp,
                               fastemit_lambda=self.fastemit_lambda, delay_penalty=self.delay_penalty)

    def extra_repr(self):
        return (f"blank={self.blank}, reduction={self.reduction!r}, one_sym_per_frame={self.one_sym_per_frame}, "
                f"from_log_softmax={self.from_log_softmax}, zero_infinity={self.zero_infinity}, "
                f"check_inputs={self.check_inputs}, inplace_grad={self.inplace_grad}, clamp={self.clamp}, "
                f"fastemit_lambda={self.fastemit_lambda}, delay_penalty={self.delay_penalty}")


# ----------------------------------------------------------------------------- torchaudio's spelling


def rnnt_loss(logits, targets, logit_lengths, target_lengths, blank=-1, clamp=-1.0, reduction="mean",
              fused_log_softmax=True, *, fastemit_lambda=0.0, delay_penalty=0.0):
    """torchaudio's ``rnnt_loss``, same arguments and semantics: switch with one changed import.

    Args:
        logits: ``(B, maxT, maxU+1, V)`` padded scores as torchaudio takes them, or compact
            ``(sum_b T_b*(U_b+1), V)``; float16 / bfloat16 / float32 / float64.
        targets: ``(B, maxU)`` int32 or int64.
        logit_lengths, target_lengths: ``(B,)`` int32 or int64.
        blank: the blank index; negative values count from the end (default -1: the last index ``V - 1``).
        clamp: if > 0, each gradient element (for a unit incoming gradient) is clamped to
            ``[-clamp, clamp]``. Default -1: no clamp.
        reduction: ``"none"``, ``"sum"`` or ``"mean"`` (default; the mean over the batch).
        fused_log_softmax: ``False`` means the logits are already log-probabilities.
        fastemit_lambda, delay_penalty: keyword-only, not torchaudio's: as for :func:`transducer_loss`.

    Returns:
        as :func:`transducer_loss`: float32 (float64 for float64 logits), where torchaudio returns the
        logits' dtype.

    Example::

        >>> from transducer import rnnt_loss       # was: from torchaudio.functional import rnnt_loss
        >>> logits = torch.randn(2, 5, 3, 7, requires_grad=True)
        >>> rnnt_loss(logits, torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), torch.tensor([5, 4]),
        ...           torch.tensor([2, 1])).backward()
    """
    return transducer_loss(logits, targets, logit_lengths, target_lengths, blank=blank, reduction=reduction,
                           from_log_softmax=not fused_log_softmax, clamp=clamp, fastemit_lambda=fastemit_lambda,
                           delay_penalty=delay_penalty)


class RNNTLoss(torch.nn.Module):
    """torchaudio's ``RNNTLoss(blank=-1, clamp=-1, reduction="mean", fused_log_softmax=True)``: see :func:`rnnt_loss`."""

    def __init__(self, blank=-1, clamp=-1.0, reduction="mean", fused_log_softmax=True, *, fastemit_lambda=0.0,
                 delay_penalty=0.0):
        super().__init__()
        check_reduction(reduction)
        check_options(clamp, fastemit_lambda, delay_penalty)
        self.blank = check_module_blank(blank)
        self.clamp = clamp
        self.reduction = reduction
        self.fused_log_softmax = fused_log_softmax
        self.fastemit_lambda = fastemit_lambda
        self.delay_penalty = delay_penalty

    def forward(self, logits, targets, logit_lengths, target_lengths):
        return rnnt_loss(logits, targets, logit_lengths, target_lengths, blank=self.blank, clamp=self.clamp,
                         reduction=self.reduction, fused_log_softmax=self.fused_log_softmax,
                         fastemit_lambda=self.fastemit_lambda, delay_penalty=self.delay_penalty)

    def extra_repr(self):
        return (f"blank={self.blank}, clamp={self.clamp}, reduction={self.reduction!r}, "
                f"fused_log_softmax={self.fused_log_softmax}, fastemit_lambda={self.fastemit_lambda}, "
                f"delay_penalty={self.delay_penalty}")
