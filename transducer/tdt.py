"""The Token-and-Duration Transducer (TDT) loss (Xu et al., ICML 2023, arXiv 2304.06795; NeMo's semantics):
the functional form, the module, and the registered op ``transducer::tdt_loss`` (with its backward
``transducer::tdt_loss_backward``; a ``library.Op``: an eager path skips the op's Python layers). The math
and the stage contract: transducer/layout.py; the stages: transducer/cpu.py and transducer/tdt.cu.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ops import accumulate_dtype

from .checks import (FLOAT_DTYPES, check_batch, check_blank, check_module_blank, check_options, check_reduction,
                     check_rows, check_tdt_options, check_tensor)
from .layout import Lattice, LossOptions, stages_for, table_size
from .library import (Op, checked_log_probs, gradient_buffer, lattice_of, lattice_outputs, make_layout, mixed_nll,
                      saved_layout, wide_gradient_rows)
from .loss import _reduce

__all__ = ["tdt_loss", "TDTLoss"]


def _heads(logits, duration_logits, vocab_size):
    """The (N, V) token and (N, D) duration score views of the rows (no copy; one op: each costs host time)."""
    rows = logits if logits.dim() == 2 else logits.view(-1, logits.size(-1))
    if duration_logits is None:
        return rows.split_with_sizes([vocab_size, rows.size(1) - vocab_size], 1)
    return rows, duration_logits if duration_logits.dim() == 2 else duration_logits.view(-1, duration_logits.size(-1))


def _rows(x):
    """``x`` itself when its rows can be read in place (unit column stride, leading dims that flatten to one
    row index: a column slice of a wider joint output, such as the token and duration columns of a joint
    whose width is padded to a multiple of 8), else a contiguous copy."""
    if x.is_contiguous():
        return x
    if x.stride(-1) == 1:
        try:
            x.view(-1, x.size(-1))
            return x
        except RuntimeError:
            pass
    return x.contiguous()


def tdt_options(durations, blank, sigma, omega, fastemit_lambda=0.0, clamp=0.0):
    """The LossOptions of a TDT loss (transducer::tdt_loss's flat arguments)."""
    return LossOptions(blank=blank, clamp=clamp, fastemit_lambda=fastemit_lambda, durations=tuple(durations),
                       sigma=sigma, omega=omega)


def tdt_lattice(stages, layout, lp, lp_dur, den, options):
    """The TDT Lattice of the log-probs (tdt_log_probs' results): both walks, and with omega > 0 the walks of
    the plain RNN-T loss of the token scores (log-probs without sigma)."""
    walks = stages.tdt_alpha_beta(lp, lp_dur, layout, options)
    rnnt = stages.alpha_beta(lp + options.sigma, layout, options) if options.omega else None
    return Lattice(layout, lp, den, walks.alpha, walks.beta, walks.nll, lp_dur, rnnt)


def _tdt_forward(logits: Tensor, duration_logits: Optional[Tensor], targets: Tensor, logit_lengths: Tensor,
                 target_lengths: Tensor, vocab_size: int, durations: List[int], blank: int, sigma: float, omega: float,
                 fastemit_lambda: float, clamp: float, check_inputs: bool
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(nll, *lattice_outputs)."""
    check_rows(logits)
    options = tdt_options(durations, blank, sigma, omega, fastemit_lambda, clamp)
    stages = stages_for(logits.device)
    tokens, durs = _heads(logits, duration_logits, vocab_size)
    layout = make_layout(logits, targets, logit_lengths, target_lengths, blank, check_inputs, vocab_size)
    lp, lp_dur, den = checked_log_probs(layout, logits, targets, options, check_inputs,
                                        lambda: stages.tdt_log_probs(tokens, durs, targets, layout, options),
                                        vocab_size)
    lattice = tdt_lattice(stages, layout, lp, lp_dur, den, options)
    return (mixed_nll(lattice, omega),) + lattice_outputs(lattice)


def _tdt_backward(grad_nll: Tensor, logits: Tensor, duration_logits: Optional[Tensor], targets: Tensor,
                  table: Tensor, lp: Tensor, lp_dur: Tensor, den: Tensor, alpha: Tensor, beta: Tensor, tdt_nll: Tensor,
                  alpha_r: Tensor, beta_r: Tensor, rnnt_nll: Tensor, vocab_size: int, durations: List[int], blank: int,
                  sigma: float, omega: float, fastemit_lambda: float, clamp: float, wide_rows: bool
                  ) -> Tuple[Tensor, Tensor]:
    """(grad_logits, grad_duration_logits) of sum_b grad_nll[b] * nll[b]; the second is empty without
    duration_logits (the first then covers all V + D columns). wide_rows: see library.gradient_buffer."""
    options = tdt_options(durations, blank, sigma, omega, fastemit_lambda, clamp)
    lattice = lattice_of(saved_layout(table, logits, targets),
                         (lp, lp_dur, den, alpha, beta, tdt_nll, alpha_r, beta_r, rnnt_nll), options)
    grad = gradient_buffer(logits, wide_rows)
    grad_durations = torch.empty_like(duration_logits) if duration_logits is not None else logits.new_empty(0)
    tokens, durs = _heads(logits, duration_logits, vocab_size)
    out_tokens, out_durs = _heads(grad, grad_durations if duration_logits is not None else None, vocab_size)
    stages_for(logits.device).tdt_gradient(tokens, durs, targets, lattice, grad_nll.to(lp.dtype), options,
                                           out_tokens, out_durs)
    return grad, grad_durations


def _setup_context(ctx, inputs, output):
    (logits, duration_logits, targets, _, _, vocab_size, durations, blank, sigma, omega, fastemit_lambda, clamp,
     _) = inputs
    nll, *lattice = output
    ctx.mark_non_differentiable(*lattice)
    ctx.save_for_backward(logits, duration_logits, targets, *lattice)
    ctx.options = (vocab_size, durations, blank, sigma, omega, fastemit_lambda, clamp)
    ctx.has_duration_logits = duration_logits is not None
    ctx.wide_rows = wide_gradient_rows(ctx, logits)


def _gradient(ctx, grad_nll, backward):
    grad, grad_durations = backward(grad_nll, *ctx.saved_tensors, *ctx.options, ctx.wide_rows)
    return {"logits": grad, "duration_logits": grad_durations if ctx.has_duration_logits else None}


tdt = Op("tdt_loss", _tdt_forward, _tdt_backward, _setup_context, _gradient)
tdt_op, tdt_backward_op = tdt.op, tdt.backward_op


@tdt_op.register_fake
def _(logits, duration_logits, targets, logit_lengths, target_lengths, vocab_size, durations, blank, sigma, omega,
      *rest):
    acc = accumulate_dtype(logits.dtype)
    N = logits.numel() // logits.size(-1)
    B = logit_lengths.size(0)
    D = len(durations)
    new = logits.new_empty
    r = N if omega else 0
    return (new(B, dtype=acc), new(table_size(B), dtype=torch.int64), new(N, 2, dtype=acc),
            new(N, D, dtype=acc), new(N, 2, dtype=acc), new(N, dtype=acc), new(N, dtype=acc), new(B, dtype=acc),
            new(r, dtype=acc), new(r, dtype=acc), new(B if omega else 0, dtype=acc))


@tdt_backward_op.register_fake
def _(grad_nll, logits, duration_logits, *rest):
    return (torch.empty_like(logits),
            torch.empty_like(duration_logits) if duration_logits is not None else logits.new_empty(0))


def tdt_loss(logits, targets, logit_lengths, target_lengths, durations, blank=0, sigma=0.0, omega=0.0,
             reduction="mean", fastemit_lambda=0.0, clamp=-1.0, zero_infinity=False, check_inputs=True,
             duration_logits=None):
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
        clamp (float, optional): if > 0, each gradient element for a unit incoming gradient is clamped to
            ``[-clamp, clamp]``. (Default: ``-1``)
        zero_infinity (bool, optional): infinite losses become 0; NaN losses stay NaN. (Default: ``False``)
        check_inputs (bool, optional): check lengths and labels against the tensors (one small
            device-to-host read on CUDA). (Default: ``True``)
        duration_logits (Tensor, optional): ``(sum_TU, D)`` or ``(B, maxT, maxU+1, D)``: the duration head on
            its own (transformers' joint has two heads; concatenating them would copy the largest tensor of
            the step). (Default: ``None``: the last D columns of ``logits``)

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
    check_options(clamp, fastemit_lambda, 0.0)
    inputs = (_rows(logits), None if duration_logits is None else _rows(duration_logits),
              targets.contiguous(), logit_lengths, target_lengths, V, durations, blank, float(sigma),
              float(omega), float(fastemit_lambda), float(clamp), bool(check_inputs))
    nll = tdt(*inputs)[0]
    return _reduce(nll, reduction, zero_infinity)


class TDTLoss(torch.nn.Module):
    """Module form of :func:`tdt_loss`: ``TDTLoss(durations=[0, 1, 2, 3, 4], blank=0)(logits, targets, T, U)``.

    Args:
        durations (list of int): as for :func:`tdt_loss`.
        blank (int, optional): the blank among the token columns; negative counts from the end. (Default: ``0``)
        **options: ``sigma``, ``omega``, ``reduction``, ``fastemit_lambda``, ``clamp``, ``zero_infinity``,
            ``check_inputs``, as for :func:`tdt_loss`.
    """

    def __init__(self, durations, blank=0, sigma=0.0, omega=0.0, reduction="mean", fastemit_lambda=0.0,
                 clamp=-1.0, zero_infinity=False, check_inputs=True):
        super().__init__()
        self.durations = check_tdt_options(durations, sigma, omega)
        check_reduction(reduction)
        check_options(clamp, fastemit_lambda, 0.0)
        self.options = dict(blank=check_module_blank(blank), sigma=sigma, omega=omega, reduction=reduction,
                            fastemit_lambda=fastemit_lambda, clamp=clamp, zero_infinity=zero_infinity,
                            check_inputs=check_inputs)

    def forward(self, logits, targets, logit_lengths, target_lengths, duration_logits=None):
        """The loss of ``logits`` (and ``duration_logits``, the duration head on its own) with the module's
        options (see :func:`tdt_loss`)."""
        return tdt_loss(logits, targets, logit_lengths, target_lengths, self.durations,
                        duration_logits=duration_logits, **self.options)

    def extra_repr(self):
        return f"durations={self.durations}, " + ", ".join(f"{k}={v!r}" for k, v in self.options.items())
