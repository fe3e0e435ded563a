"""dtype conventions shared by every package: what accumulates in what, what is an index, C names."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["accumulate_dtype", "is_integer_dtype", "is_index_dtype", "ctype", "FLOAT_DTYPES", "INDEX_DTYPES"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

_CTYPES = {
    torch.float16: "ops::half_t",
    torch.bfloat16: "ops::bf16_t",
    torch.float32: "float",
    torch.float64: "double",
    torch.int32: "int",
    torch.int64: "long long",
}


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64, float32 for every other floating dtype: kernels read 16-bit floats and
    accumulate in float32 (``ops::AccOf`` in ops/numeric.cuh)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def is_integer_dtype(dtype) -> bool:
    """An integer torch or numpy dtype (bool is not one)."""
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    return np.issubdtype(dtype, np.integer)


# torch's unsigned dtypes past uint8 have few CPU kernels (no comparisons, min or max)
_WIDE_UNSIGNED = tuple(getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name))


def is_index_dtype(dtype) -> bool:
    """An integer dtype whose values index as int64 on every path: torch's signed ones and uint8, numpy's
    integers but uint64 (whose values past 2^63 would wrap)."""
    if isinstance(dtype, torch.dtype):
        return is_integer_dtype(dtype) and dtype not in _WIDE_UNSIGNED
    return is_integer_dtype(dtype) and np.dtype(dtype) != np.uint64


def ctype(dtype: torch.dtype) -> str:
    """The C type a kernel template takes for tensors of ``dtype`` (ops/numeric.cuh's 16-bit types)."""
    try:
        return _CTYPES[dtype]
    except KeyError:
        raise TypeError(f"no kernel type for dtype {dtype}") from None
