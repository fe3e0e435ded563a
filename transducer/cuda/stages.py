"""The CUDA stages of the transducer losses (the contract: transducer/backend.py), and the packing op.

Same functions, arguments and results as ``transducer.cpu.stages``. The kernels (``stages.cu``, ``tdt.cu``,
``pack.cu``, listed at the top of each) take one parameter struct each, filled here by field name: the
``*_PARAMS`` structs below mirror the C definitions field for field (tests/test_kernel_params.py checks
them). They are launched through ``ops.cuda.launch``: torch's current stream, torch-allocated outputs, no
host synchronisation, so a training step stays capturable in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import numpy as np
import torch

from ops import FastDivmod, accumulate_dtype, ctype
from ops.cuda import DEFAULT_SHARED_MEM, ceil_div, launch, launch_each, max_shared_mem, num_sms, vector_width
from ops.params import FAST_DIVMOD, struct

from ..joiner import ACTIVATIONS
from ..lattices import Walks
from ..layout import MAX_DURATIONS, Layout, table_size

_HERE = os.path.dirname(os.path.abspath(__file__))
_STAGES = os.path.join(_HERE, "stages.cu")
_TDT = os.path.join(_HERE, "tdt.cu")
_PACK = os.path.join(_HERE, "pack.cu")

THREADS = 256  # block size of the per-row kernels and the pack kernels (row_pass.cuh: kThreads)
# CUDA's limit of threads per block: the walks' blocks (a thread per u) and layout_kernel's (layout.cuh:
# kMaxBlockThreads)
MAX_BLOCK_THREADS = 1024
PACK_ROWS = 4  # rows a warp of pack_forward_kernel writes (pack.cu: kPackRows)
PACK_FRAMES = 8  # frames a warp of pack_grad_kernel sums (pack.cu: kSumFrames)
PACK_LANES = 8  # vectors of a row a warp of pack_grad_kernel takes (pack.cu: kSumLanes)
PACK_SUM_THREADS = 128  # pack_grad_kernel's block (pack.cu: kSumThreads)
PACK_PRED_PARTS = 8  # lanes a vector of pack_grad_pred_kernel (pack.cu: kPredParts)
# values of u a warp of pack_grad_kernel takes where utterances have more rows a frame (a multiple of pack.cu's
# kSumSteps): a tile of a few long utterances has few frame blocks, too few warps to fill the GPU without chunks of u
PACK_U_CHUNK = 32
WALK_MAX_DURATIONS = 8  # tdt_walk_kernel: D is a template parameter (its cells' log-probs stay in registers)
WALK_MAX_THREADS = 512  # tdt_walk_kernel's launch bound (tdt.cu: kWalkMaxThreads)
# steps of log-probs tdt_walk_kernel reads ahead (DESIGN.md: The TDT walk is bound by its instructions, not its loads)
_WALK_AHEAD = 2
# RowOut<..., true>'s rows a block: room left within DEFAULT_SHARED_MEM for the kernels' static shared memory
_STAGE_LIMIT = 32 * 1024
# threads_per_row's bytes of a row a lane, at most, in the log-probs pass (a read) and the gradient pass (a read and a
# write, and more state a row): the fastest of 8, 16 and 32 lanes a row at rows of 256 bytes to 4 KiB (RESULTS.md:
# Several rows a warp)
LOG_PROBS_LANE_BYTES = 256
GRADIENT_LANE_BYTES = 64
_WIDE_ROW_BYTES = 4096  # gradient_row_width: rows up to this size are padded (8 a block stage within the limit)

# The kernels' parameter structs and their parts (params.cuh, layout.cuh, stages.cu, tdt.cu, pack.cu).
PADDED_GRID = struct("PaddedGrid", [("utt", FAST_DIVMOD), ("frame", FAST_DIVMOD)])
GRIDS = struct("Grids", [("table", "ptr"), ("B", "int"), ("pad", PADDED_GRID)])
ROWS = struct(
    "Rows",
    [("data", "ptr"), ("ld", "long long"), ("row_start", "int"), ("num_rows", "int"), ("V", "int"), ("n", "int")],
)
LABELS = struct("Labels", [("targets", "ptr"), ("cols", "int"), ("blank", "int")])
LATTICE = struct("Lattice", [("lp", "ptr"), ("den", "ptr"), ("alpha", "ptr"), ("beta", "ptr"), ("nll", "ptr")])
WALKS = struct("Walks", [("alpha", "ptr"), ("beta", "ptr"), ("nll", "ptr")])
SCALE = struct("Scale", [("values", "ptr"), ("stride", "long long")])
DURATIONS = struct("Durations", [("n", "int"), ("d", ("int", MAX_DURATIONS))])
DURATION_ROWS = struct("DurationRows", [("data", "ptr"), ("ld", "long long"), ("D", "int")])
TERMS = struct(
    "Terms",
    [
        ("sigma", "double"),
        ("delay_penalty", "double"),
        ("fastemit_lambda", "double"),
        ("omega", "double"),
        ("clamp", "double"),
    ],
)
DROPOUT = struct(
    "Dropout",
    [("seed_lo", "unsigned int"), ("seed_hi", "unsigned int"), ("threshold", "unsigned int"), ("scale", "double")],
)

LAYOUT_PARAMS = struct(
    "LayoutParams",
    [
        ("logit_lengths", "ptr"),
        ("target_lengths", "ptr"),
        ("labels", LABELS),
        ("B", "int"),
        ("padded_t", "int"),
        ("max_u1", "int"),
        ("V", "int"),
        ("big_blanks", "int"),
        ("table", "ptr"),
    ],
)
LOG_PROBS_PARAMS = struct(
    "LogProbsParams",
    [
        ("grids", GRIDS),
        ("logits", ROWS),
        ("labels", LABELS),
        ("from_log_softmax", "bool"),
        ("terms", TERMS),
        ("big_blanks", "int"),
        ("lp", "ptr"),
        ("den", "ptr"),
        ("lp_arcs", "ptr"),
    ],
)
ALPHA_BETA_PARAMS = struct(
    "AlphaBetaParams", [("grids", GRIDS), ("lp", "ptr"), ("padded", "bool"), ("cap", "int"), ("out", WALKS)]
)
GRADIENT_PARAMS = struct(
    "GradientParams",
    [
        ("grids", GRIDS),
        ("logits", ROWS),
        ("labels", LABELS),
        ("lattice", LATTICE),
        ("scale", SCALE),
        ("terms", TERMS),
        ("lp_arcs", "ptr"),
        ("big_blank_durations", DURATIONS),
        ("out", "ptr"),
        ("ld_out", "long long"),
    ],
)
TDT_LOG_PROBS_PARAMS = struct(
    "TdtLogProbsParams",
    [
        ("grids", GRIDS),
        ("tokens", ROWS),
        ("duration_scores", DURATION_ROWS),
        ("labels", LABELS),
        ("terms", TERMS),
        ("lp", "ptr"),
        ("lp_arcs", "ptr"),
        ("den", "ptr"),
        ("den_arcs", "ptr"),
    ],
)
TDT_WALK_PARAMS = struct(
    "TdtWalkParams",
    [
        ("grids", GRIDS),
        ("lp", "ptr"),
        ("lp_arcs", "ptr"),
        ("durations", DURATIONS),
        ("padded", "bool"),
        ("ring", "int"),
        ("cols", "int"),
        ("out", WALKS),
    ],
)
TDT_GRADIENT_PARAMS = struct(
    "TdtGradientParams",
    [
        ("grids", GRIDS),
        ("tokens", ROWS),
        ("duration_scores", DURATION_ROWS),
        ("durations", DURATIONS),
        ("labels", LABELS),
        ("lattice", LATTICE),
        ("lp_arcs", "ptr"),
        ("den_arcs", "ptr"),
        ("rnnt", WALKS),
        ("scale", SCALE),
        ("terms", TERMS),
        ("out_tokens", "ptr"),
        ("ld_out_tokens", "long long"),
        ("out_duration_scores", "ptr"),
        ("ld_out_duration_scores", "long long"),
    ],
)
ROW_LABELS_PARAMS = struct(
    "RowLabelsParams", [("grids", GRIDS), ("labels", LABELS), ("num_rows", "int"), ("out", "ptr")]
)
ROW_LOG_PROBS_PARAMS = struct(
    "RowLogProbsParams",
    [
        ("grids", GRIDS),
        ("labels", LABELS),
        ("num_rows", "int"),
        ("big_blanks", "int"),
        ("statistics", "ptr"),
        ("ld_statistics", "long long"),
        ("big_blank_bias", "ptr"),
        ("terms", TERMS),
        ("lp", "ptr"),
        ("den", "ptr"),
        ("lp_arcs", "ptr"),
    ],
)
ROW_COEFFICIENTS_PARAMS = struct(
    "RowCoefficientsParams",
    [
        ("grids", GRIDS),
        ("labels", LABELS),
        ("lattice", LATTICE),
        ("scale", SCALE),
        ("terms", TERMS),
        ("lp_arcs", "ptr"),
        ("big_blank_durations", DURATIONS),
        ("row_start", "int"),
        ("num_rows", "int"),
        ("coefficients", "ptr"),
        ("labels_out", "ptr"),
    ],
)
TDT_ROW_LOG_PROBS_PARAMS = struct(
    "TdtRowLogProbsParams",
    [
        ("grids", GRIDS),
        ("labels", LABELS),
        ("num_rows", "int"),
        ("D", "int"),
        ("statistics", "ptr"),
        ("ld_statistics", "long long"),
        ("duration_bias", "ptr"),
        ("terms", TERMS),
        ("lp", "ptr"),
        ("lp_arcs", "ptr"),
        ("den", "ptr"),
        ("den_arcs", "ptr"),
    ],
)
TDT_ROW_COEFFICIENTS_PARAMS = struct(
    "TdtRowCoefficientsParams",
    [
        ("grids", GRIDS),
        ("labels", LABELS),
        ("durations", DURATIONS),
        ("lattice", LATTICE),
        ("lp_arcs", "ptr"),
        ("rnnt", WALKS),
        ("scale", SCALE),
        ("terms", TERMS),
        ("row_start", "int"),
        ("num_rows", "int"),
        ("coefficients", "ptr"),
        ("labels_out", "ptr"),
        ("duration_gradient", "ptr"),
    ],
)
PACK_FORWARD_PARAMS = struct(
    "PackForwardParams",
    [
        ("enc", "ptr"),
        ("pred", "ptr"),
        ("max_t", "int"),
        ("max_u1", "int"),
        ("grids", GRIDS),
        ("row_start", "int"),
        ("num_rows", "int"),
        ("out_rows", "int"),
        ("nvec", "int"),
        ("ones", "int"),
        ("dropout", DROPOUT),
        ("out", "ptr"),
        ("ld_out", "long long"),
    ],
)
PACK_GRAD_PARAMS = struct(
    "PackGradParams",
    [
        ("grad_rows", "ptr"),
        ("enc", "ptr"),
        ("pred", "ptr"),
        ("max_t", "int"),
        ("max_u1", "int"),
        ("grids", GRIDS),
        ("b0", "int"),
        ("frame_blocks", "int"),
        ("u_chunk", "int"),
        ("pred_blocks", "int"),
        ("enc_blocks", "int"),
        ("row_start", "int"),
        ("row_end", "int"),
        ("nvec", "int"),
        ("dropout", DROPOUT),
        ("scratch", "ptr"),
        ("enc_scratch", "ptr"),
        ("grad_enc", "ptr"),
        ("grad_pred", "ptr"),
    ],
)


@functools.lru_cache(maxsize=1024, typed=True)  # typed: True and 1 are different template arguments
def _name(kernel, *params):
    """The instantiation ``kernel<params>``: torch dtypes by their C names, bools as true / false, the rest as
    written (made once per combination: a step launches several kernels)."""
    c = [
        ctype(p)
        if isinstance(p, torch.dtype)
        else ("true" if p else "false")
        if isinstance(p, (bool, np.bool_))
        else str(p)
        for p in params
    ]
    return f"{kernel}<{', '.join(c)}>"


def threads_per_row(num_rows, row_bytes, device, bytes_per_lane=0):
    """The row kernels' threads a row (row_pass.cuh's RowGeometry): THREADS (a block) for rows too long for a warp
    (over 16 KiB) or too few rows to fill the GPU with warps; else a warp, or with ``bytes_per_lane`` the fewest
    lanes of a warp, 8, 16 or 32, that leave each lane at most that much of the row (LOG_PROBS_LANE_BYTES,
    GRADIENT_LANE_BYTES). A short row's fixed work (finding its utterance, the label's load, the merge of its
    logsumexp state, the stores) outweighs its elements' at a warp a row; at 8 or 16 lanes a row, 4 or 2 rows of a
    warp share each instruction of it (DESIGN.md: Several rows a warp for short rows). A lane keeps RowPass's
    vectors in flight (2 to 4) whatever its row's length, so the loads in flight an SM do not shrink with fewer lanes
    a row."""
    if row_bytes > 16384:
        return THREADS
    if row_bytes >= 4096 and num_rows < 64 * num_sms(device):
        return THREADS
    return next(g for g in (8, 16, 32) if bytes_per_lane and row_bytes <= g * bytes_per_lane or g == 32)


def _row_pass(num_rows, V, itemsize, rows, bytes_per_lane, outs=(), staging=False, lanes=0):
    """(threads a row, vec, aligned, staged) of a row kernel's pass over the V columns of ``rows`` (and ``outs``:
    row_access): threads_per_row's, with lanes enough for what the pass gives lanes of the row: the unaligned
    pass's head and tail scalars, one a lane (``unaligned_scalars``), and ``lanes`` of the row's own (the multi-blank
    loss's big blanks). A staged gradient (``staging``) keeps a warp a row at least: its rows' copies in shared memory
    are sized for the rows a block has at a warp (8) or a block (1) a row."""
    tpr = threads_per_row(num_rows, V * itemsize, rows.device, bytes_per_lane)
    vec, aligned, staged = row_access(itemsize, V, rows, outs, THREADS // max(tpr, 32) if staging else 0)
    if tpr < 32:
        need = 32 if staged else max(lanes, 0 if aligned else unaligned_scalars(V, vec, rows))
        tpr = next(g for g in (8, 16, 32) if g >= max(tpr, need) or g == 32)
    return tpr, vec, aligned, staged


def unaligned_scalars(V, vec, rows):
    """The most scalars a row of the unaligned pass over the V columns of ``rows`` reads (row_pass.cuh's RowPass<...,
    false>: its head, up to the first vec boundary, and its tail, after the last whole vector): V % vec where every
    row starts on a 16-byte boundary (no head: the fused loss's 500 token columns of 512-wide tiles), else up to
    2 vec - 2 (and V)."""
    starts = rows.data_ptr() % 16 == 0 and (rows.size(0) <= 1 or rows.stride(0) * rows.element_size() % 16 == 0)
    return V % vec if starts else min(V, 2 * vec - 2)


def _check_cuda(*tensors):
    for t in tensors:
        if not t.is_cuda:
            raise ValueError("transducer.cuda.stages: every tensor must be on a CUDA device")


def _row_major(name, x):
    if x.dim() != 2 or (x.size(1) > 1 and x.stride(1) != 1):
        raise ValueError(
            f"transducer.cuda.stages: {name} must be 2-D with unit column stride, got strides {x.stride()}"
        )


def row_access(itemsize, V, rows, outs=(), stage_rows=0):
    """(vec, aligned, staged) of a row pass over the V columns of the row-major 2-D ``rows`` (read) and
    ``outs`` (written at the same columns): whole 16-byte vectors when every row starts on a 16-byte
    boundary; else, when every output row sits at its input row's offset from one (same base offset and row
    strides modulo 16 bytes), 16-byte vectors between a scalar head and tail per row (row_pass.cuh's
    RowPass<..., false>: NeMo's 1029-wide TDT rows, the 500 token columns of the fused joiner's 512-wide
    tiles); else the widest width that every row allows, or, for a gradient kernel (``stage_rows``: its rows
    a block) writing one output whose rows start on 16-byte boundaries, when that width is under 8 bytes and
    the block's rows fit in shared memory, the unaligned pass with the output assembled there (staged:
    row_pass.cuh's RowOut; a 505-wide joint's gradient in 512-wide rows)."""
    tensors = [rows, *outs]
    full = 16 // itemsize
    vec = vector_width(itemsize, math.gcd(V, *(t.stride(0) for t in tensors)), tensors)
    if vec == full:
        return vec, True, False
    if all(
        (o.data_ptr() - rows.data_ptr()) % 16 == 0 and (o.stride(0) - rows.stride(0)) * itemsize % 16 == 0 for o in outs
    ):
        return full, False, False
    if (
        stage_rows
        and len(outs) == 1
        and vec * itemsize < 8
        and vector_width(itemsize, outs[0].stride(0), outs) == full
        and _stage_bytes(stage_rows, V, itemsize) <= _STAGE_LIMIT
    ):
        return full, False, True
    return vec, True, False


def _stage_bytes(stage_rows, V, itemsize):
    """Shared memory of RowOut<..., true>: a block's rows, V columns rounded up to 16 bytes."""
    return stage_rows * ceil_div(V * itemsize, 16) * 16


