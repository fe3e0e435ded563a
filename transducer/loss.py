"""The transducer loss: argument checks, the autograd Function, the functional form and the module."""

import operator

import torch
from torch.autograd.function import once_differentiable

from . import cpu
from .layout import CELLS_CAP, MAX_ROWS

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)
_REDUCTIONS = ("none", "sum", "mean")


def _stages(device):
    if device.type == "cuda":
        from . import cuda
        return cuda
    if device.type != "cpu":
        raise ValueError(f"logits: expected a CPU or CUDA tensor, got device {device}")
    return cpu


def _check_tensor(name, x, dtypes, ndim, device):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if x.dim() not in ndim:
        raise ValueError(f"{name}: expected {' or '.join(map(str, ndim))} dimensions, got shape {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the logits' device), got {x.device}")


def _is_index(x):
    """An integer usable as an index (int, numpy integer, 0-d integer tensor), not a bool."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def _check_arguments(logits, targets, logit_lengths, target_lengths, blank, reduction):
    """Types, shapes and options: everything that needs no look at tensor values."""
    _check_tensor("logits", logits, _FLOAT_DTYPES, (2, 4), None)
    device = logits.device
    _check_tensor("targets", targets, _INDEX_DTYPES, (2,), device)
    _check_tensor("logit_lengths", logit_lengths, _INDEX_DTYPES, (1,), device)
    _check_tensor("target_lengths", target_lengths, _INDEX_DTYPES, (1,), device)
    B = logit_lengths.size(0)
    if B == 0:
        raise ValueError("logit_lengths: expected at least one utterance, got an empty batch")
    if target_lengths.size(0) != B:
        raise ValueError(f"target_lengths: expected shape ({B},) like logit_lengths, got {tuple(target_lengths.shape)}")
    if targets.size(0) != B:
        raise ValueError(f"targets: expected {B} rows (one per utterance), got shape {tuple(targets.shape)}")
    if logits.dim() == 4 and logits.size(0) != B:
        raise ValueError(f"logits: padded logits must have batch size {B} (from logit_lengths), got shape "
                         f"{tuple(logits.shape)}")
    rows = logits.numel() // max(logits.size(-1), 1)
    if rows > MAX_ROWS:
        raise ValueError(f"logits: at most 2^31 - 1 rows (cells, padding included) are supported, got shape "
                         f"{tuple(logits.shape)} with {rows} rows")
    V = logits.size(-1)
    if not _is_index(blank) or not 0 <= operator.index(blank) < V:
        raise ValueError(f"blank: expected an int in [0, {V}) (the vocabulary size is logits.size(-1)), got {blank!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {_REDUCTIONS}, got {reduction!r}")


def _read_stats(layout):
    """A function returning the layout's stats as a list. On CUDA the copy to pinned memory is queued
    now, right behind the layout launch, and the function waits for that copy alone: kernels queued
    after it run while the host checks."""
    stats = layout.stats
    if not stats.is_cuda:
        return stats.tolist
    host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
    host.copy_(stats, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(stats.device))
    return lambda: (copied.synchronize(), host.tolist())[1]


def _check_values(logits, targets, stats, blank):
    """Lengths and target range, from the layout's stats (a list)."""
    V, S = logits.size(-1), targets.size(1)
    t_min, t_max, u_min, u_max, cells, bad = stats
    if t_min < 1:
        raise ValueError(f"logit_lengths: every T_b must be >= 1, got min {t_min}")
    if u_min < 0:
        raise ValueError(f"target_lengths: every U_b must be >= 0, got min {u_min}")
    if cells >= CELLS_CAP:
        raise ValueError(f"logit_lengths, target_lengths: sum_b T_b*(U_b+1) overflows (2^61 or more; T_b up to "
                         f"{t_max}, U_b up to {u_max})")
    if u_max > S:
        raise ValueError(f"target_lengths: U_b = {u_max} exceeds targets.size(1) = {S}")
    if logits.dim() == 4:
        if t_max > logits.size(1):
            raise ValueError(f"logit_lengths: T_b = {t_max} exceeds logits.size(1) = {logits.size(1)}")
        if u_max + 1 > logits.size(2):
            raise ValueError(f"target_lengths: U_b + 1 = {u_max + 1} exceeds logits.size(2) = {logits.size(2)}")
    elif cells != logits.size(0):
        raise ValueError(f"logits: compact logits must have sum_b T_b*(U_b+1) = {cells} rows, "
                         f"got shape {tuple(logits.shape)}")
    if bad:
        raise ValueError(f"targets: {bad} entries within target_lengths are outside [0, {V}) or equal to "
                         f"blank = {blank}")


