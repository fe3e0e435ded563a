"""dtype conventions shared by every package: what accumulates in what, what is an index, C names."""

from __future__ import annotations

import numbers

import numpy as np
import torch

__all__ = [
    "accumulate_dtype",
    "is_integer_dtype",
    "is_index_dtype",
    "check_index_dtype",
    "check_count",
    "ctype",
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
]

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
    integers but uint64 (whose values past 2^63 would wrap). Wider than INDEX_DTYPES, the kernels' own."""
    if isinstance(dtype, torch.dtype):
        return is_integer_dtype(dtype) and dtype not in _WIDE_UNSIGNED
    return is_integer_dtype(dtype) and np.dtype(dtype) != np.uint64


def check_index_dtype(name, dtype) -> None:
    """TypeError naming ``name`` unless ``dtype`` is an index dtype (is_index_dtype)."""
    if not is_index_dtype(dtype):
        raise TypeError(
            f"{name} must hold integers that index as int64 (signed, or uint8; numpy's uint8-uint32 too), "
            f"got dtype {dtype}"
        )


def ctype(dtype: torch.dtype) -> str:
    """The C type a kernel template takes for tensors of ``dtype`` (ops/numeric.cuh's 16-bit types)."""
    try:
        return _CTYPES[dtype]
    except KeyError:
        raise TypeError(f"no kernel type for dtype {dtype}") from None


def check_count(name, value) -> int:
    """``value``, a count or an offset, as an int >= 0: an int, a numpy integer or a 0-d integer tensor (not a
    bool or a float); TypeError or ValueError naming ``name``."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and is_integer_dtype(value.dtype):
        value = int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {int(value)}")
    return int(value)
