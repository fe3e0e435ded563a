"""The transducer loss: the functional form, the module, and torchaudio's spelling of both.

The work happens in the op ``transducer::loss`` (transducer/custom_ops.py), which every loss shares; this
module checks the arguments (types, shapes, options: everything that needs no look at tensor values),
makes logits and targets contiguous where autograd sees the copy, and reduces the per-utterance
losses with plain torch ops, so that torch.compile traces all of it.
"""

import torch

from . import custom_ops
from .checks import FLOAT_DTYPES, check_batch, check_blank, check_tensor
from .options import LossOptions, RNNT, joint_checks
from .signatures import Entry, LossModule, Param, check_options, public_function

#: The tensors every loss over logits takes first.
LOGITS_TENSORS = (
    Param("logits", "Tensor", "unnormalised scores, float16 / bfloat16 / float32 / float64: compact "
          "``(sum_b T_b*(U_b+1), V)`` (utterance b's (T_b, U_b+1) grid row-major, utterances one after another) or "
          "padded ``(B, maxT, maxU+1, V)``, picked by ``logits.dim()``."),
    Param("targets", "Tensor", "``(B, S)`` int32 / int64 labels, ``S >= max U_b``, in ``[0, V)`` and not ``blank``; "
          "entries past ``U_b`` are ignored."),
    Param("logit_lengths", "Tensor", "``(B,)`` int32 / int64 frames, ``T_b >= 1``."),
    Param("target_lengths", "Tensor", "``(B,)`` int32 / int64 labels, ``U_b >= 0``."),
)
_TRANSDUCER_LOSS_ORDER = ("blank", "reduction", "one_sym_per_frame", "from_log_softmax", "zero_infinity",
                          "check_inputs", "inplace_grad", "clamp", "fastemit_lambda", "delay_penalty")
TRANSDUCER_LOSS = Entry("transducer_loss", (RNNT,), LOGITS_TENSORS + _TRANSDUCER_LOSS_ORDER)
_TORCHAUDIO_BLANK = "the blank's column; negative counts from the end (torchaudio's default: the last)."
RNNT_LOSS = Entry("rnnt_loss", (RNNT,), LOGITS_TENSORS + ("blank", "clamp", "reduction", "fused_log_softmax"),
                  exclude=("from_log_softmax",), defaults={"blank": -1}, docs={"blank": _TORCHAUDIO_BLANK})


def _transducer_loss(logits, targets, logit_lengths, target_lengths, options):
    r"""Transducer (RNN-T) loss, or with ``one_sym_per_frame`` the RNA loss, over compact or padded logits.

    Args:
        {args}

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
    check_tensor("logits", logits, FLOAT_DTYPES, (2, 4), None)
    check_batch(logits, targets, logit_lengths, target_lengths)
    o = check_options(options)
    blank = check_blank(o.pop("blank"), logits.size(-1))
    inplace_grad = o.pop("inplace_grad", False)
    if inplace_grad and not torch.compiler.is_compiling():
        check_inplace_grad(logits)
    if "fused_log_softmax" in o:  # torchaudio's spelling
        o["from_log_softmax"] = not o.pop("fused_log_softmax")
    reduction, zero_infinity, check_inputs = o.pop("reduction"), o.pop("zero_infinity"), o.pop("check_inputs")
    loss_options = LossOptions(blank=blank, **o)
    joint_checks(loss_options)
    nll = custom_ops.loss_call(logits.contiguous(), None, targets.contiguous(), logit_lengths, target_lengths,
                               logits.size(-1), loss_options, check_inputs, inplace_grad)
    return reduce_losses(nll, reduction, zero_infinity)


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


transducer_loss = public_function(TRANSDUCER_LOSS, _transducer_loss)


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


class TransducerLoss(LossModule, entry=TRANSDUCER_LOSS._replace(name="TransducerLoss",
                                                               params=_TRANSDUCER_LOSS_ORDER)):
    """Module form of :func:`transducer_loss`: ``TransducerLoss(blank=0)(logits, targets, T, U)``.

    Args:
        {args}
    """

    def forward(self, logits, targets, logit_lengths, target_lengths):
        """The loss of compact or padded ``logits`` with the module's options (see :func:`transducer_loss`)."""
        return transducer_loss(logits, targets, logit_lengths, target_lengths, **self.options)


# ----------------------------------------------------------------------------- torchaudio's spelling


def _rnnt_loss(logits, targets, logit_lengths, target_lengths, options):
    """torchaudio's ``rnnt_loss``, same arguments and semantics: switch with one changed import. The arguments
    after ``fused_log_softmax`` are keyword-only and not torchaudio's: as for :func:`transducer_loss`.

    Args:
        {args}

    Returns:
        Tensor: as :func:`transducer_loss`, in the logits' dtype, as torchaudio returns it (computed in float32, or
        float64 for float64 logits, then rounded: a float16 loss above 65504 is ``inf``).

    Example::

        >>> from transducer import rnnt_loss       # was: from torchaudio.functional import rnnt_loss
        >>> logits = torch.randn(2, 5, 3, 7, requires_grad=True)
        >>> rnnt_loss(logits, torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), torch.tensor([5, 4]),
        ...           torch.tensor([2, 1])).backward()
    """
    loss = _transducer_loss(logits, targets, logit_lengths, target_lengths, options)
    return loss.to(logits.dtype)  # torchaudio's dtype; a no-op for float32 and float64 logits


rnnt_loss = public_function(RNNT_LOSS, _rnnt_loss)


class RNNTLoss(LossModule, entry=RNNT_LOSS._replace(name="RNNTLoss", params=RNNT_LOSS.params[4:])):
    """torchaudio's ``RNNTLoss(blank=-1, clamp=-1, reduction="mean", fused_log_softmax=True)``; the arguments after
    ``fused_log_softmax`` are keyword-only and not torchaudio's (see :func:`rnnt_loss`).

    Args:
        {args}
    """

    def forward(self, logits, targets, logit_lengths, target_lengths):
        """The loss of ``logits`` with the module's options (see :func:`rnnt_loss`)."""
        return rnnt_loss(logits, targets, logit_lengths, target_lengths, **self.options)
