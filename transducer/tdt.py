"""The Token-and-Duration Transducer (TDT) loss (Xu et al., ICML 2023, arXiv 2304.06795; NeMo's semantics):
the functional form and the module, on the op ``transducer::loss`` (transducer/custom_ops.py). The math and the
stage contract: transducer/backend.py; the stages: transducer/cpu/stages.py and transducer/cuda/tdt.cu.
"""

from typing import Optional, Sequence

from torch import Tensor

from .checks import FLOAT_DTYPES, check_batch, check_blank, check_tensor
from .custom_ops import in_place_rows, loss_call
from .entries import Entry, LossModule, Param, check_options, declare
from .loss import LOGITS_TENSORS, reduce_losses
from .options import REQUIRED, TDT, LossOptions, check_device_limits, joint_checks

__all__ = ["tdt_loss", "TDTLoss"]

_DURATION_LOGITS = Param(
    "duration_logits",
    "Tensor",
    "``(sum_TU, D)`` or ``(B, maxT, maxU+1, D)``: the duration head "
    "on its own (transformers' joint has two heads; concatenating them would copy the largest "
    "tensor of the step); None: the last D columns of ``logits``.",
    None,
)
_ORDER = (
    "durations",
    "blank",
    "sigma",
    "omega",
    "reduction",
    "fastemit_lambda",
    "clamp",
    "zero_infinity",
    "check_inputs",
    _DURATION_LOGITS,
    "delay_penalty",
)
_TDT_LOGITS = Param(
    "logits",
    "Tensor",
    "compact ``(sum_b T_b*(U_b+1), V + D)`` or padded "
    "``(B, maxT, maxU+1, V + D)``, float16 / bfloat16 / float32 / float64: V token scores (blank "
    "among them) then D = len(durations) duration scores per row (NeMo's joint); with "
    "``duration_logits``, the V token scores alone. Rows with a unit last stride are read in place (a "
    "column slice of a wider tensor), other layouts copied once.",
)
_DOCS = {
    "blank": "the blank among the token columns, in ``[-V, V)``; negative counts from the end (``-1``: NeMo's "
    "blank, the last token column).",
    "reduction": '``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as NeMo\'s ``TDTLossNumba``; '
    'NeMo\'s ``RNNTLoss`` with its ``reduction="mean"`` and transformers divide by the target lengths first).',
}
TDT_LOSS = Entry(
    "tdt_loss", (TDT,), (_TDT_LOGITS,) + LOGITS_TENSORS[1:] + _ORDER, defaults={"durations": REQUIRED}, docs=_DOCS
)


def _tdt_loss(logits, targets, logit_lengths, target_lengths, duration_logits, options):
    """tdt_loss's work (its arguments checked; ``options``: the options as given)."""
    check_tensor("logits", logits, FLOAT_DTYPES, (2, 4), None)
    device = logits.device
    o = check_options(options)
    _check_given(o)
    D = len(o["durations"])
    if duration_logits is None:
        V = logits.size(-1) - D
    else:
        check_tensor("duration_logits", duration_logits, (logits.dtype,), (logits.dim(),), device)
        if duration_logits.shape[:-1] != logits.shape[:-1] or duration_logits.size(-1) != D:
            raise ValueError(
                f"duration_logits: expected shape {tuple(logits.shape[:-1]) + (D,)} (logits' rows, "
                f"len(durations) columns), got {tuple(duration_logits.shape)}"
            )
        V = logits.size(-1)
    if V < 2:
        before = f" before the {D} duration columns" if duration_logits is None else ""
        raise ValueError(f"logits: expected at least 2 token columns{before}, got shape {tuple(logits.shape)}")
    check_batch(logits, targets, logit_lengths, target_lengths)
    blank = check_blank(o.pop("blank"), V, "the token columns")
    reduction, zero_infinity, check_inputs = o.pop("reduction"), o.pop("zero_infinity"), o.pop("check_inputs")
    loss_options = LossOptions(blank=blank, **o)
    check_device_limits(loss_options, device)
    joint_checks(loss_options)
    nll = loss_call(
        (in_place_rows(logits), None if duration_logits is None else in_place_rows(duration_logits)),
        targets.contiguous(),
        logit_lengths,
        target_lengths,
        V,
        loss_options,
        check_inputs,
    )
    return reduce_losses(nll, reduction, zero_infinity)


declare(TDT_LOSS)


