"""CUDA launchers for ragged (kernels in ragged.cu), on torch's current stream.

No host round trip: sizes come from the arguments (num_elems, num_rows) and the
tensors' shapes; the outputs are allocated by torch.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ops import _cuda

_CU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ragged.cu")
_THREADS = 256
_SUF = {torch.int32: "i32", torch.int64: "i64"}


def _grid(n: int, t: torch.Tensor) -> int:
    return max(1, min(_cuda.ceil_div(n, _THREADS), _cuda.num_sms(t) * 32))


def row_splits_to_row_ids_cuda(row_splits: torch.Tensor, num_elems: int, dtype: torch.dtype) -> torch.Tensor:
    out_dtype = dtype
    kdtype = dtype if dtype in _SUF else torch.int64
    row_ids = torch.empty(num_elems, dtype=kdtype, device=row_splits.device)
    num_rows = row_splits.shape[0] - 1
    if num_elems > 0:
        if num_rows <= 0:
            raise ValueError(f"num_elems={num_elems} but row_splits has no rows")
        rs = row_splits if row_splits.dtype in _SUF else row_splits.to(torch.int64)
        rs = rs.contiguous()
        _cuda.launch(_CU, f"row_splits_to_row_ids_{_SUF[rs.dtype]}_{_SUF[kdtype]}", rs,
                     (_grid(num_elems, rs),), (_THREADS,),
                     (_cuda.ptr(rs), np.int64(num_rows), _cuda.ptr(row_ids), np.int64(num_elems)))
    return row_ids if kdtype == out_dtype else row_ids.to(out_dtype)


def row_ids_to_row_splits_cuda(row_ids: torch.Tensor, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    out_dtype = dtype
    kdtype = dtype if dtype in _SUF else torch.int64
    row_splits = torch.empty(num_rows + 1, dtype=kdtype, device=row_ids.device)
    ri = row_ids if row_ids.dtype in _SUF else row_ids.to(torch.int64)
    ri = ri.contiguous()
    _cuda.launch(_CU, f"row_ids_to_row_splits_{_SUF[ri.dtype]}_{_SUF[kdtype]}", ri,
                 (_grid(num_rows + 1, ri),), (_THREADS,),
                 (_cuda.ptr(ri), np.int64(ri.shape[0]), _cuda.ptr(row_splits), np.int64(num_rows)))
    return row_splits if kdtype == out_dtype else row_splits.to(out_dtype)