def gradient_row_width(V, itemsize):
    """The row width (elements) of a new gradient of V-wide logits that an op made (custom_ops.gradient_buffer):
    16-bit rows that are not a multiple of 16 bytes, up to 4 KiB, are padded to one. cuBLAS reads such a
    gradient with 16-byte loads in the joint Linear's backward (DESIGN.md: 16-byte rows for cuBLAS), and the
    gradient kernels still write whole vectors: 8-byte ones when they fit both row widths, else through shared
    memory (RowOut<..., true>, 8 rows a block within _STAGE_LIMIT). V otherwise: fp32 steps gained nothing
    measurable, and longer rows would fall back to narrow accesses."""
    row = V * itemsize
    if itemsize != 2 or row % 16 == 0 or row > _WIDE_ROW_BYTES:
        return V
    return ceil_div(row, 16) * 16 // itemsize


_COMPACT_GRID = PADDED_GRID(FAST_DIVMOD(0, 0, 0), FAST_DIVMOD(0, 0, 0))


def _grids(layout, padded_grid=True):
    """The kernels' Grids of the layout: its table, B and, with ``padded_grid`` and a padded layout whose maxT
    is known, the PaddedGrid (layout.cuh): rows per utterance (maxT * (maxU + 1)) and per frame (maxU + 1),
    which divide any row of the layout (tiles too). Zeros otherwise: the search over row_splits, right for
    both layouts."""
    pad = _COMPACT_GRID
    if padded_grid and layout.padded and layout.padded_t > 0:
        pad = _padded_grid(layout.padded_t * layout.max_u1, layout.max_u1)
    return GRIDS(table=layout.table, B=layout.batch_size, pad=pad)


