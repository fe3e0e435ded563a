"""The CUDA stages of the transducer loss (contract: transducer/layout.py), and the packing op.

Same functions, arguments and results as ``transducer.cpu``. Kernels live in
``stages.cu`` and ``pack.cu`` next to this file and are compiled at run time by
``cupy.RawModule`` (NVRTC, ``-std=c++17 -I<ops dir> -I<this dir>``), one
template instantiation per module, once per process and device. Every launch
goes to torch's current stream, outputs come from torch's allocator, and
nothing here synchronises with the host, so a training step stays capturable
in a CUDA graph.

Kernels per stage:

- ``layout``: one single-block kernel: the Layout table (lengths, strides,
  row_splits by one block-wide scan) and the value-check stats;
- ``log_probs``: one kernel: a warp per row (a 256-thread block per row for very long rows
  or very few rows), 16-byte loads where the row allows, online logsumexp;
- ``alpha_beta``: one kernel of 2B blocks (alpha of utterance b in block b,
  its beta and loss in block B + b);
- ``gradient``: one kernel: one read of the logits,
  one write of the gradient, 16-byte accesses where possible;
- ``pack_forward`` / ``pack_backward``: enc + pred gathered into compact
  rows, and the two segment sums back.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ops import FastDivmod, _cuda

from .layout import NUM_STATS, Layout

_HERE = os.path.dirname(os.path.abspath(__file__))
_THREADS = 256  # block size of the per-row kernels (stages.cu: kThreads)

_CTYPE = {
    torch.float16: "td::half_t",
    torch.bfloat16: "td::bf16_t",
    torch.float32: "float",
    torch.float64: "double",
}


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _launch(filename, name, t, grid, block, args, shared_mem=0):
    _cuda.launch(os.path.join(_HERE, filename), name, t, grid, block, args, shared_mem, (_HERE,))


def _i32(x):
    return np.int32(x)


def _vec_width(itemsize, length, tensors):
    """Elements per access: the widest of 16, 8, 4, 2 bytes that divides every row and every base pointer."""
    vec = 16 // itemsize
    while vec > 1:
        if length % vec == 0 and all(t.data_ptr() % (vec * itemsize) == 0 for t in tensors):
            return vec
        vec //= 2
    return 1


def _warps_per_row(num_rows, row_bytes, device):
    """1 (a warp per row, 8 rows per block) or 8 (a 256-thread block per row).

    A warp per row keeps 64 rows in flight per SM with four 16-byte loads per
    lane, which saturates HBM for every row length seen in training; a block
    per row is for rows too long for one warp (over 16 KiB) or too few rows to
    fill the GPU with warps."""
    if row_bytes > 16384:
        return 8
    if row_bytes >= 4096 and num_rows < 64 * _cuda.num_sms(device):
        return 8
    return 1


_INDEX_CTYPE = {torch.int32: "int", torch.int64: "long long"}


def _check_cuda(*tensors):
    for t in tensors:
        if not t.is_cuda:
            raise ValueError("transducer.cuda: every tensor must be on a CUDA device")


def _table(layout):
    """The layout's table pointer and batch size: every kernel finds T_b, U_b, strides and row_splits in it."""
    return layout.table, _i32(layout.batch_size)


# --------------------------------------------------------------------------- stages


def layout(logit_lengths, target_lengths, max_u1, padded_t=0, targets=None, vocab_size=0, blank=0,
           with_stats=True):
    _check_cuda(logit_lengths, target_lengths)
    B = logit_lengths.numel()
    table = torch.empty(4 * B + 1 + NUM_STATS, dtype=torch.int64, device=logit_lengths.device)
    if targets is None:
        targets_ptr, target_cols, itype = 0, 0, "int"
    else:
        targets_ptr, target_cols, itype = targets.contiguous(), targets.size(1), _INDEX_CTYPE[targets.dtype]
    name = (f"layout_kernel<{_INDEX_CTYPE[logit_lengths.dtype]}, {_INDEX_CTYPE[target_lengths.dtype]}, {itype}, "
            f"{'true' if with_stats else 'false'}>")
    _launch("stages.cu", name, table, (1,), (1024,),
            (logit_lengths.contiguous(), target_lengths.contiguous(), targets_ptr,
             _i32(target_cols), _i32(B), _i32(padded_t), _i32(max_u1), _i32(vocab_size), _i32(blank),
             table))
    return Layout(table, padded_t > 0, int(max_u1))


