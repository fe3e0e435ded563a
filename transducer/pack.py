"""pack: the compact joiner input enc[b, t] + pred[b, u], built without a loop over the batch."""

import torch
from torch import Tensor

from . import custom_ops
from .backend import stages_for
from .checks import FLOAT_DTYPES, INDEX_DTYPES, check_pack_values, check_tensor
from .layout import MAX_ROWS


def pack(encoder_out: Tensor, predictor_out: Tensor, logit_lengths: Tensor, target_lengths: Tensor) -> Tensor:
    """Compact joiner input: row (b, t, u) is ``encoder_out[b, t] + predictor_out[b, u]``.

    Args:
        encoder_out (Tensor): ``(B, maxT, D)``, ``D >= 1``, float16 / bfloat16 / float32 / float64.
        predictor_out (Tensor): ``(B, maxU+1, D)``, a floating dtype (may differ from encoder_out's), same device.
        logit_lengths (Tensor): ``(B,)`` int32 / int64, ``1 <= T_b <= maxT``.
        target_lengths (Tensor): ``(B,)`` int32 / int64, ``0 <= U_b <= maxU``.

    Returns:
        Tensor: ``(sum_b T_b*(U_b+1), D)`` in the promoted dtype of the two inputs (as ``encoder_out +
        predictor_out`` gives it), utterance after utterance, each grid row-major (t, then u): the compact
        layout :func:`transducer_loss` takes. Differentiable w.r.t. both inputs, gradients in each input's
        dtype. Sizing the output reads the lengths on the host (one device-to-host transfer for CUDA
        lengths); under torch.compile the number of rows is a data-dependent size.

    Example::

        >>> enc, pred = torch.randn(2, 5, 8), torch.randn(2, 4, 8)
        >>> pack(enc, pred, torch.tensor([5, 3]), torch.tensor([3, 1])).shape
        torch.Size([26, 8])
    """
    check_tensor("encoder_out", encoder_out, FLOAT_DTYPES, (3,), None)
    check_tensor("predictor_out", predictor_out, FLOAT_DTYPES, (3,), encoder_out.device, "encoder_out")
    check_tensor("logit_lengths", logit_lengths, INDEX_DTYPES, (1,), encoder_out.device, "encoder_out")
    check_tensor("target_lengths", target_lengths, INDEX_DTYPES, (1,), encoder_out.device, "encoder_out")
    B, max_t, D = encoder_out.shape
    if D == 0:
        raise ValueError(
            f"encoder_out: expected rows of at least one entry (B, maxT, D >= 1), got shape {tuple(encoder_out.shape)}"
        )
    if predictor_out.size(0) != B or predictor_out.size(2) != D:
        raise ValueError(
            f"predictor_out: expected shape ({B}, maxU+1, {D}) to match encoder_out "
            f"{tuple(encoder_out.shape)}, got {tuple(predictor_out.shape)}"
        )
    if logit_lengths.shape != (B,) or target_lengths.shape != (B,):
        raise ValueError(
            f"logit_lengths, target_lengths: expected shape ({B},), got "
            f"{tuple(logit_lengths.shape)} and {tuple(target_lengths.shape)}"
        )
    check_rows_before_copy(encoder_out, predictor_out, logit_lengths, target_lengths)
    return custom_ops.pack(encoder_out.contiguous(), predictor_out.contiguous(), logit_lengths, target_lengths)[0]


def check_rows_before_copy(encoder_out, predictor_out, logit_lengths, target_lengths):
    """The lengths against the inputs (checks.check_pack_values) before ``.contiguous()`` copies them, where their
    shapes admit more than MAX_ROWS rows and one of them is a view to copy (an expanded tensor may be far larger
    copied): lengths whose rows the kernels cannot index are refused before the copy (the op checks them again
    after it, for every shape). One host read of the lengths' layout on that rare path."""
    bound = encoder_out.size(0) * encoder_out.size(1) * predictor_out.size(1)
    if (
        torch.compiler.is_compiling()
        or bound <= MAX_ROWS
        or (encoder_out.is_contiguous() and predictor_out.is_contiguous())
    ):
        return
    layout = stages_for(encoder_out.device).layout(logit_lengths, target_lengths, predictor_out.size(1))
    check_pack_values(encoder_out, predictor_out, layout.stats.tolist())
