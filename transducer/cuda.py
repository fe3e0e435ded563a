"""The CUDA stages of the transducer loss (contract: transducer/layout.py), and the packing op.

Same functions, arguments and results as ``transducer.cpu``. The kernels (``stages.cu``, ``pack.cu``,
listed at the top of each) are launched through ``ops.cuda.launch``: torch's current stream,
torch-allocated outputs, no host synchronisation, so a training step stays capturable in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import torch

from ops import FAST_DIVMOD_DTYPE, FastDivmod, accumulate_dtype, ctype
from ops.cuda import DEFAULT_SHARED_MEM, ceil_div, i32, i64, launch, max_shared_mem, num_sms, vector_width

from .layout import NUM_STATS, Layout

_STAGES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stages.cu")
_PACK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pack.cu")
_THREADS = 256  # block size of the per-row kernels (stages.cu: kThreads)
# RowOut<..., true>'s rows a block: room left within DEFAULT_SHARED_MEM for the kernels' static shared memory
_STAGE_LIMIT = 32 * 1024
_WIDE_ROW_BYTES = 4096  # gradient_row_width: rows up to this size are padded (8 a block stage within the limit)


@functools.lru_cache(maxsize=1024, typed=True)  # typed: True and 1 are different template arguments
def _name(kernel, *params):
    """The instantiation ``kernel<params>``: torch dtypes by their C names, bools as true / false, the rest as
    written (made once per combination: a step launches several kernels)."""
    c = [ctype(p) if isinstance(p, torch.dtype) else ("true" if p else "false") if isinstance(p, (bool, np.bool_))
         else str(p) for p in params]
    return f"{kernel}<{', '.join(c)}>"


@functools.lru_cache(maxsize=256)
def _acc(dtype, x):
    """A kernel argument of the accumulation type (float, or double for float64); made once per value."""
    return np.float64(x) if dtype == torch.float64 else np.float32(x)


def _warps_per_row(num_rows, row_bytes, device):
    """1 (a warp per row, 8 rows per block) or 8 (a 256-thread block per row).

    A warp per row keeps 64 rows in flight per SM with four 16-byte loads per
    lane, which saturates HBM for every row length seen in training; a block
    per row is for rows too long for one warp (over 16 KiB) or too few rows to
    fill the GPU with warps."""
    if row_bytes > 16384:
        return 8
    if row_bytes >= 4096 and num_rows < 64 * num_sms(device):
        return 8
    return 1


def _check_cuda(*tensors):
    for t in tensors:
        if not t.is_cuda:
            raise ValueError("transducer.cuda: every tensor must be on a CUDA device")


def _row_major(name, x):
    if x.dim() != 2 or (x.size(1) > 1 and x.stride(1) != 1):
        raise ValueError(f"transducer.cuda: {name} must be 2-D with unit column stride, got strides {x.stride()}")


def _row_access(itemsize, V, rows, outs=(), stage_rows=0):
    """(vec, aligned, staged) of a row pass over the V columns of the row-major 2-D ``rows`` (read) and
    ``outs`` (written at the same columns): whole 16-byte vectors when every row starts on a 16-byte
    boundary; else, when every output row sits at its input row's offset from one (same base offset and row
    strides modulo 16 bytes), 16-byte vectors between a scalar head and tail per row (common.cuh's
    RowPass<..., false>: NeMo's 1029-wide TDT rows, the 500 token columns of the fused joiner's 512-wide
    tiles); else the widest width that every row allows, or, for a gradient kernel (``stage_rows``: its rows
    a block) writing one output whose rows start on 16-byte boundaries, when that width is under 8 bytes and
    the block's rows fit in shared memory, the unaligned pass with the output assembled there (staged:
    common.cuh's RowOut; a 505-wide joint's gradient in 512-wide rows)."""
    tensors = [rows, *outs]
    full = 16 // itemsize
    vec = vector_width(itemsize, math.gcd(V, *(t.stride(0) for t in tensors)), tensors)
    if vec == full:
        return vec, True, False
    if all((o.data_ptr() - rows.data_ptr()) % 16 == 0 and (o.stride(0) - rows.stride(0)) * itemsize % 16 == 0
           for o in outs):
        return full, False, False
    if (stage_rows and len(outs) == 1 and vec * itemsize < 8 and vector_width(itemsize, outs[0].stride(0), outs) == full
            and _stage_bytes(stage_rows, V, itemsize) <= _STAGE_LIMIT):
        return full, False, True
    return vec, True, False


def _stage_bytes(stage_rows, V, itemsize):
    """Shared memory of RowOut<..., true>: a block's rows, V columns rounded up to 16 bytes."""
    return stage_rows * ceil_div(V * itemsize, 16) * 16


