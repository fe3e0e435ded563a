"""The transducer loss: the functional form, the module, and torchaudio's spelling of both.

The work happens in the op ``transducer::loss`` (transducer/custom_ops.py), which every loss shares; this
module checks the arguments (types, shapes, options: everything that needs no look at tensor values),
makes logits and targets contiguous where autograd sees the copy, and reduces the per-utterance
losses with plain torch ops, so that torch.compile traces all of it.
"""

import torch
from torch import Tensor

from . import custom_ops
from .checks import FLOAT_DTYPES, check_batch, check_blank, check_tensor
from .entries import Entry, LossModule, Param, check_options, declare
from .options import RNNT, LossOptions, joint_checks

#: The tensors every loss over logits takes first.
LOGITS_TENSORS = (
    Param(
        "logits",
        "Tensor",
        "unnormalised scores, float16 / bfloat16 / float32 / float64: compact "
        "``(sum_b T_b*(U_b+1), V)`` (utterance b's (T_b, U_b+1) grid row-major, utterances one after another) or "
        "padded ``(B, maxT, maxU+1, V)``, picked by ``logits.dim()``. Log-probs are ``x - logsumexp(x)``, accurate "
        "to about ``|x|`` times the dtype's epsilon: fp32 scores within about +-1e4 keep them to 1e-3 (a common "
        "offset of 1e8 leaves nothing of them); larger scores still give a finite loss and a finite gradient, "
        "but a coarse one.",
    ),
    Param(
        "targets",
        "Tensor",
        "``(B, S)`` int32 / int64 labels, ``S >= max U_b``, in ``[0, V)`` and not ``blank``; "
        "entries past ``U_b`` are ignored.",
    ),
    Param("logit_lengths", "Tensor", "``(B,)`` int32 / int64 frames, ``T_b >= 1``."),
    Param("target_lengths", "Tensor", "``(B,)`` int32 / int64 labels, ``U_b >= 0``."),
)
_TRANSDUCER_LOSS_ORDER = (
    "blank",
    "reduction",
    "one_sym_per_frame",
    "from_log_softmax",
    "zero_infinity",
    "check_inputs",
    "inplace_grad",
    "clamp",
    "fastemit_lambda",
    "delay_penalty",
)
TRANSDUCER_LOSS = Entry("transducer_loss", (RNNT,), LOGITS_TENSORS + _TRANSDUCER_LOSS_ORDER)
_TORCHAUDIO_BLANK = "the blank's column; negative counts from the end (torchaudio's default: the last)."
RNNT_LOSS = Entry(
    "rnnt_loss",
    (RNNT,),
    LOGITS_TENSORS + ("blank", "clamp", "reduction", "fused_log_softmax"),
    exclude=("from_log_softmax",),
    defaults={"blank": -1},
    docs={"blank": _TORCHAUDIO_BLANK},
)


def _transducer_loss(logits, targets, logit_lengths, target_lengths, options):
    """transducer_loss's work (its arguments checked; ``options``: the options as given)."""
    check_tensor("logits", logits, FLOAT_DTYPES, (2, 4), None)
    check_batch(logits, targets, logit_lengths, target_lengths)
    o = check_options(options)
    blank = check_blank(o.pop("blank"), logits.size(-1))
    inplace_grad = o.pop("inplace_grad", False)
    if inplace_grad:
        check_inplace_grad(logits)
    if "fused_log_softmax" in o:  # torchaudio's spelling
        o["from_log_softmax"] = not o.pop("fused_log_softmax")
    reduction, zero_infinity, check_inputs = o.pop("reduction"), o.pop("zero_infinity"), o.pop("check_inputs")
    loss_options = LossOptions(blank=blank, **o)
    joint_checks(loss_options)
    nll = custom_ops.loss_call(
        (logits.contiguous(), None),
        targets.contiguous(),
        logit_lengths,
        target_lengths,
        logits.size(-1),
        loss_options,
        check_inputs,
        inplace_grad,
    )
    return reduce_losses(nll, reduction, zero_infinity)