def make_layout(logits, targets, logit_lengths, target_lengths, blank=0, with_stats=False):
    """The Layout of compact (N, V) or padded (B, maxT, maxU+1, V) logits; no host synchronisation."""
    padded = logits.dim() == 4
    max_u1 = logits.size(2) if padded else targets.size(1) + 1
    return _stages(logits.device).layout(logit_lengths, target_lengths, max_u1, logits.size(1) if padded else 0,
                                         targets, logits.size(-1), blank, with_stats)


class _TransducerLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, layout, check, blank, reduction, one_sym_per_frame, from_log_softmax,
                zero_infinity, inplace_grad):
        stages = _stages(logits.device)
        logits = logits.contiguous()
        logits2d = logits.view(-1, logits.size(-1))
        lp, den = stages.log_probs(logits2d, targets, layout, blank, from_log_softmax)
        if check is not None:  # log_probs reads within bounds whatever the values; nothing else runs unchecked
            check()
        alpha, beta, nll = stages.alpha_beta(lp, layout, one_sym_per_frame)
        # backward sees the true losses (an infinite one gets zero gradient); the caller may see zeros
        ctx.save_for_backward(logits, targets, lp, den, alpha, beta, nll)
        ctx.layout = layout
        ctx.options = (blank, reduction, one_sym_per_frame, from_log_softmax, inplace_grad)
        # nll is float32, or float64 for float64 logits: the returned dtype. What is returned is a new
        # tensor, never the saved one, so the caller may change it in place.
        if zero_infinity:
            nll = torch.where(torch.isinf(nll), 0.0, nll)
        if reduction == "sum":
            return nll.sum()
        if reduction == "mean":
            return nll.mean()
        return nll if zero_infinity else nll.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        logits, targets, lp, den, alpha, beta, nll = ctx.saved_tensors
        blank, reduction, one_sym_per_frame, from_log_softmax, inplace_grad = ctx.options
        layout = ctx.layout
        B = nll.numel()
        scale = grad_output / B if reduction == "mean" else grad_output
        if scale.dim() == 0:
            scale = scale.expand(B)  # a stride-0 view: the stages read scale[b] at any stride
        logits2d = logits.view(-1, logits.size(-1))
        out = logits2d if inplace_grad else torch.empty_like(logits2d)
        _stages(logits.device).gradient(logits2d, targets, layout, lp, den, alpha, beta, nll, scale,
                                        blank, from_log_softmax, one_sym_per_frame, out)
        if inplace_grad:  # kernels write through raw pointers: let autograd see that the logits changed
            torch.autograd.graph.increment_version(logits)
        return out.view(logits.shape), None, None, None, None, None, None, None, None, None


