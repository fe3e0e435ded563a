"""CUDA launchers for ragged (kernels in ragged.cu), on torch's current stream.

No host round trip: sizes come from the arguments (num_elems, num_rows) and the
tensors' shapes; the outputs are allocated by torch. Arguments are validated by
the callers in ragged/shape.py.
"""

from __future__ import annotations

import os

import torch

from ops import ctype
from ops.cuda import ceil_div, launch, num_sms
from ops.params import struct

_CU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ragged.cu")
_THREADS = 256
_TILE_THREADS, _TILE = 128, 1024  # ragged/row_ids.cuh: kThreads, kTile = kThreads * kVT
_MAX_INT = (1 << 31) - 1
# ragged.cu's parameter structs (tests/test_kernel_params.py checks both sides agree)
ROW_IDS_PARAMS = struct(
    "RowIdsParams", [("row_splits", "ptr"), ("num_rows", "long long"), ("row_ids", "ptr"), ("num_elems", "long long")]
)
ROW_SPLITS_PARAMS = struct(
    "RowSplitsParams",
    [("row_ids", "ptr"), ("num_elems", "long long"), ("row_splits", "ptr"), ("num_rows", "long long")],
)

#: The row_splits_to_row_ids kernel taken when ``method`` is None: "binary_search" or "merge_path" (the
#: faster of the two at every size benchmarks/ragged_search.py measures; figures in benchmarks/RESULTS.md).
DEFAULT_METHOD = "merge_path"


def _grid(n: int, t: torch.Tensor) -> int:
    return max(1, min(ceil_div(n, _THREADS), num_sms(t) * 32))


def _index(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous int32 or int64 tensor (the kernels' index types)."""
    return (t if t.dtype in (torch.int32, torch.int64) else t.to(torch.int64)).contiguous()


def row_splits_to_row_ids_cuda(
    row_splits: torch.Tensor, num_elems: int, dtype: torch.dtype, method: str | None = None
) -> torch.Tensor:
    """row_ids (num_elems,) of ``dtype``; ``method``: "binary_search", "merge_path" or None
    (DEFAULT_METHOD). More than 2^31 - 1 rows always take merge_path (row_of indexes rows by int)."""
    kdtype = dtype if dtype in (torch.int32, torch.int64) else torch.int64
    row_ids = torch.empty(num_elems, dtype=kdtype, device=row_splits.device)
    num_rows = row_splits.shape[0] - 1
    if num_elems > 0:
        if num_rows <= 0:
            raise ValueError(f"num_elems={num_elems} but row_splits has no rows")
        rs = _index(row_splits)
        method = DEFAULT_METHOD if method is None else method
        p = ROW_IDS_PARAMS(row_splits=rs, num_rows=num_rows, row_ids=row_ids, num_elems=num_elems)
        if method == "binary_search" and num_rows <= _MAX_INT:
            launch(
                _CU,
                f"row_splits_to_row_ids_binary_search<{ctype(rs.dtype)}, {ctype(kdtype)}>",
                rs,
                (_grid(num_elems, rs),),
                (_THREADS,),
                (p,),
            )
        else:
            tiles = ceil_div(num_elems + num_rows - 1, _TILE)
            launch(
                _CU,
                f"row_splits_to_row_ids_merge_path<{ctype(rs.dtype)}, {ctype(kdtype)}>",
                rs,
                (tiles,),
                (_TILE_THREADS,),
                (p,),
            )
    return row_ids if kdtype == dtype else row_ids.to(dtype)


def row_ids_to_row_splits_cuda(row_ids: torch.Tensor, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    kdtype = dtype if dtype in (torch.int32, torch.int64) else torch.int64
    row_splits = torch.empty(num_rows + 1, dtype=kdtype, device=row_ids.device)
    ri = _index(row_ids)
    p = ROW_SPLITS_PARAMS(row_ids=ri, num_elems=ri.shape[0], row_splits=row_splits, num_rows=num_rows)
    launch(
        _CU,
        f"row_ids_to_row_splits<{ctype(ri.dtype)}, {ctype(kdtype)}>",
        ri,
        (_grid(num_rows + 1, ri),),
        (_THREADS,),
        (p,),
    )
    return row_splits if kdtype == dtype else row_splits.to(dtype)
