"""The fused joiner loss's tiles on Hopper GPUs (sm_90): the logits GEMM of forward and backward's recompute replaced
by the CuTe DSL kernels of transducer.hopper, so that no tile of logits is written.

Forward: ``logits_statistics`` gives each tile's rows' den and blank and label logits, from which ``log_probs`` writes
every row's lp and den as the log-probs stage does (transducer/stages.cu: log_probs_kernel). Backward: ``coefficients``
forms every row's coefficients (stages.cu: gradient_kernel's per-row terms) with a few torch operations over the rows,
and ``logits_gradient`` writes each tile's gradient G = dL/dz once, in the GEMMs' dtype, for cuBLAS's dh = G W and dW =
G^T h. The rows' cells and labels (``cells``) are found once a pass, on the GPU. The logits are fp32 accumulators here
(not rounded to the GEMMs' dtype as in the other path) and the bias is added to them in fp32.

The path runs where ``use_hopper`` says: ``TRANSDUCER_HOPPER=1`` in the environment, RNN-T and RNA lattices, bf16
or fp16 GEMMs, an sm_90 GPU and ``nvidia-cutlass-dsl`` importable; elsewhere the other path runs. It is off by
default: its GPU time is below the other path's, but each launch of a CuTe DSL kernel costs the host about 150-250 us
(the DSL's Python argument marshalling), and with the rows' torch operations the step becomes host-bound and slower
(DESIGN.md: The fused step on Hopper's kernels). Which path runs is logged once per process on the ``transducer``
logger.
"""

import functools
import logging
import math
import os

import torch

from ragged.shape import row_of

from . import hopper
from .lattices import RNNT

__all__ = ["use_hopper", "cells", "log_probs", "coefficients"]

_log = logging.getLogger("transducer")
_said = set()
_available = functools.lru_cache(maxsize=None)(hopper.available)


def use_hopper(kind, compute_dtype, device, J):
    """Whether the fused loss's tiles run on the Hopper kernels: ``TRANSDUCER_HOPPER=1`` in the environment,
    ``kind`` the RNN-T lattice (RNN-T or RNA), GEMMs in bf16 or fp16 on an sm_90 GPU with ``nvidia-cutlass-dsl``
    importable, and the joiner's width J a multiple of 8 (16-byte rows for TMA). Says once per process and answer
    which path runs (an info line on the ``transducer`` logger)."""
    on = os.environ.get("TRANSDUCER_HOPPER", "0") == "1"
    hopper_gpu = on and device.type == "cuda" and _available(device)
    use = hopper_gpu and kind is RNNT and compute_dtype in hopper.DTYPES and J % 8 == 0
    if use:
        why = "RNN-T or RNA lattice, 16-bit GEMMs on sm_90"
    elif not on:
        why = "TRANSDUCER_HOPPER is not 1"
    elif not hopper_gpu:
        why = "no sm_90 GPU with nvidia-cutlass-dsl"
    else:
        why = (f"the {kind.name} lattice, {compute_dtype} GEMMs, J = {J}: the Hopper kernels take RNN-T and RNA, "
               f"16-bit GEMMs and J a multiple of 8")
    if (use, why) not in _said:
        _said.add((use, why))
        path = "the Hopper kernels (transducer.hopper)" if use else "cuBLAS GEMMs and the CUDA stages"
        _log.info("fused_joiner_loss: the logits tiles run on %s (%s)", path, why)
    return use


def cells(layout, targets, num_rows):
    """(b, t, u, labels) of the compact layout's rows [0, num_rows), on the layout's device without a host read: b, t,
    u int64, labels int32 (targets[b, u] for u < U_b, else -1)."""
    rows = torch.arange(num_rows, device=layout.table.device)
    b = row_of(layout.row_splits, rows)
    stride = layout.row_strides[b]
    local = rows - layout.cell_offsets[b]
    t = torch.div(local, stride, rounding_mode="floor")
    u = local - t * stride
    if targets.size(1) == 0:
        return b, t, u, torch.full_like(b, -1, dtype=torch.int32)
    labels = torch.where(u < layout.target_lengths[b], targets[b, u.clamp(max=targets.size(1) - 1)], -1)
    return b, t, u, labels.to(torch.int32)


def log_probs(statistics, b, t, labels, layout, options, arrays):
    """Writes the log-probs stage's lp and den of the rows [0, N) into ``arrays`` (LogProbs of at least N rows)
    from ``statistics`` (3, N) = (den, z_blank, z_label) (hopper.logits_statistics) and the rows' cells: lp =
    (z_blank - den, z_label - den + delay penalty, or -inf without a label), as stages.cu's log_probs_kernel."""
    N = statistics.size(1)
    den, z_blank, z_label = statistics
    arrays.den[:N] = den
    arrays.lp[:N, 0] = z_blank - den
    label_lp = z_label - den
    if options.delay_penalty:  # k2's delay penalty: delay_penalty * ((T_b - 1) / 2 - t)
        T = layout.logit_lengths[b].to(den.dtype)
        label_lp += options.delay_penalty * ((T - 1) * 0.5 - t.to(den.dtype))
    arrays.lp[:N, 1] = torch.where(labels >= 0, label_lp, -math.inf)


def coefficients(lattice, scale, options, b, t, u):
    """(5, N) float32 for hopper.logits_gradient over the rows [0, N) whose cells are (b, t, u): den, occupancy,
    blank arc, label arc and scale. With the cell's posterior gamma = exp(alpha + loss + beta) and its arcs'
    posteriors (stages.cu's gradient_kernel), occupancy = gamma + lambda * label_arc and the label arc is times
    1 + lambda (FastEmit); a row of an utterance whose loss is not finite or whose scale is 0, or off RNA's band,
    gets den = +inf and zeros (a zero gradient)."""
    layout = lattice.layout
    N = b.size(0)
    T, U, stride = layout.logit_lengths[b], layout.target_lengths[b], layout.row_strides[b]
    last = lattice.beta.size(0) - 1
    rows = torch.arange(N, device=b.device)
    beta = lattice.beta
    loss, row_scale = lattice.nll[b], scale[b]
    live = torch.isfinite(loss) & (row_scale != 0)
    if options.one_sym_per_frame:
        live &= (u <= t) & (t - u <= T - 1 - U)
    lognorm = lattice.alpha[:N] + loss
    lp = lattice.lp[:N]
    # after the blank: (t + 1, u), or the end of the alignment from (T - 1, U)
    after_blank = torch.where(t + 1 < T, beta[(rows + stride).clamp(max=last)], torch.where(u == U, 0.0, -math.inf))
    if options.one_sym_per_frame:  # after the label: (t + 1, u + 1)
        after_label = torch.where((u < U) & (t + 1 < T), beta[(rows + stride + 1).clamp(max=last)], -math.inf)
    else:  # (t, u + 1)
        after_label = torch.where(u < U, beta[(rows + 1).clamp(max=last)], -math.inf)
    blank_arc = torch.exp(lognorm + lp[:, 0] + after_blank)
    label_arc = torch.where(u < U, torch.exp(lognorm + lp[:, 1] + after_label), 0.0)
    occupancy = torch.exp(lognorm + beta[:N])
    lam = options.fastemit_lambda
    if lam:
        occupancy = occupancy + lam * label_arc
        label_arc = label_arc * (1 + lam)
    terms = torch.stack([lattice.den[:N], occupancy, blank_arc, label_arc, row_scale]).where(live, 0.0)
    terms[0].masked_fill_(~live, math.inf)
    return terms.float()