def gradient_row_width(V, itemsize):
    """The row width (elements) of a new gradient of V-wide logits that an op made (library.gradient_buffer):
    16-bit rows that are not a multiple of 16 bytes, up to 4 KiB, are padded to one. cuBLAS reads such a
    gradient with 16-byte loads in the joint Linear's backward (the weight gradient of a 505-wide bf16
    joint: 2.32 -> 0.69 ms a Protocol A batch, H100, benchmarks/RESULTS.md section 8), and the gradient
    kernels still write whole vectors: 8-byte ones when they fit both row widths, else through shared
    memory (RowOut<..., true>, 8 rows a block within _STAGE_LIMIT). V otherwise: fp32 steps gained nothing
    measurable, and longer rows would fall back to narrow accesses."""
    row = V * itemsize
    if itemsize != 2 or row % 16 == 0 or row > _WIDE_ROW_BYTES:
        return V
    return ceil_div(row, 16) * 16 // itemsize


def _table(layout):
    """The layout's table and batch size: every kernel finds T_b, U_b, strides and row_splits in it."""
    return layout.table, i32(layout.batch_size)


# common.cuh's struct PaddedGrid: two FastDivmods (utt.d == 0 for the compact layout)
_PADDED_GRID_DTYPE = np.dtype([("utt", FAST_DIVMOD_DTYPE), ("frame", FAST_DIVMOD_DTYPE)], align=True)
_COMPACT_GRID = np.zeros((), dtype=_PADDED_GRID_DTYPE)[()]


def _padded_grid(layout):
    """The row kernels' PaddedGrid (common.cuh): in the padded layout, rows per utterance (maxT * (maxU + 1))
    and per frame (maxU + 1), which divide any row of the layout (tiles too); zeros (the search over
    row_splits, right for both layouts) for the compact layout or a padded one whose maxT is not known."""
    if not layout.padded or layout.padded_t <= 0:
        return _COMPACT_GRID
    return _padded_grid_struct(layout.padded_t * layout.max_u1, layout.max_u1)


@functools.lru_cache(maxsize=256)
def _padded_grid_struct(rows_per_utterance, max_u1):
    grid = np.array((FastDivmod(rows_per_utterance).as_struct(), FastDivmod(max_u1).as_struct()),
                    dtype=_PADDED_GRID_DTYPE)
    grid.flags.writeable = False  # shared by every launch of this shape
    return grid[()]


# --------------------------------------------------------------------------- stages


def layout(logit_lengths, target_lengths, max_u1, padded_t=0, targets=None, vocab_size=0, blank=0,
           with_stats=True):
    _check_cuda(logit_lengths, target_lengths)
    B = logit_lengths.numel()
    table = torch.empty(4 * B + 1 + NUM_STATS, dtype=torch.int64, device=logit_lengths.device)
    if targets is None:
        targets_ptr, target_cols, itype = 0, 0, "int"
    else:
        targets_ptr, target_cols, itype = targets.contiguous(), targets.size(1), targets.dtype
    name = _name("layout_kernel", logit_lengths.dtype, target_lengths.dtype, itype, bool(with_stats))
    launch(_STAGES, name, table, (1,), (1024,),
           (logit_lengths.contiguous(), target_lengths.contiguous(), targets_ptr,
            i32(target_cols), i32(B), i32(padded_t), i32(max_u1), i32(vocab_size), i32(blank),
            table))
    return Layout(table, padded_t > 0, int(max_u1), max(int(padded_t), 0))


