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

import math
import os

import torch

from .cuda import ceil_div, launch, num_sms
from .dtypes import accumulate_dtype, ctype
from .fast_divmod import FastDivmod
from .params import FAST_DIVMOD, struct

_CU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reduce.cu")
_OPS = {"sum": "ops::kSum", "max": "ops::kMax", "logsumexp": "ops::kLogSumExp"}  # ops/reduce.cuh
_THREADS = 256
_MIN_PER_THREAD = 16  # don't split R below this many elements per thread

# reduce.cu's ReduceParams and FinalizeParams (tests/test_kernel_params.py checks both sides agree)
REDUCE_PARAMS = struct(
    "ReduceParams",
    [
        ("x", "ptr"),
        ("out", "ptr"),
        ("ws_s", "ptr"),
        ("outer", "long long"),
        ("R", "long long"),
        ("inner", "long long"),
        ("tpr", "int"),
        ("div_tiles", FAST_DIVMOD),
        ("splits", "int"),
        ("chunk", "long long"),
    ],
)
FINALIZE_PARAMS = struct(
    "FinalizeParams", [("ws_m", "ptr"), ("ws_s", "ptr"), ("out", "ptr"), ("n", "long long"), ("splits", "int")]
)
_UNUSED = FAST_DIVMOD(0, 0, 0)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _splits_for(base_blocks: int, R: int, threads_on_R: int, sms: int):
    target = 4 * sms
    if base_blocks >= target:
        return 1, R
    want = ceil_div(target, base_blocks)
    cap = max(1, R // (threads_on_R * _MIN_PER_THREAD))
    splits = max(1, min(want, cap, 65535))
    chunk = ceil_div(R, splits)
    splits = ceil_div(R, chunk) if R else 1
    return splits, chunk


def reduce_cuda(x: torch.Tensor, axis: int, op: str, res_shape, out):
    acc = accumulate_dtype(x.dtype)
    if out is None:
        out = torch.empty(res_shape, dtype=acc, device=x.device)
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.numel() == 0:
        return out
    R = int(x.shape[axis])
    outer = math.prod(x.shape[:axis])
    inner = math.prod(x.shape[axis + 1 :])
    if R == 0:
        out.fill_(0.0 if op == "sum" else float("-inf"))
        return out
    x = x.contiguous()
    n_out = outer * inner
    kernel_args = f"{_OPS[op]}, {ctype(x.dtype)}"
    sms = num_sms(x)
    if inner == 1:
        tpr = 32 if R <= 1024 else _THREADS
        rows_per_block = _THREADS // tpr
        base = ceil_div(outer, rows_per_block)
        splits, chunk = _splits_for(base, R, tpr, sms)
    else:
        bx = min(32, _next_pow2(inner))
        by = _THREADS // bx
        tiles = ceil_div(inner, bx)
        base = outer * tiles
        splits, chunk = _splits_for(base, R, by, sms)
    if splits > 1:
        ws_m = torch.empty((splits, n_out), dtype=acc, device=x.device)
        ws_s = torch.empty((splits, n_out), dtype=acc, device=x.device) if op == "logsumexp" else ws_m
        dst, dst_s = ws_m, ws_s
    else:
        dst, dst_s = out, out  # ws_s unused when splits == 1
    if inner == 1:
        p = REDUCE_PARAMS(
            x=x, out=dst, ws_s=dst_s, outer=outer, R=R, inner=1, tpr=tpr, div_tiles=_UNUSED, splits=splits, chunk=chunk
        )
        launch(_CU, f"reduce_rows<{kernel_args}>", x, (ceil_div(outer * splits, rows_per_block),), (_THREADS,), (p,))
    else:
        if base >= 2**31:
            raise ValueError(f"x too large for reduce over axis {axis}: {base} blocks")
        state_bytes = 2 * acc.itemsize  # ops::ReduceState<A>: (m, s)
        p = REDUCE_PARAMS(
            x=x,
            out=dst,
            ws_s=dst_s,
            outer=outer,
            R=R,
            inner=inner,
            tpr=0,
            div_tiles=FastDivmod(tiles).params(),
            splits=splits,
            chunk=chunk,
        )
        launch(_CU, f"reduce_mid<{kernel_args}>", x, (base, splits), (bx, by), (p,), shared_mem=bx * by * state_bytes)
    if splits > 1:
        grid = min(ceil_div(n_out, _THREADS), sms * 32)
        launch(
            _CU,
            f"reduce_finalize<{_OPS[op]}, {ctype(acc)}>",
            x,
            (grid,),
            (_THREADS,),
            (FINALIZE_PARAMS(ws_m=ws_m, ws_s=ws_s, out=out, n=n_out, splits=splits),),
        )
    return out
