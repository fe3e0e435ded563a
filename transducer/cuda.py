"""The CUDA stages of the transducer loss (contract: transducer/layout.py), and the packing op.

Same functions, arguments and results as ``transducer.cpu``. Kernels live in
``stages.cu`` and ``pack.cu`` next to this file and are compiled at run time by
``cupy.RawModule`` (NVRTC, ``-std=c++17 -I<ops dir> -I<this dir>``), one
template instantiation per module, once per process and device. Every launch
goes to torch's current stream, outputs come from torch's allocator, and
nothing here synchronises with the host, so a training step stays capturable
in a CUDA graph.

Kernels per stage:

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
from ops._cuda import ptr as _ptr

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


def _kernel(filename, expression):
    """The kernel ``expression`` (a template instantiation or extern "C" name) of ``filename``, on CuPy's current device."""
    names = (expression,) if expression.endswith(">") else ()
    return _cuda.load_module(os.path.join(_HERE, filename), (_HERE,), names).get_function(expression)


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


def _int32(t):
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _int64(t):
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def _check_cuda(*tensors):
    for t in tensors:
        if not t.is_cuda:
            raise ValueError("transducer.cuda: every tensor must be on a CUDA device")


_INDEX_CTYPE = {torch.int32: "int", torch.int64: "long long"}


def _targets(targets):
    """targets as contiguous (B, S) int32 or int64 (kernels are instantiated for both: no conversion pass),
    and the C type. With S == 0 no kernel reads it."""
    if targets.dtype not in _INDEX_CTYPE:
        targets = targets.to(torch.int64)
    targets = targets.contiguous()
    return targets, _INDEX_CTYPE[targets.dtype]


def _layout_args(layout):
    return (_int64(layout.logit_lengths), _int64(layout.target_lengths), _int64(layout.cell_offsets),
            _int64(layout.row_strides), _int32(layout.row_ids))


# --------------------------------------------------------------------------- stages


