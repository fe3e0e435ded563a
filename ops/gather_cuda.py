"""CUDA launcher for gather (kernels in gather.cu). Called by ops.gather for CUDA tensors."""

from __future__ import annotations

import os

import torch

from .cuda import ceil_div, i32, i64, launch, num_sms, vector_width
from .dtypes import ctype
from .fast_divmod import MAX_NUMERATOR, FastDivmod

_CU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gather.cu")
_THREADS = 256


def gather_cuda(params: torch.Tensor, indices: torch.Tensor, plan, offset: int, wrap, out):
    """Launch on torch's current stream. ``wrap``: value added to negative indices
    (None: never wrap, as a sharded gather without full_size: negative indices were rejected on
    the host, and 0 keeps any left negative, which then give zeros)."""
    B, O, G, K, I = plan.B, plan.O, plan.G, plan.K, plan.I
    if out is None:
        out = torch.empty(plan.out_shape, dtype=params.dtype, device=params.device)
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.numel() == 0:
        return out
    if G == 0:  # nothing to read: every index is outside the (empty) shard
        out.zero_()
        return out
    params = params.contiguous()
    if indices.dtype not in (torch.int32, torch.int64):
        indices = indices.to(torch.int64)
    indices = indices.contiguous()
    wrap = 0 if wrap is None else wrap
    row_bytes = K * params.element_size()
    w = vector_width(1, row_bytes, (params, out))  # bytes per word: the row copied as Kv words
    Kv = row_bytes // w
    total = B * O * I * Kv
    kernel_args = f"{w}, {ctype(indices.dtype)}"
    if total < MAX_NUMERATOR:
        launch(_CU, f"gather_kernel<{kernel_args}>", params, (ceil_div(total, _THREADS),), (_THREADS,),
               (params, indices, out, FastDivmod(O * I * Kv).as_struct(), FastDivmod(I * Kv).as_struct(),
                FastDivmod(Kv).as_struct(), i32(O), i32(I), i64(G), i32(total), i64(wrap), i64(offset)))
    else:
        grid = min(ceil_div(total, _THREADS), num_sms(params) * 32)
        launch(_CU, f"gather_big_kernel<{kernel_args}>", params, (grid,), (_THREADS,),
               (params, indices, out, i64(O), i64(I), i64(G), i64(Kv), i64(total), i64(wrap), i64(offset)))
    return out
