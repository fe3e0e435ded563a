"""The multi-blank RNN-T loss (Xu et al., "Multi-blank Transducers for Speech Recognition", ICASSP 2023, arXiv
2211.03541; NeMo's semantics): the functional form and the module, on the op ``transducer::loss``
(transducer/custom_ops.py). The math and the stage contract: transducer/backend.py. The stages are RNN-T's
log-probs and gradient with the big blanks' columns, and TDT's walk with the big blanks as blank arcs of
several frames.
"""

from typing import Sequence

from torch import Tensor

from .checks import FLOAT_DTYPES, check_batch, check_big_blank_durations, check_blank, check_tensor
from .custom_ops import loss_call
from .entries import Entry, LossModule, check_options, declare
from .loss import LOGITS_TENSORS, reduce_losses
from .options import MULTIBLANK, REQUIRED, LossOptions, check_device_limits, joint_checks

__all__ = ["multiblank_loss", "MultiblankLoss"]

_ORDER = (
    "big_blank_durations",
    "blank",
    "sigma",
    "reduction",
    "fastemit_lambda",
    "clamp",
    "zero_infinity",
    "check_inputs",
    "delay_penalty",
)
_DOCS = {
    "blank": "the standard blank's column (duration 1), in ``[-V, V)``; negative counts from the end (NeMo's "
    "models put it last: ``-1``).",
    "sigma": "logit under-normalisation: every log-prob is ``log_softmax - sigma``.",
    "reduction": '``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as NeMo\'s '
    '``MultiblankRNNTLossNumba``; NeMo\'s ``RNNTLoss`` with its ``reduction="mean"`` divides each loss by its '
    "target length first).",
}
MULTIBLANK_LOSS = Entry(
    "multiblank_loss",
    (MULTIBLANK,),
    LOGITS_TENSORS + _ORDER,
    defaults={"big_blank_durations": REQUIRED, "blank": REQUIRED},
    docs=_DOCS,
)


def _multiblank_loss(logits, targets, logit_lengths, target_lengths, options):
    """multiblank_loss's work (its arguments checked; ``options``: the options as given)."""
    check_tensor("logits", logits, FLOAT_DTYPES, (2, 4), None)
    check_batch(logits, targets, logit_lengths, target_lengths)
    o = check_options(options)
    _check_given(o)
    blank = check_blank(o.pop("blank"), logits.size(-1))
    reduction, zero_infinity, check_inputs = o.pop("reduction"), o.pop("zero_infinity"), o.pop("check_inputs")
    loss_options = LossOptions(blank=blank, **o)
    check_device_limits(loss_options, logits.device)
    joint_checks(loss_options)
    nll = loss_call(
        (logits.contiguous(), None),
        targets.contiguous(),
        logit_lengths,
        target_lengths,
        logits.size(-1),
        loss_options,
        check_inputs,
    )
    return reduce_losses(nll, reduction, zero_infinity)


declare(MULTIBLANK_LOSS)


def multiblank_loss(
    logits: Tensor,
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    big_blank_durations: Sequence[int],
    blank: int,
    sigma: float = 0.0,
    reduction: str = "mean",
    fastemit_lambda: float = 0.0,
    clamp: float = -1.0,
    zero_infinity: bool = False,
    check_inputs: bool = True,
    delay_penalty: float = 0.0,
) -> Tensor:
    r"""Multi-blank RNN-T loss (NeMo's semantics), over compact or padded logits: RNN-T with K big blanks that
    consume several frames at once.

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
        big_blank_durations (list of int): the multi-blank loss's K big blanks' durations, distinct ints in [2,
            65535] (at most 14 on CUDA); big blank i is the column ``blank - 1 - i``.
        blank (int): the standard blank's column (duration 1), in ``[-V, V)``; negative counts from the end (NeMo's
            models put it last: ``-1``).
        sigma (float, optional): logit under-normalisation: every log-prob is ``log_softmax - sigma``. (Default:
            ``0.0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as NeMo's
            ``MultiblankRNNTLossNumba``; NeMo's ``RNNTLoss`` with its ``reduction="mean"`` divides each loss by its
            target length first). (Default: ``'mean'``)
        fastemit_lambda (float, optional): FastEmit (Yu et al. 2021): the gradient w.r.t. every label log-prob times
            ``1 + fastemit_lambda``; the loss value is unchanged. In ``[0, 65503]``: the gradient's entries reach
            ``1 + fastemit_lambda``, which stays finite in float16. (Default: ``0.0``)
        clamp (float, optional): if > 0, each gradient element for a unit incoming gradient is clamped to
            ``[-clamp, clamp]`` before the incoming gradient scales it (torchaudio's; TDT: the token scores'
            gradient alone, as NeMo's). (Default: ``-1.0``)
        zero_infinity (bool, optional): infinite losses become 0 (their gradient is zero either way); NaN losses
            stay NaN. (Default: ``False``)
        check_inputs (bool, optional): check lengths and labels against the tensors (on CUDA one small
            device-to-host read, overlapping the first pass); ``False``: no host synchronisation (CUDA graphs),
            out-of-range values give undefined results. (Default: ``True``)
        delay_penalty (float, optional): k2's delay penalty: the label log-prob of cell (t, u) of utterance b gets
            ``delay_penalty * ((T_b - 1) / 2 - t)`` before the recursion. (Default: ``0.0``)

    Returns:
        Tensor: float32 loss (float64 for float64 logits): ``(B,)`` for ``"none"``, else a scalar. From (t, u)
        the label y_{u+1} goes to (t, u + 1), the blank to (t + 1, u), big blank i to (t + d_i, u); an alignment
        ends on reaching t = T_b with u = U_b through any blank. The gradient flows to ``logits`` in their dtype,
        computed in backward. Reference: :func:`transducer.reference.multiblank_loss_reference`.

    Example::

        >>> logits = torch.randn(2, 6, 3, 8, requires_grad=True)   # V = 8: blank 7, big blanks 6 and 5
        >>> multiblank_loss(logits, torch.tensor([[1, 2], [3, 0]]), torch.tensor([6, 4]), torch.tensor([2, 1]),
        ...                 big_blank_durations=[2, 4], blank=-1).backward()
    """
    return _multiblank_loss(
        logits,
        targets,
        logit_lengths,
        target_lengths,
        dict(
            big_blank_durations=big_blank_durations,
            blank=blank,
            sigma=sigma,
            reduction=reduction,
            fastemit_lambda=fastemit_lambda,
            clamp=clamp,
            zero_infinity=zero_infinity,
            check_inputs=check_inputs,
            delay_penalty=delay_penalty,
        ),
    )