def log_probs(logits2d, targets, layout, blank, from_log_softmax):
    _check_cuda(logits2d, targets)
    logits2d = logits2d.contiguous()
    num_rows, V = logits2d.shape
    acc = _acc_dtype(logits2d.dtype)
    lp = torch.empty(num_rows, 2, dtype=acc, device=logits2d.device)
    den = torch.empty(num_rows, dtype=acc, device=logits2d.device)
    if num_rows == 0:
        return lp, den
    T, U, offsets, strides, row_ids = _layout_args(layout)
    targets, itype = _targets(targets)
    blank = blank + V if blank < 0 else blank
    itemsize = logits2d.element_size()
    vec = _vec_width(itemsize, V, [logits2d])
    wpr = _warps_per_row(num_rows, V * itemsize, logits2d.device)
    rows_per_block = _THREADS // (32 * wpr)
    expr = f"log_probs_kernel<{_CTYPE[logits2d.dtype]}, {itype}, {vec}, {wpr}>"
    with _cuda.torch_stream(logits2d):
        _kernel("stages.cu", expr)(
            ((num_rows + rows_per_block - 1) // rows_per_block,), (_THREADS,),
            (_ptr(logits2d), _ptr(targets), _i32(targets.size(1)), _ptr(T), _ptr(U), _ptr(offsets), _ptr(strides),
             _ptr(row_ids), _i32(num_rows), _i32(V), _i32(V // vec), _i32(blank), _i32(bool(layout.padded)),
             _i32(bool(from_log_softmax)), _ptr(lp), _ptr(den)))
    return lp, den


def input_stats(targets, logit_lengths, target_lengths, vocab_size, blank):
    _check_cuda(targets, logit_lengths, target_lengths)
    targets, itype = _targets(targets)
    T, U = _int64(logit_lengths), _int64(target_lengths)
    stats = torch.empty(6, dtype=torch.int64, device=T.device)
    with _cuda.torch_stream(T):
        _kernel("stages.cu", f"input_stats_kernel<{itype}>")(
            (1,), (256,), (_ptr(targets), _i32(targets.size(1)), _ptr(T), _ptr(U), _i32(T.numel()),
                           _i32(vocab_size), _i32(blank), _ptr(stats)))
    return stats


def _alpha_beta_smem_entries(max_u1, itemsize):
    """Entries per shared-memory buffer (two buffers), or 0 to keep the previous step in global memory."""
    return max_u1 if 2 * max_u1 * itemsize <= 48 * 1024 else 0


def alpha_beta(lp, layout, one_sym_per_frame):
    _check_cuda(lp)
    lp = lp.contiguous()
    num_rows = lp.size(0)
    B = layout.logit_lengths.numel()
    alpha = torch.empty(num_rows, dtype=lp.dtype, device=lp.device)
    beta = torch.empty(num_rows, dtype=lp.dtype, device=lp.device)
    loss = torch.empty(B, dtype=lp.dtype, device=lp.device)
    if B == 0:
        return alpha, beta, loss
    T, U, offsets, strides, _ = _layout_args(layout)
    max_u1 = max(int(layout.max_u1), 1)
    threads = min(1024, (max_u1 + 31) // 32 * 32)
    cap = _alpha_beta_smem_entries(max_u1, lp.element_size())
    ctype = "double" if lp.dtype == torch.float64 else "float"
    expr = f"alpha_beta_kernel<{ctype}, {'true' if one_sym_per_frame else 'false'}>"
    with _cuda.torch_stream(lp):
        _kernel("stages.cu", expr)(
            (2 * B,), (threads,),
            (_ptr(lp), _ptr(T), _ptr(U), _ptr(offsets), _ptr(strides), _i32(B), _i32(num_rows),
             _i32(bool(layout.padded)), _i32(cap), _ptr(alpha), _ptr(beta), _ptr(loss)),
            shared_mem=2 * cap * lp.element_size())
    return alpha, beta, loss


def gradient(logits2d, targets, layout, lp, den, alpha, beta, loss, scale, blank,
             from_log_softmax, one_sym_per_frame, out):
    _check_cuda(logits2d, targets, lp, den, alpha, beta, loss, scale, out)
    num_rows, V = logits2d.shape
    if num_rows == 0:
        return out
    if not (logits2d.is_contiguous() and out.is_contiguous()):
        raise ValueError("transducer.cuda.gradient: logits2d and out must be contiguous")
    if out.shape != logits2d.shape or out.dtype != logits2d.dtype:
        raise ValueError("transducer.cuda.gradient: out must have the logits' shape and dtype")
    acc = lp.dtype
    lp, den, alpha, beta = (x.contiguous() for x in (lp, den, alpha, beta))
    loss = loss.to(acc).contiguous()
    scale = scale.to(device=lp.device, dtype=acc).expand(loss.numel()).contiguous()
    T, U, offsets, strides, row_ids = _layout_args(layout)
    targets, itype = _targets(targets)
    blank = blank + V if blank < 0 else blank
    itemsize = logits2d.element_size()
    vec = _vec_width(itemsize, V, [out] if from_log_softmax else [logits2d, out])
    wpr = _warps_per_row(num_rows, V * itemsize, logits2d.device)
    rows_per_block = _THREADS // (32 * wpr)
    flag = lambda x: "true" if x else "false"  # noqa: E731
    expr = (f"gradient_kernel<{_CTYPE[logits2d.dtype]}, {itype}, {vec}, {wpr}, {flag(from_log_softmax)}, "
            f"{flag(one_sym_per_frame)}>")
    with _cuda.torch_stream(logits2d):
        _kernel("stages.cu", expr)(
            ((num_rows + rows_per_block - 1) // rows_per_block,), (_THREADS,),
            (_ptr(logits2d), _ptr(targets), _i32(targets.size(1)), _ptr(T), _ptr(U), _ptr(offsets), _ptr(strides),
             _ptr(row_ids), _i32(num_rows), _i32(V), _i32(V // vec), _i32(blank), _i32(bool(layout.padded)),
             _ptr(lp), _ptr(den), _ptr(alpha), _ptr(beta), _ptr(loss), _ptr(scale), _ptr(out)))
    return out


# --------------------------------------------------------------------------- packing


def _threads_per_item(nvec):
    """Power of two in [32, 256] covering a row's nvec vectors (fewer loop trips, whole warps)."""
    tpr = 32
    while tpr < nvec and tpr < 256:
        tpr *= 2
    return tpr


def pack_forward(encoder_out, predictor_out, row_ids, cell_offsets, row_strides, num_rows):
    """Compact joiner input: out[r] = encoder_out[b, t] + predictor_out[b, u] for row r = (b, t, u)."""
    _check_cuda(encoder_out, predictor_out, row_ids, cell_offsets, row_strides)
    if encoder_out.dtype != predictor_out.dtype:
        raise ValueError("pack_forward: encoder_out and predictor_out must have the same dtype")
    encoder_out, predictor_out = encoder_out.contiguous(), predictor_out.contiguous()
    B, max_t, D = encoder_out.shape
    max_u1 = predictor_out.size(1)
    num_rows = int(num_rows)
    out = torch.empty(num_rows, D, dtype=encoder_out.dtype, device=encoder_out.device)
    if num_rows == 0 or D == 0:
        return out
    row_ids, offsets, strides = _int32(row_ids), _int64(cell_offsets), _int64(row_strides)
    vec = _vec_width(encoder_out.element_size(), D, [encoder_out, predictor_out, out])
    nvec = D // vec
    tpr = _threads_per_item(nvec)
    items_per_block = _THREADS // tpr
    expr = f"pack_forward_kernel<{_CTYPE[encoder_out.dtype]}, {vec}>"
    with _cuda.torch_stream(encoder_out):
        _kernel("pack.cu", expr)(
            ((num_rows + items_per_block - 1) // items_per_block,), (_THREADS,),
            (_ptr(encoder_out), _ptr(predictor_out), _ptr(row_ids), _ptr(offsets), _ptr(strides),
             _i32(num_rows), _i32(max_t), _i32(max_u1), _i32(nvec), _i32(tpr.bit_length() - 1), _ptr(out)))
    return out


def pack_backward(grad_out, row_ids, cell_offsets, row_strides, logit_lengths, target_lengths, max_t, max_u1):
    """(grad_enc (B, max_t, D), grad_pred (B, max_u1, D)): the row sums of grad_out over u and over t."""
    _check_cuda(grad_out, cell_offsets, row_strides, logit_lengths, target_lengths)
    grad_out = grad_out.contiguous()
    B, D = logit_lengths.numel(), grad_out.size(1)
    max_t, max_u1 = int(max_t), int(max_u1)
    grad_enc = torch.empty(B, max_t, D, dtype=grad_out.dtype, device=grad_out.device)
    grad_pred = torch.empty(B, max_u1, D, dtype=grad_out.dtype, device=grad_out.device)
    if D == 0 or B == 0:
        return grad_enc, grad_pred
    T, U = _int64(logit_lengths), _int64(target_lengths)
    offsets, strides = _int64(cell_offsets), _int64(row_strides)
    vec = _vec_width(grad_out.element_size(), D, [grad_out, grad_enc, grad_pred])
    nvec = D // vec
    tpr = _threads_per_item(nvec)
    items_per_block = _THREADS // tpr
    ctype = _CTYPE[grad_out.dtype]
    with _cuda.torch_stream(grad_out):
        for grad, per_b, pred in ((grad_enc, max_t, False), (grad_pred, max_u1, True)):
            num_items = B * per_b
            if num_items == 0:
                continue
            if num_items >= 1 << 31:
                raise ValueError("pack_backward: B * max_t and B * max_u1 must stay below 2^31")
            _kernel("pack.cu", f"pack_grad_kernel<{ctype}, {vec}, {'true' if pred else 'false'}>")(
                ((num_items + items_per_block - 1) // items_per_block,), (_THREADS,),
                (_ptr(grad_out), _ptr(T), _ptr(U), _ptr(offsets), _ptr(strides), FastDivmod(per_b).as_struct(),
                 _i32(num_items), _i32(nvec), _i32(tpr.bit_length() - 1), _ptr(grad)))
    return grad_enc, grad_pred
