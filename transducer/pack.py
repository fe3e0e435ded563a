"""pack: the compact joiner input enc[b, t] + pred[b, u], built without a loop over the batch."""

import torch
from torch.autograd.function import once_differentiable

from .layout import MAX_ROWS
from .loss import _check_tensor, _INDEX_DTYPES, _stages


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, encoder_out, predictor_out, layout, num_rows):
        ctx.layout = layout
        ctx.sizes = (encoder_out.size(1), predictor_out.size(1))
        return _stages(encoder_out.device).pack_forward(encoder_out.contiguous(), predictor_out.contiguous(), layout,
                                                        num_rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        max_t, max_u1 = ctx.sizes
        grad_enc, grad_pred = _stages(grad_out.device).pack_backward(grad_out.contiguous(), ctx.layout, max_t, max_u1)
        return grad_enc, grad_pred, None, None


def pack(encoder_out, predictor_out, logit_lengths, target_lengths):
    """Compact joiner input: row (b, t, u) is ``encoder_out[b, t] + predictor_out[b, u]``.

    Args:
        encoder_out: ``(B, maxT, D)`` float tensor.
        predictor_out: ``(B, maxU+1, D)``, same dtype and device.
        logit_lengths: ``(B,)`` int32 / int64, ``1 <= T_b <= maxT``.
        target_lengths: ``(B,)`` int32 / int64, ``0 <= U_b <= maxU``.

    Returns:
        ``(sum_b T_b*(U_b+1), D)``, utterance after utterance, each grid row-major (t, then u): the
        compact layout :func:`transducer_loss` takes. Differentiable w.r.t. both inputs. Sizing the
        output reads the lengths on the host (one device-to-host transfer for CUDA lengths).
    """
    if not isinstance(encoder_out, torch.Tensor) or not encoder_out.is_floating_point():
        raise TypeError("encoder_out: expected a floating-point torch.Tensor")
    _check_tensor("predictor_out", predictor_out, (encoder_out.dtype,), (3,), encoder_out.device)
    _check_tensor("encoder_out", encoder_out, (encoder_out.dtype,), (3,), None)
    _check_tensor("logit_lengths", logit_lengths, _INDEX_DTYPES, (1,), encoder_out.device)
    _check_tensor("target_lengths", target_lengths, _INDEX_DTYPES, (1,), encoder_out.device)
    B, max_t, D = encoder_out.shape
    if predictor_out.size(0) != B or predictor_out.size(2) != D:
        raise ValueError(f"predictor_out: expected shape ({B}, maxU+1, {D}) to match encoder_out "
                         f"{tuple(encoder_out.shape)}, got {tuple(predictor_out.shape)}")
    if logit_lengths.shape != (B,) or target_lengths.shape != (B,):
        raise ValueError(f"logit_lengths, target_lengths: expected shape ({B},), got "
                         f"{tuple(logit_lengths.shape)} and {tuple(target_lengths.shape)}")
    layout = _stages(encoder_out.device).layout(logit_lengths, target_lengths, predictor_out.size(1))
    t_min, t_max, u_min, u_max, num_rows, _ = layout.stats.tolist()
    if t_min < 1 or t_max > max_t:
        raise ValueError(f"logit_lengths: expected values in [1, {max_t}] (encoder_out.size(1)), "
                         f"got [{t_min}, {t_max}]")
    if u_min < 0 or u_max + 1 > predictor_out.size(1):
        raise ValueError(f"target_lengths: expected values in [0, {predictor_out.size(1) - 1}] "
                         f"(predictor_out.size(1) - 1), got [{u_min}, {u_max}]")
    if num_rows > MAX_ROWS:
        raise ValueError(f"logit_lengths, target_lengths: sum_b T_b*(U_b+1) = {num_rows} rows; at most 2^31 - 1 "
                         f"are supported")
    return _Pack.apply(encoder_out, predictor_out, layout, num_rows)