def _check_given(options):
    """The checked options hold the big blanks' durations (an option the other losses leave out, so None by
    default)."""
    if not options["big_blank_durations"]:
        raise ValueError(
            "big_blank_durations: the multi-blank loss needs its big blanks' durations (distinct ints >= 2), got None"
        )


MULTIBLANKLOSS_MODULE = declare(MULTIBLANK_LOSS._replace(name="MultiblankLoss", params=_ORDER))


class MultiblankLoss(LossModule):
    """Module form of :func:`multiblank_loss`: ``MultiblankLoss([2, 4, 8], blank=-1)(logits, targets, T, U)``.

    Args:
        big_blank_durations (list of int): the multi-blank loss's K big blanks' durations, distinct ints in [2,
            65535] (at most 14 on CUDA); big blank i is the column ``blank - 1 - i``.
        blank (int): the standard blank's column (duration 1), in ``[-V, V)``; negative counts from the end (NeMo's
            models put it last: ``-1``).
        sigma (float, optional): logit under-normalisation: every log-prob is ``log_softmax - sigma``. (Default:
            ``0.0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as NeMo's
            ``MultiblankRNNTLossNumba``; NeMo's ``RNNTLoss`` with its ``reduction="mean"`` divides each loss by its
            target length first). (Default: ``'mean'``)
        fastemit_lambda (float, optional): FastEmit (Yu et al. 2021): the gradient w.r.t. every label log-prob times
            ``1 + fastemit_lambda``; the loss value is unchanged. In ``[0, 65503]``: the gradient's entries reach
            ``1 + fastemit_lambda``, which stays finite in float16. (Default: ``0.0``)
        clamp (float, optional): if > 0, each gradient element for a unit incoming gradient is clamped to
            ``[-clamp, clamp]`` before the incoming gradient scales it (torchaudio's; TDT: the token scores'
            gradient alone, as NeMo's). (Default: ``-1.0``)
        zero_infinity (bool, optional): infinite losses become 0 (their gradient is zero either way); NaN losses
            stay NaN. (Default: ``False``)
        check_inputs (bool, optional): check lengths and labels against the tensors (on CUDA one small
            device-to-host read, overlapping the first pass); ``False``: no host synchronisation (CUDA graphs),
            out-of-range values give undefined results. (Default: ``True``)
        delay_penalty (float, optional): k2's delay penalty: the label log-prob of cell (t, u) of utterance b gets
            ``delay_penalty * ((T_b - 1) / 2 - t)`` before the recursion. (Default: ``0.0``)
    """

    def __init__(
        self,
        big_blank_durations: Sequence[int],
        blank: int,
        sigma: float = 0.0,
        reduction: str = "mean",
        fastemit_lambda: float = 0.0,
        clamp: float = -1.0,
        zero_infinity: bool = False,
        check_inputs: bool = True,
        delay_penalty: float = 0.0,
    ) -> None:
        super().__init__(
            dict(
                big_blank_durations=big_blank_durations,
                blank=blank,
                sigma=sigma,
                reduction=reduction,
                fastemit_lambda=fastemit_lambda,
                clamp=clamp,
                zero_infinity=zero_infinity,
                check_inputs=check_inputs,
                delay_penalty=delay_penalty,
            )
        )

    def check(self, options):
        """The durations given, and fitting before a blank counted from the start (one counted from the end fits
        some V; multiblank_loss checks the fit once the blank's column is known)."""
        _check_given(options)
        if options["blank"] >= 0:
            check_big_blank_durations(options["big_blank_durations"], options["blank"])

    def forward(self, logits, targets, logit_lengths, target_lengths):
        """The loss of ``logits`` (compact or padded), as :func:`multiblank_loss` computes it."""
        return multiblank_loss(logits, targets, logit_lengths, target_lengths, **self.options)
