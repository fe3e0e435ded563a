"""The multi-blank RNN-T loss (Xu et al., "Multi-blank Transducers for Speech Recognition", ICASSP 2023, arXiv
2211.03541; NeMo's semantics): the functional form and the module, on the op ``transducer::loss``
(transducer/custom_ops.py). The math and the stage contract: transducer/backend.py. The stages are RNN-T's
log-probs and gradient with the big blanks' columns, and TDT's walk with the big blanks as blank arcs of
several frames.
"""

from .checks import FLOAT_DTYPES, check_batch, check_big_blank_durations, check_blank, check_tensor
from .custom_ops import loss_call
from .loss import LOGITS_TENSORS, reduce_losses
from .options import MULTIBLANK, REQUIRED, LossOptions, check_device_limits, joint_checks
from .signatures import Entry, LossModule, check_options, public_function

__all__ = ["multiblank_loss", "MultiblankLoss"]

_ORDER = ("big_blank_durations", "blank", "sigma", "reduction", "fastemit_lambda", "clamp", "zero_infinity",
          "check_inputs", "delay_penalty")
_DOCS = {"blank": "the standard blank's column (duration 1), in ``[-V, V)``; negative counts from the end (NeMo's "
                  "models put it last: ``-1``).",
         "sigma": "logit under-normalisation: every log-prob is ``log_softmax - sigma``.",
         "reduction": '``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as NeMo\'s '
                      "``MultiblankRNNTLossNumba``; NeMo's ``RNNTLoss`` divides each loss by its target length first)."}
MULTIBLANK_LOSS = Entry("multiblank_loss", (MULTIBLANK,), LOGITS_TENSORS + _ORDER,
                        defaults={"big_blank_durations": REQUIRED, "blank": REQUIRED}, docs=_DOCS)


def _multiblank_loss(logits, targets, logit_lengths, target_lengths, options):
    r"""Multi-blank RNN-T loss (NeMo's semantics), over compact or padded logits: RNN-T with K big blanks that
    consume several frames at once.

    Args:
        {args}

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
    check_tensor("logits", logits, FLOAT_DTYPES, (2, 4), None)
    check_batch(logits, targets, logit_lengths, target_lengths)
    o = check_options(options)
    _check_given(o)
    blank = check_blank(o.pop("blank"), logits.size(-1))
    reduction, zero_infinity, check_inputs = o.pop("reduction"), o.pop("zero_infinity"), o.pop("check_inputs")
    loss_options = LossOptions(blank=blank, **o)
    check_device_limits(loss_options, logits.device)
    joint_checks(loss_options)
    nll = loss_call(logits.contiguous(), None, targets.contiguous(), logit_lengths, target_lengths, logits.size(-1),
                    loss_options, check_inputs)
    return reduce_losses(nll, reduction, zero_infinity)


multiblank_loss = public_function(MULTIBLANK_LOSS, _multiblank_loss)


def _check_given(options):
    """The checked options hold the big blanks' durations (an option the other losses leave out, so None by
    default)."""
    if not options["big_blank_durations"]:
        raise ValueError("big_blank_durations: the multi-blank loss needs its big blanks' durations (distinct ints "
                         ">= 2), got None")


class MultiblankLoss(LossModule, entry=MULTIBLANK_LOSS._replace(name="MultiblankLoss", params=_ORDER)):
    """Module form of :func:`multiblank_loss`: ``MultiblankLoss([2, 4, 8], blank=-1)(logits, targets, T, U)``.

    Args:
        {args}
    """

    def check(self, options):
        """The durations given, and fitting before a blank counted from the start (one counted from the end fits
        some V; multiblank_loss checks the fit once the blank's column is known)."""
        _check_given(options)
        if options["blank"] >= 0:
            check_big_blank_durations(options["big_blank_durations"], options["blank"])

    def forward(self, logits, targets, logit_lengths, target_lengths):
        """The loss of ``logits`` (compact or padded), as :func:`multiblank_loss` computes it."""
        return multiblank_loss(logits, targets, logit_lengths, target_lengths, **self.options)
