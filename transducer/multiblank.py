"""The multi-blank RNN-T loss (Xu et al., "Multi-blank Transducers for Speech Recognition", ICASSP 2023, arXiv
2211.03541; NeMo's semantics): the functional form, the module, and the registered op
``transducer::multiblank_loss`` (with its backward ``transducer::multiblank_loss_backward``; a ``library.Op``). The
math and the stage contract: transducer/layout.py. The stages are RNN-T's log-probs and gradient with the big
blanks' columns, and TDT's walk with the big blanks as blank arcs of several frames.
"""

from typing import List, Tuple

import torch
from torch import Tensor

from ops import accumulate_dtype

from .checks import (FLOAT_DTYPES, check_batch, check_big_blank_durations, check_blank, check_module_blank,
                     check_options, check_reduction, check_rows, check_sigma, check_tensor)
from .layout import Lattice, LossOptions, stages_for, table_size
from .library import Op, checked_log_probs, gradient_buffer, make_layout, saved_layout, wide_gradient_rows
from .loss import _reduce

__all__ = ["multiblank_loss", "MultiblankLoss"]


def multiblank_options(big_blank_durations, blank, sigma, fastemit_lambda=0.0, clamp=0.0):
    """The LossOptions of a multi-blank loss (transducer::multiblank_loss's flat arguments)."""
    return LossOptions(blank=blank, clamp=clamp, fastemit_lambda=fastemit_lambda, sigma=sigma,
                       big_blank_durations=tuple(big_blank_durations))


def multiblank_lattice(stages, layout, lp, den, lp_big, options):
    """The Lattice of the log-probs (multiblank_log_probs' results): both walks, the big blanks as blank arcs of
    several frames."""
    walks = stages.multiblank_alpha_beta(lp, lp_big, layout, options)
    return Lattice(layout, lp, den, walks.alpha, walks.beta, walks.nll, lp_big)