def check_inplace_grad(logits):
    """inplace_grad writes the gradient over the logits' values: refused for a leaf that requires grad (or a
    view of one), whose values are the caller's and whose ``.grad`` autograd copies into a tensor of its
    own."""
    base = logits._base if logits._base is not None else logits
    if base.requires_grad and base.is_leaf:
        raise ValueError(
            "inplace_grad: the logits are (a view of) a leaf tensor that requires grad; the gradient "
            "would overwrite their values and autograd would copy it into .grad anyway. Use "
            "inplace_grad=True only for logits an op produced (a joiner Linear's output that feeds "
            "only this loss)"
        )


declare(TRANSDUCER_LOSS)


def transducer_loss(
    logits: Tensor,
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    blank: int = 0,
    reduction: str = "mean",
    one_sym_per_frame: bool = False,
    from_log_softmax: bool = False,
    zero_infinity: bool = False,
    check_inputs: bool = True,
    inplace_grad: bool = False,
    clamp: float = -1.0,
    fastemit_lambda: float = 0.0,
    delay_penalty: float = 0.0,
) -> Tensor:
    r"""Transducer (RNN-T) loss, or with ``one_sym_per_frame`` the RNA loss, over compact or padded logits.

    Args:
        logits (Tensor): unnormalised scores, float16 / bfloat16 / float32 / float64: compact
            ``(sum_b T_b*(U_b+1), V)`` (utterance b's (T_b, U_b+1) grid row-major, utterances one after another) or
            padded ``(B, maxT, maxU+1, V)``, picked by ``logits.dim()``. Log-probs are ``x - logsumexp(x)``,
            accurate to about ``|x|`` times the dtype's epsilon: fp32 scores within about +-1e4 keep them to 1e-3 (a
            common offset of 1e8 leaves nothing of them); larger scores still give a finite loss and a finite
            gradient, but a coarse one.
        targets (Tensor): ``(B, S)`` int32 / int64 labels, ``S >= max U_b``, in ``[0, V)`` and not ``blank``;
            entries past ``U_b`` are ignored.
        logit_lengths (Tensor): ``(B,)`` int32 / int64 frames, ``T_b >= 1``.
        target_lengths (Tensor): ``(B,)`` int32 / int64 labels, ``U_b >= 0``.
        blank (int, optional): the blank's column, in ``[-V, V)``; negative counts from the end. (Default: ``0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as torchaudio).
            (Default: ``'mean'``)
        one_sym_per_frame (bool, optional): RNA: a label moves (t, u) -> (t+1, u+1); an utterance with
            ``U_b > T_b - 1`` has no alignment and loss ``+inf``. (Default: ``False``)
        from_log_softmax (bool, optional): the logits are log-probabilities already; the gradient is w.r.t. them.
            (Default: ``False``)
        zero_infinity (bool, optional): infinite losses become 0 (their gradient is zero either way); NaN losses
            stay NaN. (Default: ``False``)
        check_inputs (bool, optional): check lengths and labels against the tensors (on CUDA one small
            device-to-host read, overlapping the first pass); ``False``: no host synchronisation (CUDA graphs),
            out-of-range values give undefined results. (Default: ``True``)
        inplace_grad (bool, optional): write the gradient over the logits in backward, saving a logits-sized buffer;
            for logits an op produced that nothing else needs (a joiner ``Linear``'s output). A leaf that requires
            grad (or a view of one) is refused with a ValueError. (Default: ``False``)
        clamp (float, optional): if > 0, each gradient element for a unit incoming gradient is clamped to
            ``[-clamp, clamp]`` before the incoming gradient scales it (torchaudio's; TDT: the token scores'
            gradient alone, as NeMo's). (Default: ``-1.0``)
        fastemit_lambda (float, optional): FastEmit (Yu et al. 2021): the gradient w.r.t. every label log-prob times
            ``1 + fastemit_lambda``; the loss value is unchanged. In ``[0, 65503]``: the gradient's entries reach
            ``1 + fastemit_lambda``, which stays finite in float16. (Default: ``0.0``)
        delay_penalty (float, optional): k2's delay penalty: the label log-prob of cell (t, u) of utterance b gets
            ``delay_penalty * ((T_b - 1) / 2 - t)`` before the recursion. (Default: ``0.0``)

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
    return _transducer_loss(
        logits,
        targets,
        logit_lengths,
        target_lengths,
        dict(
            blank=blank,
            reduction=reduction,
            one_sym_per_frame=one_sym_per_frame,
            from_log_softmax=from_log_softmax,
            zero_infinity=zero_infinity,
            check_inputs=check_inputs,
            inplace_grad=inplace_grad,
            clamp=clamp,
            fastemit_lambda=fastemit_lambda,
            delay_penalty=delay_penalty,
        ),
    )


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


TRANSDUCERLOSS_MODULE = declare(TRANSDUCER_LOSS._replace(name="TransducerLoss", params=_TRANSDUCER_LOSS_ORDER))


class TransducerLoss(LossModule):
    """Module form of :func:`transducer_loss`: ``TransducerLoss(blank=0)(logits, targets, T, U)``.

    Args:
        blank (int, optional): the blank's column, in ``[-V, V)``; negative counts from the end. (Default: ``0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as torchaudio).
            (Default: ``'mean'``)
        one_sym_per_frame (bool, optional): RNA: a label moves (t, u) -> (t+1, u+1); an utterance with
            ``U_b > T_b - 1`` has no alignment and loss ``+inf``. (Default: ``False``)
        from_log_softmax (bool, optional): the logits are log-probabilities already; the gradient is w.r.t. them.
            (Default: ``False``)
        zero_infinity (bool, optional): infinite losses become 0 (their gradient is zero either way); NaN losses
            stay NaN. (Default: ``False``)
        check_inputs (bool, optional): check lengths and labels against the tensors (on CUDA one small
            device-to-host read, overlapping the first pass); ``False``: no host synchronisation (CUDA graphs),
            out-of-range values give undefined results. (Default: ``True``)
        inplace_grad (bool, optional): write the gradient over the logits in backward, saving a logits-sized buffer;
            for logits an op produced that nothing else needs (a joiner ``Linear``'s output). A leaf that requires
            grad (or a view of one) is refused with a ValueError. (Default: ``False``)
        clamp (float, optional): if > 0, each gradient element for a unit incoming gradient is clamped to
            ``[-clamp, clamp]`` before the incoming gradient scales it (torchaudio's; TDT: the token scores'
            gradient alone, as NeMo's). (Default: ``-1.0``)
        fastemit_lambda (float, optional): FastEmit (Yu et al. 2021): the gradient w.r.t. every label log-prob times
            ``1 + fastemit_lambda``; the loss value is unchanged. In ``[0, 65503]``: the gradient's entries reach
            ``1 + fastemit_lambda``, which stays finite in float16. (Default: ``0.0``)
        delay_penalty (float, optional): k2's delay penalty: the label log-prob of cell (t, u) of utterance b gets
            ``delay_penalty * ((T_b - 1) / 2 - t)`` before the recursion. (Default: ``0.0``)
    """

    def __init__(
        self,
        blank: int = 0,
        reduction: str = "mean",
        one_sym_per_frame: bool = False,
        from_log_softmax: bool = False,
        zero_infinity: bool = False,
        check_inputs: bool = True,
        inplace_grad: bool = False,
        clamp: float = -1.0,
        fastemit_lambda: float = 0.0,
        delay_penalty: float = 0.0,
    ) -> None:
        super().__init__(
            dict(
                blank=blank,
                reduction=reduction,
                one_sym_per_frame=one_sym_per_frame,
                from_log_softmax=from_log_softmax,
                zero_infinity=zero_infinity,
                check_inputs=check_inputs,
                inplace_grad=inplace_grad,
                clamp=clamp,
                fastemit_lambda=fastemit_lambda,
                delay_penalty=delay_penalty,
            )
        )

    def forward(self, logits, targets, logit_lengths, target_lengths):
        """The loss of compact or padded ``logits`` with the module's options (see :func:`transducer_loss`)."""
        return transducer_loss(logits, targets, logit_lengths, target_lengths, **self.options)


# ----------------------------------------------------------------------------- torchaudio's spelling


def _rnnt_loss(logits, targets, logit_lengths, target_lengths, options):
    """rnnt_loss's work (its arguments checked; ``options``: the options as given)."""
    loss = _transducer_loss(logits, targets, logit_lengths, target_lengths, options)
    return loss.to(logits.dtype)  # torchaudio's dtype; a no-op for float32 and float64 logits


declare(RNNT_LOSS)


def rnnt_loss(
    logits: Tensor,
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    blank: int = -1,
    clamp: float = -1.0,
    reduction: str = "mean",
    fused_log_softmax: bool = True,
    *,
    one_sym_per_frame: bool = False,
    zero_infinity: bool = False,
    check_inputs: bool = True,
    fastemit_lambda: float = 0.0,
    delay_penalty: float = 0.0,
) -> Tensor:
    """torchaudio's ``rnnt_loss``, same arguments and semantics: switch with one changed import. The arguments
    after ``fused_log_softmax`` are keyword-only and not torchaudio's: as for :func:`transducer_loss`.

    Args:
        logits (Tensor): unnormalised scores, float16 / bfloat16 / float32 / float64: compact
            ``(sum_b T_b*(U_b+1), V)`` (utterance b's (T_b, U_b+1) grid row-major, utterances one after another) or
            padded ``(B, maxT, maxU+1, V)``, picked by ``logits.dim()``. Log-probs are ``x - logsumexp(x)``,
            accurate to about ``|x|`` times the dtype's epsilon: fp32 scores within about +-1e4 keep them to 1e-3 (a
            common offset of 1e8 leaves nothing of them); larger scores still give a finite loss and a finite
            gradient, but a coarse one.
        targets (Tensor): ``(B, S)`` int32 / int64 labels, ``S >= max U_b``, in ``[0, V)`` and not ``blank``;
            entries past ``U_b`` are ignored.
        logit_lengths (Tensor): ``(B,)`` int32 / int64 frames, ``T_b >= 1``.
        target_lengths (Tensor): ``(B,)`` int32 / int64 labels, ``U_b >= 0``.
        blank (int, optional): the blank's column; negative counts from the end (torchaudio's default: the last).
            (Default: ``-1``)
        clamp (float, optional): if > 0, each gradient element for a unit incoming gradient is clamped to
            ``[-clamp, clamp]`` before the incoming gradient scales it (torchaudio's; TDT: the token scores'
            gradient alone, as NeMo's). (Default: ``-1.0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as torchaudio).
            (Default: ``'mean'``)
        fused_log_softmax (bool, optional): ``False``: the logits are log-probabilities (torchaudio's spelling of
            ``not from_log_softmax``). (Default: ``True``)
        one_sym_per_frame (bool, optional): RNA: a label moves (t, u) -> (t+1, u+1); an utterance with
            ``U_b > T_b - 1`` has no alignment and loss ``+inf``. (Default: ``False``)
        zero_infinity (bool, optional): infinite losses become 0 (their gradient is zero either way); NaN losses
            stay NaN. (Default: ``False``)
        check_inputs (bool, optional): check lengths and labels against the tensors (on CUDA one small
            device-to-host read, overlapping the first pass); ``False``: no host synchronisation (CUDA graphs),
            out-of-range values give undefined results. (Default: ``True``)
        fastemit_lambda (float, optional): FastEmit (Yu et al. 2021): the gradient w.r.t. every label log-prob times
            ``1 + fastemit_lambda``; the loss value is unchanged. In ``[0, 65503]``: the gradient's entries reach
            ``1 + fastemit_lambda``, which stays finite in float16. (Default: ``0.0``)
        delay_penalty (float, optional): k2's delay penalty: the label log-prob of cell (t, u) of utterance b gets
            ``delay_penalty * ((T_b - 1) / 2 - t)`` before the recursion. (Default: ``0.0``)

    Returns:
        Tensor: as :func:`transducer_loss`, in the logits' dtype, as torchaudio returns it (computed in float32, or
        float64 for float64 logits, then rounded: a float16 loss above 65504 is ``inf``).

    Example::

        >>> from transducer import rnnt_loss       # was: from torchaudio.functional import rnnt_loss
        >>> logits = torch.randn(2, 5, 3, 7, requires_grad=True)
        >>> rnnt_loss(logits, torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), torch.tensor([5, 4]),
        ...           torch.tensor([2, 1])).backward()
    """
    return _rnnt_loss(
        logits,
        targets,
        logit_lengths,
        target_lengths,
        dict(
            blank=blank,
            clamp=clamp,
            reduction=reduction,
            fused_log_softmax=fused_log_softmax,
            one_sym_per_frame=one_sym_per_frame,
            zero_infinity=zero_infinity,
            check_inputs=check_inputs,
            fastemit_lambda=fastemit_lambda,
            delay_penalty=delay_penalty,
        ),
    )


RNNTLOSS_MODULE = declare(RNNT_LOSS._replace(name="RNNTLoss", params=RNNT_LOSS.params[4:]))


class RNNTLoss(LossModule):
    """torchaudio's ``RNNTLoss(blank=-1, clamp=-1, reduction="mean", fused_log_softmax=True)``; the arguments after
    ``fused_log_softmax`` are keyword-only and not torchaudio's (see :func:`rnnt_loss`).

    Args:
        blank (int, optional): the blank's column; negative counts from the end (torchaudio's default: the last).
            (Default: ``-1``)
        clamp (float, optional): if > 0, each gradient element for a unit incoming gradient is clamped to
            ``[-clamp, clamp]`` before the incoming gradient scales it (torchaudio's; TDT: the token scores'
            gradient alone, as NeMo's). (Default: ``-1.0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as torchaudio).
            (Default: ``'mean'``)
        fused_log_softmax (bool, optional): ``False``: the logits are log-probabilities (torchaudio's spelling of
            ``not from_log_softmax``). (Default: ``True``)
        one_sym_per_frame (bool, optional): RNA: a label moves (t, u) -> (t+1, u+1); an utterance with
            ``U_b > T_b - 1`` has no alignment and loss ``+inf``. (Default: ``False``)
        zero_infinity (bool, optional): infinite losses become 0 (their gradient is zero either way); NaN losses
            stay NaN. (Default: ``False``)
        check_inputs (bool, optional): check lengths and labels against the tensors (on CUDA one small
            device-to-host read, overlapping the first pass); ``False``: no host synchronisation (CUDA graphs),
            out-of-range values give undefined results. (Default: ``True``)
        fastemit_lambda (float, optional): FastEmit (Yu et al. 2021): the gradient w.r.t. every label log-prob times
            ``1 + fastemit_lambda``; the loss value is unchanged. In ``[0, 65503]``: the gradient's entries reach
            ``1 + fastemit_lambda``, which stays finite in float16. (Default: ``0.0``)
        delay_penalty (float, optional): k2's delay penalty: the label log-prob of cell (t, u) of utterance b gets
            ``delay_penalty * ((T_b - 1) / 2 - t)`` before the recursion. (Default: ``0.0``)
    """

    def __init__(
        self,
        blank: int = -1,
        clamp: float = -1.0,
        reduction: str = "mean",
        fused_log_softmax: bool = True,
        *,
        one_sym_per_frame: bool = False,
        zero_infinity: bool = False,
        check_inputs: bool = True,
        fastemit_lambda: float = 0.0,
        delay_penalty: float = 0.0,
    ) -> None:
        super().__init__(
            dict(
                blank=blank,
                clamp=clamp,
                reduction=reduction,
                fused_log_softmax=fused_log_softmax,
                one_sym_per_frame=one_sym_per_frame,
                zero_infinity=zero_infinity,
                check_inputs=check_inputs,
                fastemit_lambda=fastemit_lambda,
                delay_penalty=delay_penalty,
            )
        )

    def forward(self, logits, targets, logit_lengths, target_lengths):
        """The loss of ``logits`` with the module's options (see :func:`rnnt_loss`)."""
        return rnnt_loss(logits, targets, logit_lengths, target_lengths, **self.options)
