"""The fused joiner loss's tiles on Hopper GPUs (sm_90): the logits GEMM of forward and backward's recompute replaced
by the CuTe DSL kernels of transducer.hopper, so that no tile of logits is written (transducer/fused/tiles.py's TilePath).

Forward: ``hopper.statistics_tile`` gives each tile's rows' den and blank and label logits, against the rows' labels
(the CUDA stages' row_labels), and row_log_probs writes every row's lp and den from them as the log-probs stage
would; the statistics also give each row's entries of the projection's extra columns: TDT's duration scores (its rows
past the V token rows, outside the softmax; tdt_row_log_probs writes the TDT log-probs) or the
multi-blank loss's big blanks' logits (columns blank - K ... blank - 1). Backward: row_coefficients
(tdt_row_coefficients) forms every row's labels and gradient coefficients once a pass, each tile taking its slice
(stages.cu: gradient_kernel's per-row terms, the big blanks' arcs among them; tdt.cu: tdt_gradient_kernel's, and the
duration scores' gradient) and ``hopper.gradient_tile`` writes each tile's gradient G = dL/dz once, in the GEMMs'
dtype (TDT's duration columns written into it after), for cuBLAS's dh = G W and dW = G^T h. The logits are fp32
accumulators here (not rounded to the GEMMs' dtype as in the other path) and the bias is added to them in fp32.

The path runs where ``use_hopper`` says: every lattice, bf16 or fp16 GEMMs, J a positive multiple of 8, an sm_90 GPU
with ``nvidia-cutlass-dsl`` and ``apache-tvm-ffi`` importable (the ``hopper`` extra) whose kernels pass their
self-test, unless ``TRANSDUCER_HOPPER=0`` is in the environment; elsewhere the other path runs (DESIGN.md: The fused
step on Hopper's kernels). Which path runs is logged once per process on the ``transducer`` logger.
"""

import functools
import logging
import os

import torch

from .. import hopper
from ..cuda import stages as cuda_stages
from .tiles import (
    Step,
    TilePathBase,
    extra_columns,
    first_tile,
    gemm_rows,
    hidden,
    hidden_buffer,
    projection,
    tiles,
    tiles_after,
)

__all__ = ["use_hopper", "HopperTiles"]

_log = logging.getLogger("transducer")
_said = set()
_available = functools.lru_cache(maxsize=None)(hopper.available)


def use_hopper(kind, compute_dtype, device, J):
    """Whether the fused loss's tiles run on the Hopper kernels: GEMMs in bf16 or fp16 on an sm_90 GPU where
    transducer.hopper's kernels are available and pass their self-test, the joiner's width J a positive multiple of 8
    (16-byte rows for TMA), unless ``TRANSDUCER_HOPPER`` is 0 (or false, off, no) in the environment; ``kind``, the
    lattice (RNN-T and RNA, TDT, multi-blank: all run there), is named in the log line.
    Says once per process and answer which path runs (an info line on the ``transducer`` logger; a warning where the
    kernels are available and fail their self-test)."""
    on = os.environ.get("TRANSDUCER_HOPPER", "1").strip().lower() not in ("0", "false", "off", "no")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():  # one key a device
        device = torch.device("cuda", torch.cuda.current_device())
    hopper_gpu = on and device.type == "cuda" and _available(device)
    takes = compute_dtype in hopper.DTYPES and J > 0 and J % 8 == 0
    failed = hopper.self_test(device) if hopper_gpu and takes else None
    use = hopper_gpu and takes and failed is None
    if use:
        why = f"the {kind.name} lattice, 16-bit GEMMs on sm_90"
    elif not on:
        why = f"TRANSDUCER_HOPPER={os.environ['TRANSDUCER_HOPPER']}"
    elif not hopper_gpu:
        why = "no sm_90 GPU with nvidia-cutlass-dsl and apache-tvm-ffi"
    elif failed:
        why = f"the Hopper kernels did not pass their self-test on {device}: {failed}"
    else:
        why = f"{compute_dtype} GEMMs, J = {J}: the Hopper kernels take 16-bit GEMMs and J a positive multiple of 8"
    if (use, why) not in _said:
        _said.add((use, why))
        path = "the Hopper kernels (transducer.hopper)" if use else "cuBLAS GEMMs and the CUDA stages"
        _log.log(
            logging.WARNING if failed else logging.INFO, "fused_joiner_loss: the logits tiles run on %s (%s)", path, why
        )
    return use


