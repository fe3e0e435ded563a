"""CUDA launcher for gather (kernels in gather.cu). Called by ops.gather for CUDA tensors."""

from __future__ import annotations

import os

import numpy as np
import torch

from . import _cuda
from .fast_divmod import FastDivmod, MAX_NUMERATOR

_CU = os.path.join(_cuda.OPS_DIR, "gather.cu")
_THREADS = 256


def _word_size(row_bytes: int, *ptrs: int) -> int:
    for w in (16, 8, 4, 2, 1):
        if row_bytes % w == 0 and all(p % w == 0 for p in ptrs):
            return w
    return 1


def gather_cuda(params: torch.Tensor, indices: torch.Tensor, plan, offset: int, wrap, out):
    """Launch on torch's current stream. ``wrap``: value added to negative indices
    (None: never wrap, as a sharded gather without full_size: a huge wrap that can't
    bring a negative index into range is used instead)."""
    B, O, G, K, I = plan.B, plan.O, plan.G, plan.K, plan.I
    if out is None:
        out = torch.empty(plan.out_shape, dtype=params.dtype, device=params.device)
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.numel() == 0:
        return out
    params = params.contiguous()
    if indices.dtype not in (torch.int32, torch.int64):
        indices = indices.to(torch.int64)
    indices = indices.contiguous()
    if wrap is None:
        wrap = 0  # negative indices were rejected on the host; 0 keeps them negative -> zeros
    itemsize = params.element_size()
    row_bytes = K * itemsize
    w = _word_size(row_bytes, params.data_ptr(), out.data_ptr())
    Kv = row_bytes // w
    total = B * O * I * Kv
    isuf = "i32" if indices.dtype == torch.int32 else "i64"
    if G == 0:  # nothing to read: every index is outside the (empty) shard
        out.zero_()
        return out
    if total < MAX_NUMERATOR:
        grid = _cuda.ceil_div(total, _THREADS)
        _cuda.launch(_CU, f"gather_w{w}_{isuf}", params, (grid,), (_THREADS,), (
            _cuda.ptr(params), _cuda.ptr(indices), _cuda.ptr(out),
            FastDivmod(O * I * Kv).as_struct(), FastDivmod(I * Kv).as_struct(),
            FastDivmod(Kv).as_struct(),
            np.int32(O), np.int32(I), np.int64(G), np.uint32(total),
            np.int64(wrap), np.int64(offset)))
    else:
        grid = min(_cuda.ceil_div(total, _THREADS), _cuda.num_sms(params) * 32)
        _cuda.launch(_CU, f"gather_big_w{w}_{isuf}", params, (grid,), (_THREADS,), (
            _cuda.ptr(params), _cuda.ptr(indices), _cuda.ptr(out),
            np.int64(O), np.int64(I), np.int64(G), np.int64(Kv), np.int64(total),
            np.int64(wrap), np.int64(offset)))
    return out