@functools.lru_cache(maxsize=256)
def _padded_grid(rows_per_utterance, max_u1):
    return PADDED_GRID(FastDivmod(rows_per_utterance).params(), FastDivmod(max_u1).params())


def _terms(options):
    """terms.cuh's struct Terms: the options the kernels' per-row terms read (a clamp <= 0: none, as 0)."""
    return TERMS(
        sigma=options.sigma,
        delay_penalty=options.delay_penalty,
        fastemit_lambda=options.fastemit_lambda,
        omega=options.omega,
        clamp=max(options.clamp, 0.0),
    )


def _labels_struct(targets, blank):
    return LABELS(targets=targets, cols=targets.size(1), blank=blank)


def _rows_struct(x, row_start, vec, aligned):
    """The ROWS of the 2-D ``x`` (rows [row_start, row_start + len(x)) of the layout): ``n`` is the row's
    vectors when aligned, else its columns (row_pass.cuh's RowPass)."""
    V = x.size(1)
    return ROWS(data=x, ld=x.stride(0), row_start=row_start, num_rows=x.size(0), V=V, n=V // vec if aligned else V)


# --------------------------------------------------------------------------- RNN-T and RNA stages


def layout(logit_lengths, target_lengths, max_u1, padded_t=0, labels=None, with_stats=True):
    _check_cuda(logit_lengths, target_lengths)
    B = logit_lengths.numel()
    table = torch.empty(table_size(B), dtype=torch.int64, device=logit_lengths.device)
    if labels is None:
        checked, itype, vocab_size, big_blanks = LABELS(targets=None, cols=0, blank=0), "int", 0, 0
    else:
        targets = labels.targets.contiguous()
        checked, itype = _labels_struct(targets, labels.blank), targets.dtype
        vocab_size, big_blanks = labels.vocab_size, labels.big_blanks
    params = LAYOUT_PARAMS(
        logit_lengths=logit_lengths.contiguous(),
        target_lengths=target_lengths.contiguous(),
        labels=checked,
        B=B,
        padded_t=padded_t,
        max_u1=max_u1,
        V=vocab_size,
        big_blanks=big_blanks,
        table=table,
    )
    name = _name("layout_kernel", logit_lengths.dtype, target_lengths.dtype, itype, bool(with_stats))
    launch(_STAGES, name, table, (1,), (MAX_BLOCK_THREADS,), (params,))
    return Layout(table, padded_t > 0, int(max_u1), max(int(padded_t), 0))


def log_probs(logits2d, targets, layout, options, row_start=0, out=None):
    if row_start and out is None:
        raise ValueError("log_probs: row_start > 0 needs out (the arrays of every row)")
    return _log_probs(logits2d, targets, layout, options, row_start, out, 0)


def multiblank_log_probs(logits2d, targets, layout, options, row_start=0, out=None):
    if row_start and out is None:
        raise ValueError("multiblank_log_probs: row_start > 0 needs out (the arrays of every row)")
    return _log_probs(logits2d, targets, layout, options, row_start, out, len(options.big_blank_durations))


def _log_probs(logits2d, targets, layout, options, row_start, out, big_blanks):
    """(lp, den), or with big blanks (lp, den, lp_arcs): log_probs_kernel's outputs (into ``out`` when given)."""
    num_rows, V = logits2d.shape
    acc = accumulate_dtype(logits2d.dtype)
    if out is None:
        new = lambda *shape: torch.empty(shape, dtype=acc, device=logits2d.device)  # noqa: E731
        out = (new(num_rows, 2), new(num_rows)) + ((new(num_rows, big_blanks),) if big_blanks else ())
    if num_rows == 0:
        return out
    _row_major("logits2d", logits2d)
    itemsize = logits2d.element_size()
    lanes = big_blanks + 1 if big_blanks else 0  # log_probs_kernel: lanes 1 ... K load the big blanks
    tpr, vec, aligned, _ = _row_pass(num_rows, V, itemsize, logits2d, LOG_PROBS_LANE_BYTES, lanes=lanes)
    rows_per_block = THREADS // tpr
    params = LOG_PROBS_PARAMS(
        grids=_grids(layout),
        logits=_rows_struct(logits2d, row_start, vec, aligned),
        labels=_labels_struct(targets, options.blank),
        from_log_softmax=options.from_log_softmax,
        terms=_terms(options),
        big_blanks=big_blanks,
        lp=out[0],
        den=out[1],
        lp_arcs=out[2] if big_blanks else None,
    )
    name = _name("log_probs_kernel", logits2d.dtype, targets.dtype, vec, tpr, aligned)
    launch(_STAGES, name, logits2d, (ceil_div(num_rows, rows_per_block),), (THREADS,), (params,))
    return out


def _alpha_beta_smem_entries(max_u1, itemsize):
    """Entries per shared-memory buffer (two buffers): every u's where they fit, else a block's (stages.cu's
    Walk::run_shared takes every utterance of U + 1 <= the block's threads; a longer one reads the previous step
    back from global memory)."""
    return max_u1 if 2 * max_u1 * itemsize <= DEFAULT_SHARED_MEM else min(max_u1, MAX_BLOCK_THREADS)


def _walk(lp, layout):
    """The Walks outputs, and the block size (a thread per u) of a walk over anti-diagonals."""
    new = lambda n: torch.empty(n, dtype=lp.dtype, device=lp.device)  # noqa: E731
    max_u1 = max(int(layout.max_u1), 1)
    return (
        Walks(new(lp.size(0)), new(lp.size(0)), new(layout.batch_size)),
        min(MAX_BLOCK_THREADS, ceil_div(max_u1, 32) * 32),
    )


def _walks_struct(walks):
    return WALKS(alpha=walks.alpha, beta=walks.beta, nll=walks.nll)


def alpha_beta(lp, layout, options):
    walks, threads = _walk(lp, layout)
    B = layout.batch_size
    if B == 0:
        return walks
    cap = _alpha_beta_smem_entries(max(int(layout.max_u1), 1), lp.element_size())
    params = ALPHA_BETA_PARAMS(
        grids=_grids(layout, padded_grid=False), lp=lp, padded=layout.padded, cap=cap, out=_walks_struct(walks)
    )
    name = _name("alpha_beta_kernel", lp.dtype, bool(options.one_sym_per_frame))
    launch(_STAGES, name, lp, (2 * B,), (threads,), (params,), shared_mem=2 * cap * lp.element_size())
    return walks


def _lattice_struct(lattice):
    return LATTICE(lp=lattice.lp, den=lattice.den, alpha=lattice.alpha, beta=lattice.beta, nll=lattice.nll)


def gradient(logits2d, targets, lattice, scale, options, out, row_start=0):
    num_rows, V = logits2d.shape
    if num_rows == 0:
        return out
    _row_major("logits2d", logits2d)
    if out.shape != logits2d.shape or out.dtype != logits2d.dtype:
        raise ValueError("transducer.cuda.stages.gradient: out must have the logits' shape and dtype")
    _row_major("out", out)
    scale = scale.to(lattice.lp.dtype)
    itemsize = logits2d.element_size()
    # The gradient w.r.t. log-probs does not read them: with from_log_softmax the row pass is laid on
    # `out` alone, so the logits' alignment does not narrow its vectors.
    rows = out if options.from_log_softmax else logits2d
    big = options.big_blank_durations
    tpr, vec, aligned, staged = _row_pass(
        num_rows, V, itemsize, rows, GRADIENT_LANE_BYTES, [out], staging=True, lanes=len(big)
    )
    rows_per_block = THREADS // tpr
    terms = _terms(options)
    params = GRADIENT_PARAMS(
        grids=_grids(lattice.layout),
        logits=_rows_struct(rows, row_start, vec, aligned),
        labels=_labels_struct(targets, options.blank),
        lattice=_lattice_struct(lattice),
        scale=SCALE(values=scale, stride=scale.stride(0)),
        terms=terms,
        lp_arcs=lattice.lp_arcs if big else None,
        big_blank_durations=_durations(tuple(big)),
        out=out,
        ld_out=out.stride(0),
    )
    name = _name(
        "gradient_kernel",
        logits2d.dtype,
        targets.dtype,
        vec,
        tpr,
        bool(options.from_log_softmax),
        bool(options.one_sym_per_frame),
        terms.clamp > 0,
        aligned,
        staged,
        bool(big),
    )
    launch(
        _STAGES,
        name,
        logits2d,
        (ceil_div(num_rows, rows_per_block),),
        (THREADS,),
        (params,),
        shared_mem=_stage_bytes(rows_per_block, V, itemsize) if staged else 0,
    )
    return out


# --------------------------------------------------------------------------- rows of the Hopper kernels


def row_labels(targets, layout, blank, num_rows):
    """(num_rows,) int32: each row's label column, y_{u+1} for u < U_b, else -1 (stages.cu's row_labels_kernel),
    for transducer.hopper's kernels."""
    out = torch.empty(num_rows, dtype=torch.int32, device=targets.device)
    if num_rows:
        params = ROW_LABELS_PARAMS(
            grids=_grids(layout), labels=_labels_struct(targets, blank), num_rows=num_rows, out=out
        )
        launch(
            _STAGES,
            _name("row_labels_kernel", targets.dtype),
            out,
            (ceil_div(num_rows, THREADS),),
            (THREADS,),
            (params,),
        )
    return out


def row_log_probs(statistics, targets, layout, options, lp, den, lp_arcs=None, big_blank_bias=None):
    """Writes the rows' lp and den (float32, log_probs's) from ``statistics`` (3, N) float32 = each row's den,
    z_blank and z_label (hopper.statistics_tile), as log_probs_kernel would from the logits (stages.cu's
    row_log_probs_kernel); with K big blanks (the multi-blank loss), also their lp_arcs (N, K), from statistics
    (3 + K, N) whose last K rows are the logits of the columns blank - K ... blank - 1 less their bias
    ``big_blank_bias`` (K,) float32 (None: no bias)."""
    num_rows = statistics.size(1)
    if num_rows:
        params = ROW_LOG_PROBS_PARAMS(
            grids=_grids(layout),
            labels=_labels_struct(targets, options.blank),
            num_rows=num_rows,
            big_blanks=len(options.big_blank_durations),
            statistics=statistics,
            ld_statistics=statistics.stride(0),
            big_blank_bias=big_blank_bias,
            terms=_terms(options),
            lp=lp,
            den=den,
            lp_arcs=lp_arcs,
        )
        launch(
            _STAGES,
            _name("row_log_probs_kernel", targets.dtype),
            lp,
            (ceil_div(num_rows, THREADS),),
            (THREADS,),
            (params,),
        )


def row_coefficients(targets, lattice, scale, options, row_start, num_rows):
    """((5 + K, num_rows) float32, (num_rows,) int32): the coefficients of the logits' gradient (den, occupancy,
    blank arc, label arc, scale: hopper.logits_gradient's; then the arcs of the K big blanks' columns blank - K ...
    blank - 1, for hopper.gradient_tile's extra columns) and the label of each row of [row_start, row_start +
    num_rows), from a float32 lattice and the incoming scale (B,) (stages.cu's row_coefficients_kernel:
    gradient_kernel's per-row terms)."""
    K = len(options.big_blank_durations)
    coefficients = torch.empty(5 + K, num_rows, dtype=torch.float32, device=targets.device)
    labels = torch.empty(num_rows, dtype=torch.int32, device=targets.device)
    if num_rows:
        scale = scale.to(torch.float32)
        params = ROW_COEFFICIENTS_PARAMS(
            grids=_grids(lattice.layout),
            labels=_labels_struct(targets, options.blank),
            lattice=_lattice_struct(lattice),
            scale=SCALE(values=scale, stride=scale.stride(0)),
            terms=_terms(options),
            lp_arcs=lattice.lp_arcs,
            big_blank_durations=_durations(tuple(options.big_blank_durations)),
            row_start=row_start,
            num_rows=num_rows,
            coefficients=coefficients,
            labels_out=labels,
        )
        launch(
            _STAGES,
            _name("row_coefficients_kernel", targets.dtype, bool(options.one_sym_per_frame)),
            labels,
            (ceil_div(num_rows, THREADS),),
            (THREADS,),
            (params,),
        )
    return coefficients, labels


def tdt_row_log_probs(statistics, duration_bias, targets, layout, options, out):
    """Writes the rows' TDT log-probs ``out`` = (lp, den, lp_arcs, den_arcs) (float32, tdt_log_probs's) from
    ``statistics`` (3 + D, N) float32 = each row's den, z_blank, z_label and D duration scores without their bias
    (hopper.statistics_tile over a projection whose extra columns are the durations') and ``duration_bias`` (D,)
    float32 or None (tdt.cu's tdt_row_log_probs_kernel)."""
    lp, den, lp_arcs, den_arcs = out
    num_rows = statistics.size(1)
    if num_rows:
        params = TDT_ROW_LOG_PROBS_PARAMS(
            grids=_grids(layout),
            labels=_labels_struct(targets, options.blank),
            num_rows=num_rows,
            D=len(options.durations),
            statistics=statistics,
            ld_statistics=statistics.stride(0),
            duration_bias=duration_bias,
            terms=_terms(options),
            lp=lp,
            lp_arcs=lp_arcs,
            den=den,
            den_arcs=den_arcs,
        )
        launch(
            _TDT,
            _name("tdt_row_log_probs_kernel", targets.dtype),
            lp,
            (ceil_div(num_rows, THREADS),),
            (THREADS,),
            (params,),
        )


def tdt_row_coefficients(targets, lattice, scale, options, row_start, num_rows, dtype):
    """((5, num_rows) float32, (num_rows,) int32, (num_rows, D) of ``dtype``): the coefficients of the token scores'
    gradient (as row_coefficients'), the label and the duration scores' gradient in the GEMMs' dtype of each row of
    [row_start, row_start + num_rows), from a float32 TDT lattice and the incoming scale (B,) (tdt.cu's
    tdt_row_coefficients_kernel: tdt_gradient_kernel's per-row terms)."""
    D = len(options.durations)
    coefficients = torch.empty(5, num_rows, dtype=torch.float32, device=targets.device)
    labels = torch.empty(num_rows, dtype=torch.int32, device=targets.device)
    duration_gradient = torch.empty(num_rows, D, dtype=dtype, device=targets.device)
    if num_rows:
        omega = options.omega
        if omega and lattice.rnnt is None:
            raise ValueError(
                "transducer.cuda.stages.tdt_row_coefficients: omega > 0 needs the RNN-T walks (lattice.rnnt)"
            )
        rnnt = lattice.rnnt if omega else Walks(lattice.alpha, lattice.beta, lattice.nll)
        scale = scale.to(torch.float32)
        params = TDT_ROW_COEFFICIENTS_PARAMS(
            grids=_grids(lattice.layout),
            labels=_labels_struct(targets, options.blank),
            durations=_durations(tuple(options.durations)),
            lattice=_lattice_struct(lattice),
            lp_arcs=lattice.lp_arcs,
            rnnt=_walks_struct(rnnt),
            scale=SCALE(values=scale, stride=scale.stride(0)),
            terms=_terms(options),
            row_start=row_start,
            num_rows=num_rows,
            coefficients=coefficients,
            labels_out=labels,
            duration_gradient=duration_gradient,
        )
        launch(
            _TDT,
            _name("tdt_row_coefficients_kernel", dtype, targets.dtype, bool(omega)),
            labels,
            (ceil_div(num_rows, THREADS),),
            (THREADS,),
            (params,),
        )
    return coefficients, labels, duration_gradient


# --------------------------------------------------------------------------- pack


def _pack_vector_of(length, reads, writes=()):
    """Elements per access of a pack pass over rows of ``length`` elements of tensors of different dtypes, each
    given as (dtype, base address modulo 16): 16 bytes of the narrowest tensor (8 elements beside 16-bit rows: 32
    bytes of fp32 ones, two accesses), at most 32 bytes of any, the length and every tensor's base allowing
    (16-byte aligned at most)."""
    items = [(dtype.itemsize, offset) for dtype, offset in (*reads, *writes)]
    vec = min(16 // min(size for size, _ in items), 32 // max(size for size, _ in items))
    while vec > 1 and (length % vec or any(offset % min(vec * size, 16) for size, offset in items)):
        vec //= 2
    return vec


_NO_DROPOUT = DROPOUT(seed_lo=0, seed_hi=0, threshold=0, scale=1.0)


def _dropout_struct(dropout):
    """pack.cu's Dropout of a joiner.Dropout (or None: none)."""
    if dropout is None or not dropout.p:
        return _NO_DROPOUT
    return DROPOUT(
        seed_lo=dropout.seed & 0xFFFFFFFF,
        seed_hi=(dropout.seed >> 32) & 0xFFFFFFFF,
        threshold=dropout.threshold,
        scale=1.0 / (1.0 - dropout.p),
    )


def _check_pack_out(out, num_rows, D, device):
    """pack_forward's ``out``: at least (num_rows, D), floating point, on ``device``, of unit column stride."""
    if (
        out.dim() != 2
        or out.size(0) < num_rows
        or out.size(1) < D
        or not out.is_floating_point()
        or out.device != device
        or (out.size(1) > 1 and out.stride(1) != 1)
    ):
        raise ValueError(
            f"pack_forward: out must be a floating-point tensor of at least ({num_rows}, {D}) on {device} with "
            f"unit column stride, got {tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}"
        )


def pack_forward(
    encoder_out, predictor_out, layout, num_rows, row_start=0, activation="identity", out=None, dropout=None
):
    _check_cuda(encoder_out, predictor_out)
    encoder_out, predictor_out = encoder_out.contiguous(), predictor_out.contiguous()
    B, max_t, D = encoder_out.shape
    max_u1 = predictor_out.size(1)
    promoted = torch.promote_types(encoder_out.dtype, predictor_out.dtype)
    num_rows = int(num_rows)
    if out is None:
        out = torch.empty((num_rows, D), dtype=promoted, device=encoder_out.device)
    else:
        _check_pack_out(out, num_rows, D, encoder_out.device)
    out_rows, ones = out.shape
    ones -= D
    if out_rows == 0 or (D == 0 and ones == 0):
        return out
    drop = _dropout_struct(dropout)
    ld_out = out.stride(0)
    vec, name = _pack_forward_kernel(
        D,
        ld_out,
        (encoder_out.dtype, encoder_out.data_ptr() % 16),
        (predictor_out.dtype, predictor_out.data_ptr() % 16),
        (out.dtype, out.data_ptr() % 16),
        ACTIVATIONS[activation].code,
        drop is not _NO_DROPOUT,
    )
    warps = ceil_div(out_rows, PACK_ROWS)  # a warp writes PACK_ROWS rows
    params = PACK_FORWARD_PARAMS(
        enc=encoder_out,
        pred=predictor_out,
        max_t=max_t,
        max_u1=max_u1,
        grids=_grids(layout, padded_grid=False),
        row_start=row_start,
        num_rows=num_rows,
        out_rows=out_rows,
        nvec=D // vec,
        ones=ones,
        dropout=drop,
        out=out,
        ld_out=ld_out,
    )
    launch(_PACK, name, out, (ceil_div(warps, THREADS // 32),), (THREADS,), (params,))
    return out


@functools.lru_cache(maxsize=256)
def _pack_forward_kernel(D, ld_out, enc, pred, out, act, dropout):
    """(vector width, pack_forward_kernel's instantiation) for rows of D entries written ld_out apart, the encoder's,
    the predictor's and the output's (dtype, base address modulo 16), the activation's code and dropout or not:
    worked out once per combination (a pass's tiles share one)."""
    vec = _pack_vector_of(math.gcd(D, ld_out), [enc, pred], [out]) if D else 1
    promoted = torch.promote_types(enc[0], pred[0])
    return vec, _name("pack_forward_kernel", enc[0], pred[0], promoted, out[0], vec, act, dropout)


def _pack_grad(grad_rows, layout, row_start, utterances, grads, inputs=None, activation="identity", dropout=None):
    """The launches of pack_grad_kernel and pack_grad_pred_kernel: grads = (grad_enc, grad_pred) += the sums over u
    and over t of the rows [row_start, row_start + len(grad_rows)) (times the dropout mask and act'(a), a and h
    recomputed from ``inputs`` = (encoder_out, predictor_out)) of `utterances` = (first, end)."""
    D = grad_rows.size(1)
    act = ACTIVATIONS[activation].code
    drop = _dropout_struct(dropout)
    grad_enc, grad_pred = grads
    enc = prd = None
    if act or drop is not _NO_DROPOUT:  # the inputs are read (an activation), or give the hidden's dtype
        enc, prd = inputs if inputs is not None else (None, None)
        if (
            enc is None
            or prd is None
            or enc.shape != grad_enc.shape
            or prd.shape != grad_pred.shape
            or enc.device != grad_rows.device
            or prd.device != grad_rows.device
        ):
            raise ValueError(
                "pack_backward_add: inputs must be (encoder_out, predictor_out) on grad_rows' device, "
                "of the shapes of grad_enc and grad_pred"
            )
        enc, prd = enc.contiguous(), prd.contiguous()
    b0, b1 = utterances
    if b1 <= b0:
        return
    tensors = (grad_rows, enc, prd, grad_enc, grad_pred)
    plan = _pack_grad_plan(
        layout.batch_size,
        grad_enc.size(1),
        grad_pred.size(1),
        D,
        PACK_U_CHUNK,
        act,
        drop is not _NO_DROPOUT,
        tuple(None if x is None else x.dtype for x in tensors),
        tuple(None if x is None else x.data_ptr() % 16 for x in tensors),
    )
    rows = grad_rows.size(0)
    # the scratch: per frame block that meets the rows, min(U_b + 1, max_u1) rows of D sums, placed as pack.cu's
    # scratch_row places them: at most this many rows
    scratch = grad_rows.new_empty(
        ceil_div(rows, PACK_FRAMES) + (b1 - b0) * plan.scratch_rows_per_utterance, D, dtype=plan.sum_dtype
    )
    enc_scratch = None
    if plan.u_chunks > 1:  # chunks of u (pack.cu's grid_chunks) and their sums over u: as pack.cu's enc_scratch_row
        enc_rows = 2 * rows // plan.u_chunk + 1 + (b1 - b0) * (16 * plan.u_chunks + 1)
        enc_scratch = grad_rows.new_empty(enc_rows, D, dtype=plan.sum_dtype)
    params = PACK_GRAD_PARAMS(
        grad_rows=grad_rows,
        enc=enc,
        pred=prd,
        max_t=grad_enc.size(1),
        max_u1=grad_pred.size(1),
        grids=_grids(layout, padded_grid=False),
        b0=b0,
        frame_blocks=plan.frame_blocks,
        u_chunk=plan.u_chunk,
        pred_blocks=plan.pred_blocks,
        enc_blocks=plan.enc_blocks,
        row_start=row_start,
        row_end=row_start + rows,
        nvec=plan.nvec,
        dropout=drop,
        scratch=scratch,
        enc_scratch=enc_scratch,
        grad_enc=grad_enc,
        grad_pred=grad_pred,
    )
    utterances = b1 - b0
    kernels = [(plan.names[0], (utterances * plan.sum_blocks, plan.chunks, plan.u_chunks), (PACK_SUM_THREADS,), 0)]
    if plan.u_chunks > 1:
        kernels.append((plan.names[1], (utterances * plan.enc_blocks,), (THREADS,), 0))
    if plan.sums_over_t:
        kernels.append((plan.names[2], (utterances * plan.pred_blocks,), (THREADS,), 0))
    launch_each(_PACK, kernels, grad_enc, (params,))


class _PackGradPlan(NamedTuple):
    """What pack's backward launches of a shape, dtypes and alignment (_pack_grad_plan)."""

    names: tuple  # pack_grad_kernel's, pack_grad_enc_kernel's and pack_grad_pred_kernel's instantiations
    nvec: int
    chunks: int
    sum_blocks: int  # pack_grad_kernel's blocks an utterance
    frame_blocks: int
    u_chunk: int
    u_chunks: int
    enc_blocks: int
    pred_blocks: int
    sums_over_t: bool  # pack_grad_pred_kernel runs: there are label positions
    scratch_rows_per_utterance: int
    sum_dtype: torch.dtype


@functools.lru_cache(maxsize=256)
def _pack_grad_plan(B, max_t, max_u1, D, u_chunk, act, dropout, dtypes, alignments):
    """_pack_grad's launches for B utterances of max_t frames and max_u1 label positions, rows of D entries, chunks of
    u of u_chunk values (PACK_U_CHUNK; 0: none), the activation's code, dropout or not, and the dtypes and the base
    addresses modulo 16 of (grad_rows, enc, pred, grad_enc, grad_pred) (None for inputs not read): worked out once
    per combination (a pass's tiles share one)."""
    grad_t, enc_t, pred_t, grad_enc_t, grad_pred_t = dtypes
    reads = [(grad_t, alignments[0])]
    if enc_t is not None:  # the inputs are read: their types give the hidden's
        promoted = torch.promote_types(enc_t, pred_t)
        reads += [(enc_t, alignments[1]), (pred_t, alignments[2])]
    else:
        promoted, enc_t, pred_t = grad_t, grad_t, grad_t
    vec = _pack_vector_of(D, reads, [(grad_enc_t, alignments[3]), (grad_pred_t, alignments[4])])
    nvec = D // vec
    chunks = ceil_div(nvec, PACK_LANES)
    if B * max(max_t, max_u1) >= 1 << 31 or chunks > 65535:
        raise ValueError("pack_backward: B * max_t and B * max_u1 must stay below 2^31, and D below 2^22 elements")
    warps = PACK_SUM_THREADS // 32  # a warp per frame block, a block per warps consecutive ones
    frame_blocks = ceil_div(ceil_div(max(max_t, 1), PACK_FRAMES), warps) * warps
    u_chunk = u_chunk if 0 < u_chunk < max_u1 else 0
    u_chunks = ceil_div(max_u1, u_chunk) if u_chunk else 1
    enc_blocks = ceil_div(ceil_div(max(max_t, 1), PACK_FRAMES) * PACK_FRAMES * nvec, THREADS) if u_chunks > 1 else 1
    pred_blocks = ceil_div(max(max_u1, 1) * nvec * PACK_PRED_PARTS, THREADS)
    types = (grad_t, enc_t, pred_t, promoted, grad_enc_t, vec)
    names = (
        _name("pack_grad_kernel", *types, act, dropout),
        _name("pack_grad_enc_kernel", *types),
        _name("pack_grad_pred_kernel", *types),
    )
    return _PackGradPlan(
        names,
        nvec,
        chunks,
        frame_blocks // warps,
        frame_blocks,
        u_chunk,
        u_chunks,
        enc_blocks,
        pred_blocks,
        max_u1 > 0,
        2 * max_u1 + 1,
        accumulate_dtype(promoted),
    )


def pack_backward(grad_rows, layout, max_t, max_u1):
    _check_cuda(grad_rows)
    grad_rows = grad_rows.contiguous()
    B, D = layout.batch_size, grad_rows.size(1)
    grad_enc = torch.zeros(B, int(max_t), D, dtype=grad_rows.dtype, device=grad_rows.device)
    grad_pred = torch.zeros(B, int(max_u1), D, dtype=grad_rows.dtype, device=grad_rows.device)
    if D > 0 and B > 0 and grad_rows.size(0) > 0:
        _pack_grad(grad_rows, layout, 0, (0, B), (grad_enc, grad_pred))
    return grad_enc, grad_pred


def pack_backward_add(
    grad_rows, layout, row_start, utterances, grads, inputs=None, activation="identity", dropout=None
):
    _check_cuda(grad_rows)
    if grad_rows.size(1) > 0 and grad_rows.size(0) > 0:
        _pack_grad(grad_rows.contiguous(), layout, row_start, utterances, grads, inputs, activation, dropout)
    return grads


# --------------------------------------------------------------------------- TDT stages


@functools.lru_cache(maxsize=64)
def _durations(durations):
    """tdt.cu's struct Durations of a tuple of durations (made once per tuple)."""
    if len(durations) > MAX_DURATIONS:
        raise ValueError(f"durations: at most {MAX_DURATIONS} on CUDA, got {len(durations)}")
    return DURATIONS(n=len(durations), d=tuple(durations) + (0,) * (MAX_DURATIONS - len(durations)))


def tdt_log_probs(tokens2d, duration_scores, targets, layout, options, row_start=0, out=None):
    _row_major("tokens2d", tokens2d)
    _row_major("duration_scores", duration_scores)
    if row_start and out is None:
        raise ValueError("tdt_log_probs: row_start > 0 needs out (the arrays of every row)")
    num_rows, V = tokens2d.shape
    D = duration_scores.size(1)
    acc = accumulate_dtype(tokens2d.dtype)
    if out is None:
        new = lambda *shape: torch.empty(shape, dtype=acc, device=tokens2d.device)  # noqa: E731
        out = (new(num_rows, 2), new(num_rows), new(num_rows, D), new(num_rows))
    lp, den, lp_arcs, den_arcs = out
    if num_rows == 0:
        return out
    itemsize = tokens2d.element_size()
    vec, aligned, _ = row_access(itemsize, V, tokens2d)
    tpr = threads_per_row(num_rows, V * itemsize, tokens2d.device)  # a warp at least: tdt.cu's durations' lanes
    rows_per_block = THREADS // tpr
    # vectors in flight (DESIGN.md: Eight vectors in flight where a row is loaded before its cell test)
    deep = 4 if layout.padded else 8
    params = TDT_LOG_PROBS_PARAMS(
        grids=_grids(layout),
        tokens=_rows_struct(tokens2d, row_start, vec, aligned),
        duration_scores=DURATION_ROWS(data=duration_scores, ld=duration_scores.stride(0), D=D),
        labels=_labels_struct(targets, options.blank),
        terms=_terms(options),
        lp=lp,
        lp_arcs=lp_arcs,
        den=den,
        den_arcs=den_arcs,
    )
    name = _name("tdt_log_probs_kernel", tokens2d.dtype, targets.dtype, vec, tpr, aligned, deep)
    launch(_TDT, name, tokens2d, (ceil_div(num_rows, rows_per_block),), (THREADS,), (params,))
    return out


def tdt_alpha_beta(lp, lp_arcs, layout, options):
    return _duration_walks(lp, lp_arcs, layout, options.durations, False)


def multiblank_alpha_beta(lp, lp_arcs, layout, options):
    # TDT's walk with blank arcs of durations 1, d_1, ..., d_K and a label arc of duration 0 (tdt.cu:
    # TdtWalkParams)
    return _duration_walks(lp, lp_arcs, layout, (0, 1) + tuple(options.big_blank_durations), True)


def _duration_walks(lp, lp_arcs, layout, durations, multiblank):
    walks, threads = _walk(lp, layout)
    B = layout.batch_size
    if B == 0:
        return walks
    max_u1 = max(int(layout.max_u1), 1)
    D, itemsize = len(durations), lp.element_size()
    ring = max(durations) + 2  # the anti-diagonals an arc reaches back (or ahead): kept in shared memory
    params = TDT_WALK_PARAMS(
        grids=_grids(layout, padded_grid=False),
        lp=lp,
        lp_arcs=lp_arcs,
        durations=_durations(tuple(durations)),
        padded=layout.padded,
        ring=0,
        cols=0,
        out=_walks_struct(walks),
    )
    # tdt_walk_kernel: rings of a power of two steps, a column per thread and two of -inf; alpha's ring
    # (2D + 1 entries a cell) is the larger; over 48 KiB where the GPU allows
    walk_ring, walk_cap = 1 << (ring - 1).bit_length(), threads + 2
    walk_smem = walk_ring * walk_cap * (2 * D + 1) * itemsize
    if D <= WALK_MAX_DURATIONS and max_u1 <= WALK_MAX_THREADS and walk_smem <= max_shared_mem(lp):
        launch(
            _TDT,
            _name("tdt_walk_kernel", lp.dtype, D, _WALK_AHEAD, multiblank),
            lp,
            (2 * B,),
            (threads,),
            (params._replace(ring=walk_ring, cols=walk_cap),),
            shared_mem=walk_smem,
        )
        return walks
    smem = ring * max_u1 * itemsize
    if smem > DEFAULT_SHARED_MEM:
        ring, smem = 0, 0
    launch(
        _TDT,
        _name("tdt_alpha_beta_kernel", lp.dtype, multiblank),
        lp,
        (2 * B,),
        (threads,),
        (params._replace(ring=ring, cols=max_u1),),
        shared_mem=smem,
    )
    return walks


def tdt_gradient(tokens2d, duration_scores, targets, lattice, scale, options, out, row_start=0):
    out_tokens, out_duration_scores = out
    for name, x in (
        ("tokens2d", tokens2d),
        ("duration_scores", duration_scores),
        ("out_tokens", out_tokens),
        ("out_duration_scores", out_duration_scores),
    ):
        _row_major(name, x)
    num_rows, V = tokens2d.shape
    if num_rows == 0:
        return
    omega = options.omega
    if omega and lattice.rnnt is None:
        raise ValueError("transducer.cuda.stages.tdt_gradient: omega > 0 needs the RNN-T walks (lattice.rnnt)")
    rnnt = lattice.rnnt if omega else Walks(lattice.alpha, lattice.beta, lattice.nll)
    scale = scale.to(lattice.lp.dtype)
    itemsize = tokens2d.element_size()
    tpr = threads_per_row(num_rows, V * itemsize, tokens2d.device)  # a warp at least: tdt.cu's durations' lanes
    rows_per_block = THREADS // tpr
    vec, aligned, staged = row_access(itemsize, V, tokens2d, [out_tokens], rows_per_block)
    terms = _terms(options)
    params = TDT_GRADIENT_PARAMS(
        grids=_grids(lattice.layout),
        tokens=_rows_struct(tokens2d, row_start, vec, aligned),
        duration_scores=DURATION_ROWS(data=duration_scores, ld=duration_scores.stride(0), D=duration_scores.size(1)),
        durations=_durations(tuple(options.durations)),
        labels=_labels_struct(targets, options.blank),
        lattice=_lattice_struct(lattice),
        lp_arcs=lattice.lp_arcs,
        den_arcs=lattice.den_arcs,
        rnnt=_walks_struct(rnnt),
        scale=SCALE(values=scale, stride=scale.stride(0)),
        terms=terms,
        out_tokens=out_tokens,
        ld_out_tokens=out_tokens.stride(0),
        out_duration_scores=out_duration_scores,
        ld_out_duration_scores=out_duration_scores.stride(0),
    )
    name = _name(
        "tdt_gradient_kernel", tokens2d.dtype, targets.dtype, vec, tpr, bool(omega), terms.clamp > 0, aligned, staged
    )
    launch(
        _TDT,
        name,
        tokens2d,
        (ceil_div(num_rows, rows_per_block),),
        (THREADS,),
        (params,),
        shared_mem=_stage_bytes(rows_per_block, V, itemsize) if staged else 0,
    )