def log_probs(logits2d, targets, layout, blank, from_log_softmax, delay_penalty=0.0, row_start=0, out=None):
    if row_start and out is None:
        raise ValueError("log_probs: row_start > 0 needs out (the arrays of every row)")
    num_rows, V = logits2d.shape
    acc = accumulate_dtype(logits2d.dtype)
    if out is None:
        lp = torch.empty(num_rows, 2, dtype=acc, device=logits2d.device)
        den = torch.empty(num_rows, dtype=acc, device=logits2d.device)
    else:
        lp, den = out
    if num_rows == 0:
        return lp, den
    _row_major("logits2d", logits2d)
    itemsize, ld = logits2d.element_size(), logits2d.stride(0)
    vec, aligned, _ = _row_access(itemsize, V, logits2d)
    wpr = _warps_per_row(num_rows, V * itemsize, logits2d.device)
    rows_per_block = _THREADS // (32 * wpr)
    name = _name("log_probs_kernel", logits2d.dtype, targets.dtype, vec, wpr, aligned)
    launch(_STAGES, name, logits2d, ((num_rows + rows_per_block - 1) // rows_per_block,), (_THREADS,),
           (logits2d, targets, i32(targets.size(1)), *_table(layout), i32(row_start), i32(num_rows), i32(V), i32(ld),
            i32(V // vec if aligned else V), i32(blank), _padded_grid(layout),
            i32(from_log_softmax), _acc(acc, delay_penalty), lp, den))
    return lp, den


def _alpha_beta_smem_entries(max_u1, itemsize):
    """Entries per shared-memory buffer (two buffers), or 0 to keep the previous step in global memory."""
    return max_u1 if 2 * max_u1 * itemsize <= DEFAULT_SHARED_MEM else 0


def _walk(lp, layout):
    """alpha, beta, loss outputs, and the block size (a thread per u) of a walk over anti-diagonals."""
    new = lambda n: torch.empty(n, dtype=lp.dtype, device=lp.device)  # noqa: E731
    max_u1 = max(int(layout.max_u1), 1)
    return new(lp.size(0)), new(lp.size(0)), new(layout.batch_size), max_u1, min(1024, (max_u1 + 31) // 32 * 32)


def alpha_beta(lp, layout, one_sym_per_frame):
    B = layout.batch_size
    alpha, beta, loss, max_u1, threads = _walk(lp, layout)
    if B == 0:
        return alpha, beta, loss
    cap = _alpha_beta_smem_entries(max_u1, lp.element_size())
    name = _name("alpha_beta_kernel", lp.dtype, bool(one_sym_per_frame))
    launch(_STAGES, name, lp, (2 * B,), (threads,),
           (lp, *_table(layout), i32(layout.padded), i32(cap), alpha, beta,
            loss),
           shared_mem=2 * cap * lp.element_size())
    return alpha, beta, loss


def gradient(logits2d, targets, layout, lp, den, alpha, beta, loss, scale, blank,
             from_log_softmax, one_sym_per_frame, out, fastemit_lambda=0.0, clamp=0.0, row_start=0):
    num_rows, V = logits2d.shape
    if num_rows == 0:
        return out
    _row_major("logits2d", logits2d)
    if out.shape != logits2d.shape or out.dtype != logits2d.dtype:
        raise ValueError("transducer.cuda.gradient: out must have the logits' shape and dtype")
    _row_major("out", out)
    scale = scale.to(lp.dtype)
    itemsize = logits2d.element_size()
    # The gradient w.r.t. log-probs does not read them: with from_log_softmax the row pass is laid on
    # `out` alone, so the logits' alignment does not narrow its vectors.
    rows = out if from_log_softmax else logits2d
    wpr = _warps_per_row(num_rows, V * itemsize, logits2d.device)
    rows_per_block = _THREADS // (32 * wpr)
    vec, aligned, staged = _row_access(itemsize, V, rows, [out], rows_per_block)
    name = _name("gradient_kernel", logits2d.dtype, targets.dtype, vec, wpr, bool(from_log_softmax),
                 bool(one_sym_per_frame), clamp > 0, aligned, staged)
    launch(_STAGES, name, logits2d, ((num_rows + rows_per_block - 1) // rows_per_block,), (_THREADS,),
           (rows, targets, i32(targets.size(1)), *_table(layout), i32(row_start), i32(num_rows), i32(V),
            i32(rows.stride(0)), i32(V // vec if aligned else V), i64(out.stride(0)), i32(blank),
            _padded_grid(layout),
            lp, den, alpha, beta, loss, scale, i64(scale.stride(0)), _acc(lp.dtype, fastemit_lambda),
            _acc(lp.dtype, max(clamp, 0.0)), out),
           shared_mem=_stage_bytes(rows_per_block, V, itemsize) if staged else 0)
    return out


def _threads_per_item(nvec):
    """Power of two in [32, 256] covering a row's nvec vectors (fewer loop trips, whole warps)."""
    tpr = 32
    while tpr < nvec and tpr < 256:
        tpr *= 2
    return tpr


_ACTIVATIONS = {"identity": 0, "tanh": 1, "relu": 2}  # pack.cu: td::Activation
_PACK_ROWS = 4  # pack.cu: kPackRows


def _pack_out(encoder_out, num_rows, out):
    """pack_forward's output: ``out`` (checked: (num_rows, D), the inputs' dtype, rows with unit column stride,
    a wider matrix's first D columns for example), or a new (num_rows, D) tensor."""
    shape = (int(num_rows), encoder_out.size(2))
    if out is None:
        return torch.empty(shape, dtype=encoder_out.dtype, device=encoder_out.device)
    if out.shape != shape or out.dtype != encoder_out.dtype or out.device != encoder_out.device or (
            shape[1] > 1 and out.stride(1) != 1):
        raise ValueError(f"pack_forward: out must be a {shape} {encoder_out.dtype} tensor on {encoder_out.device} "
                         f"with unit column stride, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    return out


def pack_forward(encoder_out, predictor_out, layout, num_rows, row_start=0, activation="identity", out=None):
    """Compact joiner input: out[r - row_start] = act(encoder_out[b, t] + predictor_out[b, u]) for the rows
    r = (b, t, u) in [row_start, row_start + num_rows); written into ``out`` when given (see _pack_out)."""
    _check_cuda(encoder_out, predictor_out)
    if encoder_out.dtype != predictor_out.dtype:
        raise ValueError("pack_forward: encoder_out and predictor_out must have the same dtype")
    encoder_out, predictor_out = encoder_out.contiguous(), predictor_out.contiguous()
    B, max_t, D = encoder_out.shape
    max_u1 = predictor_out.size(1)
    num_rows = int(num_rows)
    out = _pack_out(encoder_out, num_rows, out)
    if num_rows == 0 or D == 0:
        return out
    ld = out.stride(0)
    vec = vector_width(encoder_out.element_size(), math.gcd(D, ld), [encoder_out, predictor_out, out])
    nvec = D // vec
    tpr = _threads_per_item(nvec)
    groups = (num_rows + _PACK_ROWS - 1) // _PACK_ROWS  # a group of tpr threads writes _PACK_ROWS rows
    groups_per_block = _THREADS // tpr
    name = _name("pack_forward_kernel", encoder_out.dtype, vec, _ACTIVATIONS[activation])
    launch(_PACK, name, out, ((groups + groups_per_block - 1) // groups_per_block,), (_THREADS,),
           (encoder_out, predictor_out, *_table(layout), i32(row_start), i32(num_rows), i32(max_t), i32(max_u1),
            i32(nvec), i32(tpr.bit_length() - 1), i64(ld), out))
    return out


def _pack_grad(grad_rows, layout, row_start, utterances, grads, accumulate, inputs=None, activation="identity"):
    """The launches of pack_grad_kernel: for each of grads = (grad_enc, grad_pred), the sums over u and
    over t of the rows [row_start, row_start + len(grad_rows)) (times act'(h), h recomputed from
    ``inputs`` = (encoder_out, predictor_out)), items of `utterances` = (first, end)."""
    D = grad_rows.size(1)
    act = _ACTIVATIONS[activation]
    if act:
        enc, prd = inputs if inputs is not None else (None, None)
        if (enc is None or prd is None or enc.dtype != grad_rows.dtype or prd.dtype != grad_rows.dtype or
                enc.shape != grads[0].shape or prd.shape != grads[1].shape or enc.device != grad_rows.device or
                prd.device != grad_rows.device):
            raise ValueError("pack_backward_add: inputs must be (encoder_out, predictor_out) of grad_rows' dtype and "
                             "device, and the shapes of grad_enc and grad_pred")
        enc, prd = enc.contiguous(), prd.contiguous()
    else:
        enc = prd = 0
    vec = vector_width(grad_rows.element_size(), D, [grad_rows, *grads] + ([enc, prd] if act else []))
    nvec = D // vec
    b0, b1 = utterances
    for grad, pred in zip(grads, (False, True)):
        # an encoder item sums U_b + 1 contiguous rows: a group of threads each; a predictor item sums T_b
        # rows a stride apart, many: a warp-sized group takes one row in 8 and the block's 8 groups meet
        tpr, split = (32, 8) if pred else (_threads_per_item(nvec), 1)
        items_per_block = _THREADS // tpr // split
        per_b = grad.size(1)
        num_items = (b1 - b0) * per_b
        if num_items == 0:
            continue
        if layout.batch_size * per_b >= 1 << 31:
            raise ValueError("pack_backward: B * max_t and B * max_u1 must stay below 2^31")
        name = _name("pack_grad_kernel", grad_rows.dtype, grad.dtype, vec, pred, bool(accumulate), act)
        launch(_PACK, name, grad, ((num_items + items_per_block - 1) // items_per_block,), (_THREADS,),
               (grad_rows, enc, prd, i32(grads[0].size(1)), i32(grads[1].size(1)), *_table(layout),
                FastDivmod(per_b).as_struct(), i32(b0 * per_b), i32(num_items), i32(row_start),
                i32(row_start + grad_rows.size(0)), i32(nvec), i32(tpr.bit_length() - 1),
                i32(split.bit_length() - 1), grad))


def pack_backward(grad_out, layout, max_t, max_u1):
    """(grad_enc (B, max_t, D), grad_pred (B, max_u1, D)): the row sums of grad_out over u and over t."""
    _check_cuda(grad_out)
    grad_out = grad_out.contiguous()
    B, D = layout.batch_size, grad_out.size(1)
    grad_enc = torch.empty(B, int(max_t), D, dtype=grad_out.dtype, device=grad_out.device)
    grad_pred = torch.empty(B, int(max_u1), D, dtype=grad_out.dtype, device=grad_out.device)
    if D > 0 and B > 0:
        _pack_grad(grad_out, layout, 0, (0, B), (grad_enc, grad_pred), False)
    return grad_enc, grad_pred


def pack_backward_add(grad_rows, layout, row_start, utterances, grad_enc, grad_pred, inputs=None,
                      activation="identity"):
    """grad_enc (B, max_t, D) and grad_pred (B, max_u1, D), of the accumulation dtype, += the sums over u
    and over t of grad_rows * act'(h) (h = act(enc + pred) of the same rows, recomputed from ``inputs`` =
    (encoder_out, predictor_out) as pack_forward computes it; grad_rows alone for the identity), rows
    [row_start, row_start + len(grad_rows)), which lie in the utterances [first, end) = `utterances`: the
    backward of act(pack(...)), one tile of rows at a time."""
    _check_cuda(grad_rows)
    if grad_rows.size(1) > 0 and grad_rows.size(0) > 0:
        _pack_grad(grad_rows.contiguous(), layout, row_start, utterances, (grad_enc, grad_pred), True, inputs,
                   activation)
    return grad_enc, grad_pred


# --------------------------------------------------------------------------- TDT (contract: the TDT part of transducer/cpu.py)

_TDT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tdt.cu")
MAX_DURATIONS = 16  # tdt.cu: kMaxDurations
_DURATIONS_DTYPE = np.dtype([("n", "<i4"), ("d", "<i4", (MAX_DURATIONS,))])


def _durations(durations):
    """The durations as tdt.cu's struct Durations (by value; made once per tuple of durations)."""
    return _durations_struct(tuple(durations))


@functools.lru_cache(maxsize=64)
def _durations_struct(durations):
    if len(durations) > MAX_DURATIONS:
        raise ValueError(f"durations: at most {MAX_DURATIONS} on CUDA, got {len(durations)}")
    padded = list(durations) + [0] * (MAX_DURATIONS - len(durations))
    struct = np.array((len(durations), padded), dtype=_DURATIONS_DTYPE)
    struct.flags.writeable = False  # shared by every launch with these durations
    return struct[()]


def tdt_log_probs(tokens2d, durations2d, targets, layout, blank, sigma, row_start=0, out=None):
    _row_major("tokens2d", tokens2d)
    _row_major("durations2d", durations2d)
    if row_start and out is None:
        raise ValueError("tdt_log_probs: row_start > 0 needs out (the arrays of every row)")
    num_rows, V = tokens2d.shape
    D = durations2d.size(1)
    acc = accumulate_dtype(tokens2d.dtype)
    if out is None:
        dev = tokens2d.device
        out = (torch.empty(num_rows, 2, dtype=acc, device=dev), torch.empty(num_rows, D, dtype=acc, device=dev),
               torch.empty(num_rows, 2, dtype=acc, device=dev))
    lp, lp_dur, den = out
    if num_rows == 0:
        return out
    itemsize = tokens2d.element_size()
    ld = tokens2d.stride(0)
    vec, aligned, _ = _row_access(itemsize, V, tokens2d)
    wpr = _warps_per_row(num_rows, V * itemsize, tokens2d.device)
    rows_per_block = _THREADS // (32 * wpr)
    deep = 4 if layout.padded else 8  # vectors in flight (tdt.cu: measured per layout)
    name = _name("tdt_log_probs_kernel", tokens2d.dtype, targets.dtype, vec, wpr, aligned, deep)
    launch(_TDT, name, tokens2d, ((num_rows + rows_per_block - 1) // rows_per_block,), (_THREADS,),
           (tokens2d, durations2d, i64(ld), i64(durations2d.stride(0)), i32(D), targets, i32(targets.size(1)),
            *_table(layout), i32(row_start), i32(num_rows), i32(V), i32(V // vec), i32(blank),
            _padded_grid(layout), _acc(acc, sigma), lp, lp_dur, den))
    return out


_WALK_MAX_DURATIONS = 8  # tdt_walk_kernel: D is a template parameter (its cells' log-probs stay in registers)
_WALK_MAX_THREADS = 512  # its launch bound
_WALK_AHEAD = 2  # steps of log-probs read ahead (figures in benchmarks/RESULTS.md)


def tdt_alpha_beta(lp, lp_dur, layout, durations):
    B = layout.batch_size
    alpha, beta, loss, max_u1, threads = _walk(lp, layout)
    if B == 0:
        return alpha, beta, loss
    D, itemsize = len(durations), lp.element_size()
    ring = max(durations) + 2  # the anti-diagonals an arc reaches back (or ahead): kept in shared memory
    args = (lp, lp_dur, _durations(durations), *_table(layout), i32(layout.padded))
    # tdt_walk_kernel: rings of a power of two steps, a column per thread and two of -inf; alpha's ring
    # (2D + 1 entries a cell) is the larger; over 48 KiB where the GPU allows
    walk_ring, walk_cap = 1 << (ring - 1).bit_length(), threads + 2
    walk_smem = walk_ring * walk_cap * (2 * D + 1) * itemsize
    if D <= _WALK_MAX_DURATIONS and max_u1 <= _WALK_MAX_THREADS and walk_smem <= max_shared_mem(lp):
        launch(_TDT, _name("tdt_walk_kernel", lp.dtype, D, _WALK_AHEAD), lp, (2 * B,),
               (threads,), args + (i32(walk_ring), i32(walk_cap), alpha, beta, loss), shared_mem=walk_smem)
        return alpha, beta, loss
    smem = ring * max_u1 * itemsize
    if smem > DEFAULT_SHARED_MEM:
        ring, smem = 0, 0
    launch(_TDT, _name("tdt_alpha_beta_kernel", lp.dtype), lp, (2 * B,), (threads,),
           args + (i32(ring), i32(max_u1), alpha, beta, loss), shared_mem=smem)
    return alpha, beta, loss


def tdt_gradient(tokens2d, durations2d, targets, layout, lp, lp_dur, den, alpha, beta, loss, scale, blank,
                 durations, out_tokens, out_durations, fastemit_lambda=0.0, omega=0.0, rnnt=None, sigma=0.0,
                 clamp=0.0, row_start=0):
    for name, x in (("tokens2d", tokens2d), ("durations2d", durations2d), ("out_tokens", out_tokens),
                    ("out_durations", out_durations)):
        _row_major(name, x)
    num_rows, V = tokens2d.shape
    if num_rows == 0:
        return
    if omega and rnnt is None:
        raise ValueError("transducer.cuda.tdt_gradient: omega > 0 needs the RNN-T alpha, beta and loss (rnnt)")
    alpha_r, beta_r, loss_r = rnnt if omega else (alpha, beta, loss)
    scale = scale.to(lp.dtype)
    itemsize = tokens2d.element_size()
    wpr = _warps_per_row(num_rows, V * itemsize, tokens2d.device)
    rows_per_block = _THREADS // (32 * wpr)
    vec, aligned, staged = _row_access(itemsize, V, tokens2d, [out_tokens], rows_per_block)
    name = _name("tdt_gradient_kernel", tokens2d.dtype, targets.dtype, vec, wpr, bool(omega), clamp > 0, aligned,
                 staged)
    acc = lp.dtype
    launch(_TDT, name, tokens2d, ((num_rows + rows_per_block - 1) // rows_per_block,), (_THREADS,),
           (tokens2d, durations2d, i64(tokens2d.stride(0)), i64(durations2d.stride(0)), _durations(durations),
            targets, i32(targets.size(1)), *_table(layout), i32(row_start), i32(num_rows), i32(V), i32(V // vec),
            i32(blank), _padded_grid(layout), lp, lp_dur, den, alpha, beta, loss, alpha_r, beta_r,
            loss_r, scale, i64(scale.stride(0)), _acc(acc, sigma), _acc(acc, fastemit_lambda), _acc(acc, omega),
            _acc(acc, max(clamp, 0.0)), out_tokens, out_durations, i64(out_tokens.stride(0)),
            i64(out_durations.stride(0))),
           shared_mem=_stage_bytes(rows_per_block, V, itemsize) if staged else 0)
