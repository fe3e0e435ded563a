"""The multi-blank RNN-T loss (Xu et al., "Multi-blank Transducers for Speech Recognition", ICASSP 2023, arXiv
2211.03541; NeMo's semantics): the functional form and the module, on the op ``transducer::loss``
(transducer/custom_ops.py). The math and the stage contract: transducer/backend.py. The stages are RNN-T's
log-probs and gradient with the big blanks' columns, and TDT's walk with the big blanks as blank arcs of
several frames.
"""

import torch

from .checks import (FLOAT_DTYPES, check_batch, check_big_blank_durations, check_blank, check_module_blank,
                     check_options, check_reduction, check_sigma, check_tensor)
from .options import LossOptions
from .custom_ops import loss_call
from .loss import reduce_losses

__all__ = ["multiblank_loss", "MultiblankLoss"]


def multiblank_loss(logits, targets, logit_lengths, target_lengths, big_blank_durations, blank, sigma=0.0,
                    reduction="mean", fastemit_lambda=0.0, clamp=-1.0, zero_infinity=False, check_inputs=True,
                    delay_penalty=0.0):
    r"""Multi-blank RNN-T loss (NeMo's semantics), over compact or padded logits: RNN-T with K big blanks that
    consume several frames at once.

    Args:
        logits (Tensor): compact ``(sum_b T_b*(U_b+1), V)`` or padded ``(B, maxT, maxU+1, V)`` scores, float16 /
            bfloat16 / float32 / float64; the blank and the big blanks among the V columns.
        targets (Tensor): ``(B, S)`` int32 / int64, ``S >= max U_b``; labels in ``[0, V)``, none a blank.
        logit_lengths (Tensor): ``(B,)`` int32 / int64, ``T_b >= 1``.
        target_lengths (Tensor): ``(B,)`` int32 / int64, ``U_b >= 0``.
        big_blank_durations (list of int): the K big blanks' durations, distinct ints >= 2 (at most 14 on
            CUDA); big blank i is the column ``blank - 1 - i``.
        blank (int): the standard blank's column (duration 1), in ``[-V, V)``; negative counts from the end
            (NeMo's models put it last: ``-1``). No default.
        sigma (float, optional): logit under-normalisation: every log-prob is ``log_softmax - sigma``.
            (Default: ``0.0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as
            NeMo's ``MultiblankRNNTLossNumba``; NeMo's ``RNNTLoss`` divides each loss by its target length
            first). (Default: ``"mean"``)
        fastemit_lambda (float, optional): the gradient w.r.t. every label log-prob times ``1 + fastemit_lambda``
            (FastEmit; the loss value is unchanged). (Default: ``0.0``)
        clamp (float, optional): if > 0, each gradient element (for a unit incoming gradient) is clamped to
            ``[-clamp, clamp]``. (Default: ``-1``)
        zero_infinity (bool, optional): infinite losses become 0; NaN losses stay NaN. (Default: ``False``)
        check_inputs (bool, optional): check lengths and labels against the tensors (on CUDA one small
            device-to-host read). (Default: ``True``)
        delay_penalty (float, optional): k2's delay penalty on every label log-prob, as for
            :func:`transducer.transducer_loss`. (Default: ``0.0``)

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
    blank = check_blank(blank, logits.size(-1))
    big = check_big_blank_durations(big_blank_durations, blank, logits.device)
    check_sigma(sigma)
    check_reduction(reduction)
    check_options(clamp, fastemit_lambda, delay_penalty)
    options = LossOptions(blank=blank, clamp=float(clamp), fastemit_lambda=float(fastemit_lambda),
                          delay_penalty=float(delay_penalty), sigma=float(sigma), big_blank_durations=tuple(big))
    nll = loss_call(logits.contiguous(), None, targets.contiguous(), logit_lengths, target_lengths, logits.size(-1),
                    options, check_inputs)
    return reduce_losses(nll, reduction, zero_infinity)


class MultiblankLoss(torch.nn.Module):
    """Module form of :func:`multiblank_loss`: ``MultiblankLoss([2, 4, 8], blank=-1)(logits, targets, T, U)``.

    Args:
        big_blank_durations (list of int): as for :func:`multiblank_loss`.
        blank (int): the standard blank's column; negative counts from the end.
        **options: ``sigma``, ``reduction``, ``fastemit_lambda``, ``clamp``, ``zero_infinity``,
            ``check_inputs``, ``delay_penalty``, as for :func:`multiblank_loss`.
    """

    def __init__(self, big_blank_durations, blank, sigma=0.0, reduction="mean", fastemit_lambda=0.0, clamp=-1.0,
                 zero_infinity=False, check_inputs=True, delay_penalty=0.0):
        super().__init__()
        self.big_blank_durations = list(check_big_blank_durations(big_blank_durations, None))
        self.blank = check_module_blank(blank)
        check_sigma(sigma)
        check_reduction(reduction)
        check_options(clamp, fastemit_lambda, delay_penalty)
        self.options = dict(sigma=sigma, reduction=reduction, fastemit_lambda=fastemit_lambda, clamp=clamp,
                            zero_infinity=zero_infinity, check_inputs=check_inputs, delay_penalty=delay_penalty)

    def forward(self, logits, targets, logit_lengths, target_lengths):
        """The loss of ``logits`` (compact or padded), as :func:`multiblank_loss` computes it."""
        return multiblank_loss(logits, targets, logit_lengths, target_lengths, self.big_blank_durations, self.blank,
                               **self.options)

    def extra_repr(self):
        return (f"big_blank_durations={self.big_blank_durations}, blank={self.blank}, "
                + ", ".join(f"{k}={v!r}" for k, v in self.options.items()))