def transducer_loss(logits, targets, logit_lengths, target_lengths, blank=0, reduction="mean",
                    one_sym_per_frame=False, from_log_softmax=False, zero_infinity=False, check_inputs=True,
                    inplace_grad=False):
    r"""Transducer (RNN-T) loss, or with ``one_sym_per_frame`` the RNA loss, over compact or padded logits.

    Args:
        logits: unnormalised scores, float16 / bfloat16 / float32 / float64, either compact
            ``(sum_b T_b*(U_b+1), V)`` (utterance b's (T_b, U_b+1) grid stored row-major, utterances
            one after another) or padded ``(B, maxT, maxU+1, V)``; picked by ``logits.dim()``.
            Non-contiguous logits are copied once to be made contiguous.
        targets: ``(B, S)`` int32 / int64 label ids, ``S >= max_b U_b``; entries past ``U_b`` are ignored.
            Labels must lie in ``[0, V)`` and differ from ``blank``.
        logit_lengths: ``(B,)`` int32 / int64, ``T_b >= 1`` frames of each utterance.
        target_lengths: ``(B,)`` int32 / int64, ``U_b >= 0`` labels of each utterance.
        blank: index of the blank symbol in ``[0, V)``.
        reduction: ``"none"`` gives the ``(B,)`` negative log-likelihoods, ``"sum"`` their sum,
            ``"mean"`` their mean over the batch (torchaudio's convention).
        one_sym_per_frame: RNA topology: every step consumes a frame, so a label moves
            (t, u) -> (t+1, u+1). Utterances with ``U_b > T_b - 1`` have no alignment: loss ``+inf``.
        from_log_softmax: the logits are already log-probabilities (log_softmax done by the caller);
            the loss skips its own normalisation and the gradient is w.r.t. those log-probabilities.
        zero_infinity: replace infinite losses by 0. Utterances whose loss is not finite get zero
            gradient either way.
        check_inputs: check lengths and label values against the tensors (on CUDA this costs one
            small device-to-host transfer, which overlaps the first pass over the logits). ``False``
            skips it: no host synchronisation, so a step can be captured in a CUDA graph;
            out-of-range values then give undefined results.
        inplace_grad: write the gradient into the logits' own storage in backward instead of a new
            tensor, saving one logits-sized buffer. Only valid when nothing else needs the logits'
            values afterwards (true for a joiner ``Linear`` whose output feeds only this loss). On leaf
            logits, ``logits.grad`` then shares their storage. Autograd is told the logits changed,
            so a backward that still needs them raises instead of reading the gradient.

    Returns:
        float32 loss (float64 for float64 logits): ``(B,)`` for ``"none"``, else a scalar. The gradient
        flows to ``logits`` only and has the logits' dtype.
    """
    _check_arguments(logits, targets, logit_lengths, target_lengths, blank, reduction)
    blank = operator.index(blank)
    targets = targets.contiguous()
    layout = make_layout(logits, targets, logit_lengths, target_lengths, blank, with_stats=check_inputs)
    check = None
    if check_inputs:
        read = _read_stats(layout)
        check = lambda: _check_values(logits, targets, read(), blank)  # noqa: E731
        if not logits.is_cuda:  # the CPU stages need valid values to run at all: check first
            check()
            check = None
    return _TransducerLoss.apply(logits, targets, layout, check, blank, reduction, one_sym_per_frame,
                                 from_log_softmax, zero_infinity, inplace_grad)


class TransducerLoss(torch.nn.Module):
    """Module form of :func:`transducer_loss`: ``TransducerLoss(blank=0)(logits, targets, T, U)``."""

    def __init__(self, blank=0, reduction="mean", one_sym_per_frame=False, from_log_softmax=False,
                 zero_infinity=False, check_inputs=True, inplace_grad=False):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction: expected one of {_REDUCTIONS}, got {reduction!r}")
        if not _is_index(blank) or operator.index(blank) < 0:
            raise ValueError(f"blank: expected a non-negative int, got {blank!r}")
        self.blank = operator.index(blank)
        self.reduction = reduction
        self.one_sym_per_frame = one_sym_per_frame
        self.from_log_softmax = from_log_softmax
        self.zero_infinity = zero_infinity
        self.check_inputs = check_inputs
        self.inplace_grad = inplace_grad

    def forward(self, logits, targets, logit_lengths, target_lengths):
        return transducer_loss(logits, targets, logit_lengths, target_lengths, blank=self.blank,
                               reduction=self.reduction, one_sym_per_frame=self.one_sym_per_frame,
                               from_log_softmax=self.from_log_softmax, zero_infinity=self.zero_infinity,
                               check_inputs=self.check_inputs, inplace_grad=self.inplace_grad)

    def extra_repr(self):
        return (f"blank={self.blank}, reduction={self.reduction!r}, one_sym_per_frame={self.one_sym_per_frame}, "
                f"from_log_softmax={self.from_log_softmax}, zero_infinity={self.zero_infinity}, "
                f"check_inputs={self.check_inputs}, inplace_grad={self.inplace_grad}")
