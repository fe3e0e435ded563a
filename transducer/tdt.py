"""The Token-and-Duration Transducer (TDT) loss (Xu et al., ICML 2023, arXiv 2304.06795; NeMo's semantics):
the functional form and the module, on the op ``transducer::loss`` (transducer/custom_ops.py). The math and the
stage contract: transducer/backend.py; the stages: transducer/cpu_stages.py and transducer/tdt.cu.
"""

import torch

from .checks import (FLOAT_DTYPES, check_batch, check_blank, check_module_blank, check_options, check_reduction,
                     check_tdt_options, check_tensor)
from .options import LossOptions
from .custom_ops import in_place_rows, loss_call
from .loss import reduce_losses

__all__ = ["tdt_loss", "TDTLoss"]


def tdt_loss(logits, targets, logit_lengths, target_lengths, durations, blank=0, sigma=0.0, omega=0.0,
             reduction="mean", fastemit_lambda=0.0, clamp=-1.0, zero_infinity=False, check_inputs=True,
             duration_logits=None, delay_penalty=0.0):
    r"""Token-and-Duration Transducer loss (Xu et al. 2023; NeMo's semantics), over compact or padded scores.

    Args:
        logits (Tensor): compact ``(sum_b T_b*(U_b+1), V + D)`` or padded ``(B, maxT, maxU+1, V + D)``, float16 /
            bfloat16 / float32 / float64: V token scores (blank among them) then D = len(durations) duration
            scores per row (NeMo's joint); with ``duration_logits``, the V token scores alone. Rows with a unit
            last stride are read in place (a column slice of a wider tensor), other layouts copied once.
        targets (Tensor): ``(B, S)`` int32 / int64, ``S >= max U_b``, labels in ``[0, V)`` other than blank.
        logit_lengths (Tensor): ``(B,)`` int32 / int64, ``T_b >= 1``.
        target_lengths (Tensor): ``(B,)`` int32 / int64, ``U_b >= 0``.
        durations (list of int): the D durations (frames a symbol covers): distinct ints >= 0, at least one
            >= 1 (a blank must advance time), at most 16 (``layout.MAX_DURATIONS``) on CUDA. Required.
        blank (int, optional): the blank among the token columns, in ``[-V, V)``; negative counts from the
            end (``-1``: NeMo's blank, the last token column). (Default: ``0``)
        sigma (float, optional): logit under-normalisation: token log-probs are ``log_softmax - sigma``.
            (Default: ``0.0``)
        omega (float, optional): in ``[0, 1)``; the loss is ``(1 - omega) * tdt + omega * rnnt``, rnnt the
            plain RNN-T loss of the token scores without sigma (the expectation of NeMo's sampling it).
            (Default: ``0.0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as NeMo's
            ``TDTLossNumba``; NeMo's ``RNNTLoss`` and transformers divide by the target lengths first).
            (Default: ``"mean"``)
        fastemit_lambda (float, optional): the gradient w.r.t. every label token log-prob times
            ``1 + fastemit_lambda`` (FastEmit; the value is unchanged). (Default: ``0.0``)
        clamp (float, optional): if > 0, each element of the token scores' gradient for a unit incoming
            gradient is clamped to ``[-clamp, clamp]`` (the duration scores' gradient is not: NeMo's TDT clamp).
            (Default: ``-1``)
        zero_infinity (bool, optional): infinite losses become 0; NaN losses stay NaN. (Default: ``False``)
        check_inputs (bool, optional): check lengths and labels against the tensors (one small
            device-to-host read on CUDA). (Default: ``True``)
        duration_logits (Tensor, optional): ``(sum_TU, D)`` or ``(B, maxT, maxU+1, D)``: the duration head on
            its own (transformers' joint has two heads; concatenating them would copy the largest tensor of
            the step). (Default: ``None``: the last D columns of ``logits``)
        delay_penalty (float, optional): k2's delay penalty on every label token log-prob, as for
            :func:`transducer.transducer_loss` (in both terms with omega). (Default: ``0.0``)

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
    check_tensor("logits", logits, FLOAT_DTYPES, (2, 4), None)
    device = logits.device
    durations = check_tdt_options(durations, sigma, omega, device)
    D = len(durations)
    if duration_logits is None:
        V = logits.size(-1) - D
    else:
        check_tensor("duration_logits", duration_logits, (logits.dtype,), (logits.dim(),), device)
        if duration_logits.shape[:-1] != logits.shape[:-1] or duration_logits.size(-1) != D:
            raise ValueError(f"duration_logits: expected shape {tuple(logits.shape[:-1]) + (D,)} (logits' rows, "
                             f"len(durations) columns), got {tuple(duration_logits.shape)}")
        V = logits.size(-1)
    if V < 2:
        before = f" before the {D} duration columns" if duration_logits is None else ""
        raise ValueError(f"logits: expected at least 2 token columns{before}, got shape {tuple(logits.shape)}")
    check_batch(logits, targets, logit_lengths, target_lengths)
    blank = check_blank(blank, V, "the token columns")
    check_reduction(reduction)
    check_options(clamp, fastemit_lambda, delay_penalty)
    options = LossOptions(blank=blank, clamp=float(clamp), fastemit_lambda=float(fastemit_lambda),
                          delay_penalty=float(delay_penalty), durations=tuple(durations), sigma=float(sigma),
                          omega=float(omega))
    nll = loss_call(in_place_rows(logits), None if duration_logits is None else in_place_rows(duration_logits),
                    targets.contiguous(), logit_lengths, target_lengths, V, options, check_inputs)
    return reduce_losses(nll, reduction, zero_infinity)


class TDTLoss(torch.nn.Module):
    """Module form of :func:`tdt_loss`: ``TDTLoss(durations=[0, 1, 2, 3, 4], blank=0)(logits, targets, T, U)``.

    Args:
        durations (list of int): as for :func:`tdt_loss`.
        blank (int, optional): the blank among the token columns; negative counts from the end. (Default: ``0``)
        **options: ``sigma``, ``omega``, ``reduction``, ``fastemit_lambda``, ``clamp``, ``zero_infinity``,
            ``check_inputs``, ``delay_penalty``, as for :func:`tdt_loss`.
    """

    def __init__(self, durations, blank=0, sigma=0.0, omega=0.0, reduction="mean", fastemit_lambda=0.0,
                 clamp=-1.0, zero_infinity=False, check_inputs=True, delay_penalty=0.0):
        super().__init__()
        self.durations = check_tdt_options(durations, sigma, omega)
        check_reduction(reduction)
        check_options(clamp, fastemit_lambda, delay_penalty)
        self.options = dict(blank=check_module_blank(blank), sigma=sigma, omega=omega, reduction=reduction,
                            fastemit_lambda=fastemit_lambda, clamp=clamp, zero_infinity=zero_infinity,
                            check_inputs=check_inputs, delay_penalty=delay_penalty)

    def forward(self, logits, targets, logit_lengths, target_lengths, duration_logits=None):
        """The loss of ``logits`` (and ``duration_logits``, the duration head on its own) with the module's
        options (see :func:`tdt_loss`)."""
        return tdt_loss(logits, targets, logit_lengths, target_lengths, self.durations,
                        duration_logits=duration_logits, **self.options)

    def extra_repr(self):
        return f"durations={self.durations}, " + ", ".join(f"{k}={v!r}" for k, v in self.options.items())
