"""CUDA launcher for reduce (kernels in reduce.cu). Called by ops.reduce for CUDA tensors.

Launch plan for x seen as (outer, R, inner):
- inner == 1 (last axis): R <= 1024 -> one warp per row (8 rows per 256-thread
  block); longer rows -> one 256-thread block per row.
- inner > 1: blocks of (bx, by) = (min(32, pow2 >= inner), 256 // bx) threads,
  one block per (outer index, tile of bx columns).
In both cases, when the grid would have fewer than ~4 blocks per SM and R is
long, R is split into `splits` chunks handled by different blocks, which write
partial states to a torch-allocated workspace that reduce_finalize merges.
No host synchronisation: everything is sized from shapes.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from . import _cuda
from .fast_divmod import FastDivmod

_CU = os.path.join(_cuda.OPS_DIR, "reduce.cu")
_TSUF = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64"}
_THREADS = 256
_MIN_PER_THREAD = 16  # don't split R below this many elements per thread


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _splits_for(base_blocks: int, R: int, threads_on_R: int, sms: int):
    target = 4 * sms
    if base_blocks >= target:
        return 1, R
    want = _cuda.ceil_div(target, base_blocks)
    cap = max(1, R // (threads_on_R * _MIN_PER_THREAD))
    splits = max(1, min(want, cap, 65535))
    chunk = _cuda.ceil_div(R, splits)
    splits = _cuda.ceil_div(R, chunk) if R else 1
    return splits, chunk


def reduce_cuda(x: torch.Tensor, axis: int, op: str, res_shape, out):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty(res_shape, dtype=acc, device=x.device)
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.numel() == 0:
        return out
    shape = x.shape
    R = int(shape[axis])
    outer = 1
    for s in shape[:axis]:
        outer *= int(s)
    inner = 1
    for s in shape[axis + 1:]:
        inner *= int(s)
    if R == 0:
        out.fill_(0.0 if op == "sum" else float("-inf"))
        return out
    x = x.contiguous()
    n_out = outer * inner
    tsuf = _TSUF[x.dtype]
    asuf = "f64" if acc == torch.float64 else "f32"
    sms = _cuda.num_sms(x)
    if inner == 1:
        tpr = 32 if R <= 1024 else _THREADS
        rows_per_block = _THREADS // tpr
        base = _cuda.ceil_div(outer, rows_per_block)
        splits, chunk = _splits_for(base, R, tpr, sms)
    else:
        bx = min(32, _next_pow2(inner))
        by = _THREADS // bx
        tiles = _cuda.ceil_div(inner, bx)
        base = outer * tiles
        splits, chunk = _splits_for(base, R, by, sms)
    if splits > 1:
        ws_m = torch.empty((splits, n_out), dtype=acc, device=x.device)
        ws_s = torch.empty((splits, n_out), dtype=acc, device=x.device) if op == "logsumexp" else ws_m
        dst, dst_s = ws_m, ws_s
    else:
        dst, dst_s = out, out  # ws_s unused when splits == 1
    if inner == 1:
        grid = _cuda.ceil_div(outer * splits, rows_per_block)
        _cuda.launch(_CU, f"reduce_rows_{op}_{tsuf}", x, (grid,), (_THREADS,), (
            _cuda.ptr(x), _cuda.ptr(dst), _cuda.ptr(dst_s), np.int64(outer), np.int64(R),
            np.int32(tpr), np.int32(splits), np.int64(chunk)))
    else:
        if base >= 2 ** 31:
            raise ValueError(f"x too large for reduce over axis {axis}: {base} blocks")
        state_bytes = 16 if acc == torch.float64 else 8
        _cuda.launch(_CU, f"reduce_mid_{op}_{tsuf}", x, (base, splits), (bx, by), (
            _cuda.ptr(x), _cuda.ptr(dst), _cuda.ptr(dst_s), np.int64(outer), np.int64(R),
            np.int64(inner), FastDivmod(tiles).as_struct(), np.int32(splits), np.int64(chunk)),
            shared_mem=bx * by * state_bytes)
    if splits > 1:
        grid = min(_cuda.ceil_div(n_out, _THREADS), sms * 32)
        _cuda.launch(_CU, f"reduce_finalize_{op}_{asuf}", x, (grid,), (_THREADS,), (
            _cuda.ptr(ws_m), _cuda.ptr(ws_s), _cuda.ptr(out), np.int64(n_out), np.int32(splits)))
    return out