class HopperTiles(TilePathBase):
    """transducer/fused/tiles.py's TilePath on transducer.hopper's kernels: forward's tiles hold only the hidden, so
    they take as many rows as fill the bytes of ``max_rows`` rows of hidden and logits."""

    def __init__(self, step: Step, weight, bias, compute_dtype):
        self.step, self.weight, self.bias, self.compute_dtype = step, weight, bias, compute_dtype
        V, D = step.V, step.D
        # the kernels' operand, W alone: the kernel adds the bias in its epilogue
        self.projection = hopper.projection(
            weight.to(compute_dtype).contiguous(), bias, tokens=V, extra=extra_columns(V, D, step.options)
        )
        self.J, self.rows = weight.size(1), weight.size(0)

    @functools.cached_property
    def Wx(self):
        """Backward's projection for the hidden and the weight gradient (tiles.projection)."""
        return projection(self.weight, self.bias, self.compute_dtype)[0]

    def _forward_rows(self, max_rows):
        """Forward's rows a tile: those whose hidden fills the bytes of max_rows rows of hidden and logits."""
        return max_rows * (self.J + self.rows) // self.J

    def begin_forward(self, max_rows, bound):
        """The first tile's hidden (first_tile), packed before the row count is known: pack_forward leaves the rows
        past the layout's zeros. (The statistics kernel takes the rows' labels, made for the row count.)"""
        s, W = self.step, self.projection.W
        tile = self._forward_rows(max_rows)
        first = first_tile(tile, bound, "cuda")
        if first:
            buffer = hidden_buffer(s, W, tile)  # no tile has more rows
            hidden(s, W, 0, first, buffer=buffer)
            self.begun = first, buffer

    def forward(self, num_rows, max_rows, arrays):
        s, p = self.step, self.projection
        W = p.W  # forward's hidden has no bias columns
        tile = self._forward_rows(max_rows)
        begun, self.begun = self.begun, None
        early = begun is not None  # the first tile's hidden is in the buffer
        if early:
            packed, buffer = begun
            del begun  # the buffer's names: freed with it below
            bounds = tiles_after(packed, num_rows, tile)
        else:
            bounds = list(tiles(num_rows, tile))
            buffer = hidden_buffer(s, W, max((end - start for start, end in bounds), default=0))
        labels = statistics = None
        for start, end in bounds:
            if start == 0 and early:  # begin_forward's
                hx = buffer[: end - start]
            else:
                hx = hidden(s, W, start, end, buffer=buffer)
            if labels is None:  # made once the GPU has the first tile's pack to run
                labels = cuda_stages.row_labels(s.targets, s.layout, s.options.blank, num_rows)
                statistics = s.encoder_out.new_empty(3 + p.extra, num_rows, dtype=torch.float32)
            hopper.statistics_tile(p, hx, labels[start:end], s.options.blank, statistics[:, start:end])
            del hx
        del buffer
        if statistics is None:  # no rows
            return
        # each row's den, z_blank, z_label (and duration or big blank scores), then the log-probs; the extra
        # columns' bias: the kernel's statistics have none
        first, count = p.extra_start, p.extra
        extra_bias = (
            None if self.bias is None or not count else self.bias[first : first + count].to(torch.float32).contiguous()
        )
        if s.D:
            cuda_stages.tdt_row_log_probs(statistics, extra_bias, s.targets, s.layout, s.options, arrays)
        else:
            cuda_stages.row_log_probs(
                statistics, s.targets, s.layout, s.options, arrays.lp, arrays.den, arrays.lp_arcs, extra_bias
            )

    def gradient_tiles(self, num_rows, max_rows, lattice, scale):
        s, D = self.step, self.step.D
        dtype, clamp = self.Wx.dtype, max(s.options.clamp, 0.0)
        # every row's labels and gradient coefficients for the kernel at once (and TDT's duration columns'), their
        # tiles' slices of them after
        if D:
            coefficients, labels, duration_gradient = cuda_stages.tdt_row_coefficients(
                s.targets, lattice, scale, s.options, 0, num_rows, dtype
            )
        else:
            coefficients, labels = cuda_stages.row_coefficients(s.targets, lattice, scale, s.options, 0, num_rows)
        rows = (labels, coefficients, duration_gradient if D else None)
        bounds = list(tiles(num_rows, max_rows))
        buffer = hidden_buffer(s, self.Wx, max((gemm_rows(end - start, "cuda") for start, end in bounds), default=0))
        for start, end in bounds:
            # no name here holds the tile's tensors while the caller has them: it frees dz before pack's backward
            yield (start, end, *self._gradient_tile(start, end, rows, clamp, buffer))

    def _gradient_tile(self, start, end, rows, clamp, buffer):
        """(hx, dz) of the rows [start, end), from ``rows`` = every row's (labels, coefficients, TDT's duration
        gradient or None)."""
        s, V, D = self.step, self.step.V, self.step.D
        labels, coefficients, duration_gradient = rows
        count = end - start
        hx = hidden(s, self.Wx, start, end, gemm_rows(count, "cuda"), buffer)
        # the gradient from the recompute's epilogue; it and Wx are zeros past V
        dz = hopper.gradient_tile(
            self.projection,
            hx[:count, : self.J],
            labels[start:end],
            s.options.blank,
            coefficients[:, start:end],
            clamp,
            hx.size(0),
        )
        if D:  # the duration columns, zeros from the kernel
            dz[:count, V : V + D] = duration_gradient[start:end]
        return hx, dz[:, : min(dz.size(1), self.Wx.size(0))]
