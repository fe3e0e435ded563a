"""CUDA launcher for gather (kernels in gather.cu). Called by ops.gather for CUDA tensors."""

from __future__ import annotations

import os

import torch

from .cuda import ceil_div, launch, num_sms, vector_width
from .dtypes import ctype
from .fast_divmod import MAX_NUMERATOR, FastDivmod
from .params import FAST_DIVMOD, struct

_CU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gather.cu")
_THREADS = 256
# gather.cu's GatherParams (tests/test_kernel_params.py checks the two agree)
GATHER_PARAMS = struct(
    "GatherParams",
    [
        ("params", "ptr"),
        ("indices", "ptr"),
        ("out", "ptr"),
        ("div_oik", FAST_DIVMOD),
        ("div_ik", FAST_DIVMOD),
        ("div_k", FAST_DIVMOD),
        ("O", "long long"),
        ("I", "long long"),
        ("G", "long long"),
        ("Kv", "long long"),
        ("total", "long long"),
        ("wrap", "long long"),
        ("offset", "long long"),
    ],
)
_UNUSED = FAST_DIVMOD(0, 0, 0)


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
    small = total < MAX_NUMERATOR
    divisors = (
        (FastDivmod(O * I * Kv).params(), FastDivmod(I * Kv).params(), FastDivmod(Kv).params())
        if small
        else (_UNUSED,) * 3
    )
    p = GATHER_PARAMS(
        params=params,
        indices=indices,
        out=out,
        div_oik=divisors[0],
        div_ik=divisors[1],
        div_k=divisors[2],
        O=O,
        I=I,
        G=G,
        Kv=Kv,
        total=total,
        wrap=wrap,
        offset=offset,
    )
    if small:
        launch(_CU, f"gather_kernel<{kernel_args}>", params, (ceil_div(total, _THREADS),), (_THREADS,), (p,))
    else:
        grid = min(ceil_div(total, _THREADS), num_sms(params) * 32)
        launch(_CU, f"gather_big_kernel<{kernel_args}>", params, (grid,), (_THREADS,), (p,))
    return out