def tdt_loss(
    logits: Tensor,
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    durations: Sequence[int],
    blank: int = 0,
    sigma: float = 0.0,
    omega: float = 0.0,
    reduction: str = "mean",
    fastemit_lambda: float = 0.0,
    clamp: float = -1.0,
    zero_infinity: bool = False,
    check_inputs: bool = True,
    duration_logits: Optional[Tensor] = None,
    delay_penalty: float = 0.0,
) -> Tensor:
    r"""Token-and-Duration Transducer loss (Xu et al. 2023; NeMo's semantics), over compact or padded scores.

    Args:
        logits (Tensor): compact ``(sum_b T_b*(U_b+1), V + D)`` or padded ``(B, maxT, maxU+1, V + D)``, float16 /
            bfloat16 / float32 / float64: V token scores (blank among them) then D = len(durations) duration scores
            per row (NeMo's joint); with ``duration_logits``, the V token scores alone. Rows with a unit last stride
            are read in place (a column slice of a wider tensor), other layouts copied once.
        targets (Tensor): ``(B, S)`` int32 / int64 labels, ``S >= max U_b``, in ``[0, V)`` and not ``blank``;
            entries past ``U_b`` are ignored.
        logit_lengths (Tensor): ``(B,)`` int32 / int64 frames, ``T_b >= 1``.
        target_lengths (Tensor): ``(B,)`` int32 / int64 labels, ``U_b >= 0``.
        durations (list of int): TDT's durations (frames a symbol covers): distinct ints in [0, 65535], at least one
            >= 1, at most 16 (``layout.MAX_DURATIONS``) on CUDA; the last D = len(durations) score columns are
            theirs.
        blank (int, optional): the blank among the token columns, in ``[-V, V)``; negative counts from the end
            (``-1``: NeMo's blank, the last token column). (Default: ``0``)
        sigma (float, optional): logit under-normalisation: token log-probs are ``log_softmax - sigma``. (Default:
            ``0.0``)
        omega (float, optional): in ``[0, 1)``; the loss is ``(1 - omega) * tdt + omega * rnnt``, rnnt the plain
            RNN-T loss of the token scores without sigma (the expectation of NeMo's sampling it). (Default: ``0.0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as NeMo's
            ``TDTLossNumba``; NeMo's ``RNNTLoss`` with its ``reduction="mean"`` and transformers divide by the
            target lengths first). (Default: ``'mean'``)
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
        duration_logits (Tensor, optional): ``(sum_TU, D)`` or ``(B, maxT, maxU+1, D)``: the duration head on its
            own (transformers' joint has two heads; concatenating them would copy the largest tensor of the step);
            None: the last D columns of ``logits``. (Default: ``None``)
        delay_penalty (float, optional): k2's delay penalty: the label log-prob of cell (t, u) of utterance b gets
            ``delay_penalty * ((T_b - 1) / 2 - t)`` before the recursion. (Default: ``0.0``)

    Returns:
        Tensor: float32 loss (float64 for float64 scores): ``(B,)`` for ``"none"``, else a scalar. An
        utterance with no alignment gets ``+inf`` and zero gradient. Gradients flow to ``logits`` (and
        ``duration_logits``) in their dtype; the one of ``logits`` in padded rows as for
        :func:`transducer_loss`.

    Example::

        >>> logits = torch.randn(2, 6, 3, 5 + 3, requires_grad=True)   # V = 5 tokens, durations 0, 1, 2
        >>> tdt_loss(logits, torch.tensor([[1, 2], [3, 0]]), torch.tensor([6, 4]), torch.tensor([2, 1]),
        ...          durations=[0, 1, 2]).backward()
    """
    return _tdt_loss(
        logits,
        targets,
        logit_lengths,
        target_lengths,
        duration_logits,
        dict(
            durations=durations,
            blank=blank,
            sigma=sigma,
            omega=omega,
            reduction=reduction,
            fastemit_lambda=fastemit_lambda,
            clamp=clamp,
            zero_infinity=zero_infinity,
            check_inputs=check_inputs,
            delay_penalty=delay_penalty,
        ),
    )


def _check_given(options):
    """The checked options hold the durations (an option the other losses leave out, so None by default)."""
    if not options["durations"]:
        raise ValueError(
            "durations: the TDT loss needs its durations (distinct ints >= 0, at least one >= 1), got None"
        )


_MODULE = TDT_LOSS._replace(name="TDTLoss", params=tuple(p for p in _ORDER if p != _DURATION_LOGITS))


TDTLOSS_MODULE = declare(_MODULE)


class TDTLoss(LossModule):
    """Module form of :func:`tdt_loss`: ``TDTLoss(durations=[0, 1, 2, 3, 4], blank=0)(logits, targets, T, U)``.

    Args:
        durations (list of int): TDT's durations (frames a symbol covers): distinct ints in [0, 65535], at least one
            >= 1, at most 16 (``layout.MAX_DURATIONS``) on CUDA; the last D = len(durations) score columns are
            theirs.
        blank (int, optional): the blank among the token columns, in ``[-V, V)``; negative counts from the end
            (``-1``: NeMo's blank, the last token column). (Default: ``0``)
        sigma (float, optional): logit under-normalisation: token log-probs are ``log_softmax - sigma``. (Default:
            ``0.0``)
        omega (float, optional): in ``[0, 1)``; the loss is ``(1 - omega) * tdt + omega * rnnt``, rnnt the plain
            RNN-T loss of the token scores without sigma (the expectation of NeMo's sampling it). (Default: ``0.0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as NeMo's
            ``TDTLossNumba``; NeMo's ``RNNTLoss`` with its ``reduction="mean"`` and transformers divide by the
            target lengths first). (Default: ``'mean'``)
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
        durations: Sequence[int],
        blank: int = 0,
        sigma: float = 0.0,
        omega: float = 0.0,
        reduction: str = "mean",
        fastemit_lambda: float = 0.0,
        clamp: float = -1.0,
        zero_infinity: bool = False,
        check_inputs: bool = True,
        delay_penalty: float = 0.0,
    ) -> None:
        super().__init__(
            dict(
                durations=durations,
                blank=blank,
                sigma=sigma,
                omega=omega,
                reduction=reduction,
                fastemit_lambda=fastemit_lambda,
                clamp=clamp,
                zero_infinity=zero_infinity,
                check_inputs=check_inputs,
                delay_penalty=delay_penalty,
            )
        )

    def check(self, options):
        _check_given(options)

    def forward(self, logits, targets, logit_lengths, target_lengths, duration_logits=None):
        """The loss of ``logits`` (and ``duration_logits``, the duration head on its own) with the module's
        options (see :func:`tdt_loss`)."""
        return tdt_loss(logits, targets, logit_lengths, target_lengths, duration_logits=duration_logits, **self.options)