def log_probs(logits2d, targets, layout, blank, from_log_softmax):
    num_rows, V = logits2d.shape
    acc = _acc_dtype(logits2d.dtype)
    lp = torch.empty(num_rows, 2, dtype=acc, device=logits2d.device)
    den = torch.empty(num_rows, dtype=acc, device=logits2d.device)
    if num_rows == 0:
        return lp, den
    itemsize = logits2d.element_size()
    vec = _vec_width(itemsize, V, [logits2d])
    wpr = _warps_per_row(num_rows, V * itemsize, logits2d.device)
    rows_per_block = _THREADS // (32 * wpr)
    name = f"log_probs_kernel<{_CTYPE[logits2d.dtype]}, {_INDEX_CTYPE[targets.dtype]}, {vec}, {wpr}>"
    _launch("stages.cu", name, logits2d, ((num_rows + rows_per_block - 1) // rows_per_block,), (_THREADS,),
            (logits2d, targets, _i32(targets.size(1)), *_table(layout), _i32(num_rows),
             _i32(V), _i32(V // vec), _i32(blank), _i32(layout.padded), _i32(from_log_softmax), lp,
             den))
    return lp, den


def _alpha_beta_smem_entries(max_u1, itemsize):
    """Entries per shared-memory buffer (two buffers), or 0 to keep the previous step in global memory."""
    return max_u1 if 2 * max_u1 * itemsize <= 48 * 1024 else 0


def alpha_beta(lp, layout, one_sym_per_frame):
    num_rows = lp.size(0)
    B = layout.batch_size
    alpha = torch.empty(num_rows, dtype=lp.dtype, device=lp.device)
    beta = torch.empty(num_rows, dtype=lp.dtype, device=lp.device)
    loss = torch.empty(B, dtype=lp.dtype, device=lp.device)
    if B == 0:
        return alpha, beta, loss
    max_u1 = max(int(layout.max_u1), 1)
    threads = min(1024, (max_u1 + 31) // 32 * 32)
    cap = _alpha_beta_smem_entries(max_u1, lp.element_size())
    ctype = "double" if lp.dtype == torch.float64 else "float"
    name = f"alpha_beta_kernel<{ctype}, {'true' if one_sym_per_frame else 'false'}>"
    _launch("stages.cu", name, lp, (2 * B,), (threads,),
            (lp, *_table(layout), _i32(layout.padded), _i32(cap), alpha, beta,
             loss),
            shared_mem=2 * cap * lp.element_size())
    return alpha, beta, loss


def gradient(logits2d, targets, layout, lp, den, alpha, beta, loss, scale, blank,
             from_log_softmax, one_sym_per_frame, out):
    num_rows, V = logits2d.shape
    if num_rows == 0:
        return out
    if not (logits2d.is_contiguous() and out.is_contiguous()):
        raise ValueError("transducer.cuda.gradient: logits2d and out must be contiguous")
    if out.shape != logits2d.shape or out.dtype != logits2d.dtype:
        raise ValueError("transducer.cuda.gradient: out must have the logits' shape and dtype")
    scale = scale.to(lp.dtype)
    itemsize = logits2d.element_size()
    vec = _vec_width(itemsize, V, [out] if from_log_softmax else [logits2d, out])
    wpr = _warps_per_row(num_rows, V * itemsize, logits2d.device)
    rows_per_block = _THREADS // (32 * wpr)
    flag = lambda x: "true" if x else "false"  # noqa: E731
    name = (f"gradient_kernel<{_CTYPE[logits2d.dtype]}, {_INDEX_CTYPE[targets.dtype]}, {vec}, {wpr}, "
            f"{flag(from_log_softmax)}, {flag(one_sym_per_frame)}>")
    _launch("stages.cu", name, logits2d, ((num_rows + rows_per_block - 1) // rows_per_block,), (_THREADS,),
            (logits2d, targets, _i32(targets.size(1)), *_table(layout), _i32(num_rows),
             _i32(V), _i32(V // vec), _i32(blank), _i32(layout.padded), lp, den,
             alpha, beta, loss, scale, np.int64(scale.stride(0)),
             out))
    return out


# --------------------------------------------------------------------------- packing


def _threads_per_item(nvec):
    """Power of two in [32, 256] covering a row's nvec vectors (fewer loop trips, whole warps)."""
    tpr = 32
    while tpr < nvec and tpr < 256:
        tpr *= 2
    return tpr


def pack_forward(encoder_out, predictor_out, layout, num_rows):
    """Compact joiner input: out[r] = encoder_out[b, t] + predictor_out[b, u] for row r = (b, t, u)."""
    _check_cuda(encoder_out, predictor_out)
    if encoder_out.dtype != predictor_out.dtype:
        raise ValueError("pack_forward: encoder_out and predictor_out must have the same dtype")
    encoder_out, predictor_out = encoder_out.contiguous(), predictor_out.contiguous()
    B, max_t, D = encoder_out.shape
    max_u1 = predictor_out.size(1)
    num_rows = int(num_rows)
    out = torch.empty(num_rows, D, dtype=encoder_out.dtype, device=encoder_out.device)
    if num_rows == 0 or D == 0:
        return out
    vec = _vec_width(encoder_out.element_size(), D, [encoder_out, predictor_out, out])
    nvec = D // vec
    tpr = _threads_per_item(nvec)
    items_per_block = _THREADS // tpr
    name = f"pack_forward_kernel<{_CTYPE[encoder_out.dtype]}, {vec}>"
    _launch("pack.cu", name, out, ((num_rows + items_per_block - 1) // items_per_block,), (_THREADS,),
            (encoder_out, predictor_out, *_table(layout), _i32(num_rows), _i32(max_t),
             _i32(max_u1), _i32(nvec), _i32(tpr.bit_length() - 1), out))
    return out


def pack_backward(grad_out, layout, max_t, max_u1):
    """(grad_enc (B, max_t, D), grad_pred (B, max_u1, D)): the row sums of grad_out over u and over t."""
    _check_cuda(grad_out)
    grad_out = grad_out.contiguous()
    B, D = layout.batch_size, grad_out.size(1)
    max_t, max_u1 = int(max_t), int(max_u1)
    grad_enc = torch.empty(B, max_t, D, dtype=grad_out.dtype, device=grad_out.device)
    grad_pred = torch.empty(B, max_u1, D, dtype=grad_out.dtype, device=grad_out.device)
    if D == 0 or B == 0:
        return grad_enc, grad_pred
    vec = _vec_width(grad_out.element_size(), D, [grad_out, grad_enc, grad_pred])
    nvec = D // vec
    tpr = _threads_per_item(nvec)
    items_per_block = _THREADS // tpr
    ctype = _CTYPE[grad_out.dtype]
    for grad, per_b, pred in ((grad_enc, max_t, False), (grad_pred, max_u1, True)):
        num_items = B * per_b
        if num_items == 0:
            continue
        if num_items >= 1 << 31:
            raise ValueError("pack_backward: B * max_t and B * max_u1 must stay below 2^31")
        _launch("pack.cu", f"pack_grad_kernel<{ctype}, {vec}, {'true' if pred else 'false'}>", grad,
                ((num_items + items_per_block - 1) // items_per_block,), (_THREADS,),
                (grad_out, *_table(layout), FastDivmod(per_b).as_struct(), _i32(num_items), _i32(nvec),
                 _i32(tpr.bit_length() - 1), grad))
    return grad_enc, grad_pred