def _forward(logits: Tensor, targets: Tensor, logit_lengths: Tensor, target_lengths: Tensor,
             big_blank_durations: List[int], blank: int, sigma: float, fastemit_lambda: float, clamp: float,
             check_inputs: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(nll, table, lp, den, lp_big, alpha, beta)."""
    check_rows(logits)
    options = multiblank_options(big_blank_durations, blank, sigma, fastemit_lambda, clamp)
    stages = stages_for(logits.device)
    layout = make_layout(logits, targets, logit_lengths, target_lengths, blank, check_inputs,
                         big_blanks=len(big_blank_durations))
    logits2d = logits.view(-1, logits.size(-1))
    lp, den, lp_big = checked_log_probs(layout, logits, targets, options, check_inputs,
                                        lambda: stages.multiblank_log_probs(logits2d, targets, layout, options))
    lattice = multiblank_lattice(stages, layout, lp, den, lp_big, options)
    return lattice.nll.clone(), layout.table, lp, den, lp_big, lattice.alpha, lattice.beta  # outputs may not alias


def _backward(grad_nll: Tensor, logits: Tensor, targets: Tensor, table: Tensor, lp: Tensor, den: Tensor,
              lp_big: Tensor, alpha: Tensor, beta: Tensor, nll: Tensor, big_blank_durations: List[int], blank: int,
              sigma: float, fastemit_lambda: float, clamp: float, wide_rows: bool) -> Tensor:
    """The gradient of sum_b grad_nll[b] * nll[b] w.r.t. the logits (wide_rows: see library.gradient_buffer)."""
    options = multiblank_options(big_blank_durations, blank, sigma, fastemit_lambda, clamp)
    lattice = Lattice(saved_layout(table, logits, targets), lp, den, alpha, beta, nll, lp_big)
    grad = gradient_buffer(logits, wide_rows)
    logits2d = logits.view(-1, logits.size(-1))
    stages_for(logits.device).gradient(logits2d, targets, lattice, grad_nll.to(lp.dtype), options,
                                       grad.view(logits2d.shape))
    return grad


def _setup_context(ctx, inputs, output):
    logits, targets, _, _, big_blank_durations, blank, sigma, fastemit_lambda, clamp, _ = inputs
    nll, table, lp, den, lp_big, alpha, beta = output
    ctx.mark_non_differentiable(table, lp, den, lp_big, alpha, beta)
    ctx.save_for_backward(logits, targets, table, lp, den, lp_big, alpha, beta, nll)
    ctx.options = (big_blank_durations, blank, sigma, fastemit_lambda, clamp)
    ctx.wide_rows = wide_gradient_rows(ctx, logits)


def _gradient(ctx, grad_nll, backward):
    return {"logits": backward(grad_nll, *ctx.saved_tensors, *ctx.options, ctx.wide_rows)}


multiblank = Op("multiblank_loss", _forward, _backward, _setup_context, _gradient)
multiblank_op, multiblank_backward_op = multiblank.op, multiblank.backward_op


@multiblank_op.register_fake
def _(logits, targets, logit_lengths, target_lengths, big_blank_durations, *rest):
    acc = accumulate_dtype(logits.dtype)
    N = logits.numel() // logits.size(-1)
    B = logit_lengths.size(0)
    new = logits.new_empty
    return (new(B, dtype=acc), new(table_size(B), dtype=torch.int64), new(N, 2, dtype=acc), new(N, dtype=acc),
            new(N, len(big_blank_durations), dtype=acc), new(N, dtype=acc), new(N, dtype=acc))


@multiblank_backward_op.register_fake
def _(grad_nll, logits, *rest):
    return torch.empty_like(logits)


def multiblank_loss(logits, targets, logit_lengths, target_lengths, big_blank_durations, blank, sigma=0.0,
                    reduction="mean", fastemit_lambda=0.0, clamp=-1.0, zero_infinity=False, check_inputs=True):
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
    check_options(clamp, fastemit_lambda, 0.0)
    nll = multiblank(logits.contiguous(), targets.contiguous(), logit_lengths, target_lengths, list(big), blank,
                     float(sigma), float(fastemit_lambda), float(clamp), bool(check_inputs))[0]
    return _reduce(nll, reduction, zero_infinity)


class MultiblankLoss(torch.nn.Module):
    """Module form of :func:`multiblank_loss`: ``MultiblankLoss([2, 4, 8], blank=-1)(logits, targets, T, U)``.

    Args:
        big_blank_durations (list of int): as for :func:`multiblank_loss`.
        blank (int): the standard blank's column; negative counts from the end.
        **options: ``sigma``, ``reduction``, ``fastemit_lambda``, ``clamp``, ``zero_infinity``,
            ``check_inputs``, as for :func:`multiblank_loss`.
    """

    def __init__(self, big_blank_durations, blank, sigma=0.0, reduction="mean", fastemit_lambda=0.0, clamp=-1.0,
                 zero_infinity=False, check_inputs=True):
        super().__init__()
        self.big_blank_durations = list(check_big_blank_durations(big_blank_durations, None))
        self.blank = check_module_blank(blank)
        check_sigma(sigma)
        check_reduction(reduction)
        check_options(clamp, fastemit_lambda, 0.0)
        self.options = dict(sigma=sigma, reduction=reduction, fastemit_lambda=fastemit_lambda, clamp=clamp,
                            zero_infinity=zero_infinity, check_inputs=check_inputs)

    def forward(self, logits, targets, logit_lengths, target_lengths):
        """The loss of ``logits`` (compact or padded), as :func:`multiblank_loss` computes it."""
        return multiblank_loss(logits, targets, logit_lengths, target_lengths, self.big_blank_durations, self.blank,
                               **self.options)

    def extra_repr(self):
        return (f"big_blank_durations={self.big_blank_durations}, blank={self.blank}, "
                + ", ".join(f"{k}={v!r}" for k, v in self.options.items()))
