"""The transducer loss: the functional form, the module, and torchaudio's spelling of both.

The work happens in the op ``transducer::loss`` (transducer/custom_ops.py), which every loss shares; this
module checks the arguments (types, shapes, options: everything that needs no look at tensor values),
makes logits and targets contiguous where autograd sees the copy, and reduces the per-utterance
losses with plain torch ops, so that torch.compile traces all of it.
"""

import torch

from . import custom_ops
from .options import LossOptions
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
        logits (Tensor): unnormalised scores, float16 / bfloat16 / float32 / float64: compact
            ``(sum_b T_b*(U_b+1), V)`` (utterance b's (T_b, U_b+1) grid row-major, utterances one after
            another) or padded ``(B, maxT, maxU+1, V)``, picked by ``logits.dim()``.
        targets (Tensor): ``(B, S)`` int32 / int64 labels, ``S >= max U_b``, in ``[0, V)`` and not ``blank``;
            entries past ``U_b`` are ignored.
        logit_lengths (Tensor): ``(B,)`` int32 / int64 frames, ``T_b >= 1``.
        target_lengths (Tensor): ``(B,)`` int32 / int64 labels, ``U_b >= 0``.
        blank (int, optional): the blank's column, in ``[-V, V)``; negative counts from the end. (Default: ``0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as torchaudio).
            (Default: ``"mean"``)
        one_sym_per_frame (bool, optional): RNA: a label moves (t, u) -> (t+1, u+1); an utterance with
            ``U_b > T_b - 1`` has no alignment and loss ``+inf``. (Default: ``False``)
        from_log_softmax (bool, optional): the logits are log-probabilities already; the gradient is w.r.t.
            them. (Default: ``False``)
        zero_infinity (bool, optional): infinite losses become 0 (their gradient is zero either way); NaN
            losses stay NaN. (Default: ``False``)
        check_inputs (bool, optional): check lengths and labels against the tensors (on CUDA one small
            device-to-host read, overlapping the first pass); ``False``: no host synchronisation (CUDA graphs),
            out-of-range values give undefined results. (Default: ``True``)
        inplace_grad (bool, optional): write the gradient over the logits in backward, saving a logits-sized
            buffer; for logits an op produced that nothing else needs (a joiner ``Linear``'s output). A leaf
            that requires grad (or a view of one) is refused with a ValueError. (Default: ``False``)
        clamp (float, optional): if > 0, each gradient element for a unit incoming gradient is clamped to
            ``[-clamp, clamp]`` before the incoming gradient scales it (torchaudio's). (Default: ``-1``)
        fastemit_lambda (float, optional): FastEmit (Yu et al. 2021): the gradient w.r.t. every label
            log-prob times ``1 + fastemit_lambda``; the loss value is unchanged. (Default: ``0.0``)
        delay_penalty (float, optional): k2's delay penalty: the label log-prob of cell (t, u) of utterance b
            gets ``delay_penalty * ((T_b - 1) / 2 - t)`` before the recursion. (Default: ``0.0``)

    Returns:
        Tensor: float32 loss (float64 for float64 logits): ``(B,)`` for ``"none"``, else a scalar. The gradient
        flows to ``logits`` in their dtype, computed in backward (forward keeps a few floats per row). On
        CUDA, for 16-bit logits that an op produced with rows not a multiple of 16 bytes (up to 4 KiB), it
        comes in rows padded to one (a non-contiguous view), which the op's backward GEMMs read faster.

    Example::

        >>> logits = torch.randn(2 * 4 + 3 * 2, 6, requires_grad=True)      # compact: T = [2, 3], U = [3, 1]
        >>> loss = transducer_loss(logits, torch.tensor([[1, 2, 3], [4, 0, 0]]), torch.tensor([2, 3]),
        ...                        torch.tensor([3, 1]))
        >>> loss.backward()
    """
    blank = _check_arguments(logits, targets, logit_lengths, target_lengths, blank, reduction, clamp,
                             fastemit_lambda, delay_penalty, inplace_grad)
    options = LossOptions(blank=blank, one_sym_per_frame=bool(one_sym_per_frame),
                          from_log_softmax=bool(from_log_softmax), clamp=float(clamp),
                          fastemit_lambda=float(fastemit_lambda), delay_penalty=float(delay_penalty))
    nll = custom_ops.loss_call(logits.contiguous(), None, targets.contiguous(), logit_lengths, target_lengths,
                            logits.size(-1), options, check_inputs, inplace_grad)
    return reduce_losses(nll, reduction, zero_infinity)


def reduce_losses(nll, reduction, zero_infinity):
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
    """Module form of :func:`transducer_loss`: ``TransducerLoss(blank=0)(logits, targets, T, U)``.

    Args:
        blank (int, optional): the blank's column; negative counts from the end. (Default: ``0``)
        **options: ``reduction``, ``one_sym_per_frame``, ``from_log_softmax``, ``zero_infinity``,
            ``check_inputs``, ``inplace_grad``, ``clamp``, ``fastemit_lambda``, ``delay_penalty``, as for
            :func:`transducer_loss`.
    """

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
        """The loss of compact or padded ``logits`` with the module's options (see :func:`transducer_loss`)."""
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
        logits (Tensor): padded ``(B, maxT, maxU+1, V)`` scores as torchaudio takes them, or compact
            ``(sum_b T_b*(U_b+1), V)``; float16 / bfloat16 / float32 / float64.
        targets (Tensor): ``(B, maxU)`` int32 / int64 labels.
        logit_lengths (Tensor): ``(B,)`` int32 / int64 frames.
        target_lengths (Tensor): ``(B,)`` int32 / int64 labels.
        blank (int, optional): the blank's column; negative counts from the end. (Default: ``-1``, the last)
        clamp (float, optional): if > 0, each gradient element for a unit incoming gradient is clamped to
            ``[-clamp, clamp]``. (Default: ``-1``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"``. (Default: ``"mean"``)
        fused_log_softmax (bool, optional): ``False``: the logits are log-probabilities. (Default: ``True``)
        fastemit_lambda (float, optional): keyword-only, not torchaudio's: as for :func:`transducer_loss`.
            (Default: ``0.0``)
        delay_penalty (float, optional): keyword-only, not torchaudio's: as for :func:`transducer_loss`.
            (Default: ``0.0``)

    Returns:
        Tensor: as :func:`transducer_loss`: float32 (float64 for float64 logits), where torchaudio returns the
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
    """torchaudio's ``RNNTLoss(blank=-1, clamp=-1, reduction="mean", fused_log_softmax=True)``.

    Args:
        blank, clamp, reduction, fused_log_softmax, fastemit_lambda, delay_penalty: as for :func:`rnnt_loss`.
    """

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
        """The loss of ``logits`` with the module's options (see :func:`rnnt_loss`)."""
        return rnnt_loss(logits, targets, logit_lengths, target_lengths, blank=self.blank, clamp=self.clamp,
                         reduction=self.reduction, fused_log_softmax=self.fused_log_softmax,
                         fastemit_lambda=self.fastemit_lambda, delay_penalty=self.delay_penalty)

    def extra_repr(self):
        return (f"blank={self.blank}, clamp={self.clamp}, reduction={self.reduction!r}, "
                f"fused_log_softmax={self.fused_log_softmax}, fastemit_lambda={self.fastemit_lambda}, "
                f"delay_penalty={self.delay_penalty}")
