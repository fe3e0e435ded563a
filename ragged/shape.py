"""k2-style ragged shapes: row_splits <-> row_ids, and a small RaggedShape.

    row_splits (num_rows + 1,)  nondecreasing, row_splits[0] == 0, row_splits[-1] == num_elems
    row_ids    (num_elems,)     row_ids[i] = r with row_splits[r] <= i < row_splits[r + 1]

Empty rows have row_splits[r] == row_splits[r + 1] and no element carries their id.

numpy arrays and torch tensors (CPU and CUDA) are accepted. On CPU the inputs
are validated (errors name the argument). On CUDA nothing is read back to the
host when ``num_elems`` is given (no validation there: that would need a sync),
and the work is done by the kernels in ragged.cu (see ragged_cuda.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ops import check_count, check_index_dtype, is_integer_dtype

__all__ = ["row_splits_to_row_ids", "row_ids_to_row_splits", "RaggedShape", "ROW_IDS_METHODS"]

#: The CUDA kernels of row_splits_to_row_ids (ragged/ragged.cu): one binary search per element, or
#: moderngpu's merge-path load-balancing search.
ROW_IDS_METHODS = ("binary_search", "merge_path")


def _as_1d_int(x, name):
    if isinstance(x, torch.Tensor):
        t = x
    else:
        t = np.asarray(x)
        if t.dtype == object:
            raise TypeError(f"{name} must be an integer array")
    check_index_dtype(name, t.dtype)
    if t.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t


def _check_holds(dtype, largest, what):
    """TypeError unless the output ``dtype`` holds ``largest``, the largest value of ``what`` it would carry."""
    info = torch.iinfo(dtype) if isinstance(dtype, torch.dtype) else np.iinfo(dtype)
    if largest > info.max:
        raise TypeError(f"dtype {dtype} cannot hold {what} up to {largest} (at most {info.max}): pass a wider dtype")


def _validate_row_splits(row_splits, name="row_splits"):
    """CPU-only checks: starts at 0, nondecreasing."""
    n = row_splits.shape[0]
    if n == 0:
        raise ValueError(f"{name} must have at least one entry (num_rows + 1 >= 1)")
    if isinstance(row_splits, torch.Tensor):
        if row_splits.is_cuda:
            return
        first = int(row_splits[0])
        dec = bool((row_splits[1:] < row_splits[:-1]).any()) if n > 1 else False
    else:
        first = int(row_splits[0])
        dec = bool(np.any(np.diff(row_splits) < 0)) if n > 1 else False
    if first != 0:
        raise ValueError(f"{name}[0] must be 0, got {first}")
    if dec:
        raise ValueError(f"{name} must be nondecreasing")


def row_splits_to_row_ids(row_splits, num_elems=None, *, dtype=None, validate=True, method=None):
    """row_ids (num_elems,) from row_splits (num_rows + 1,).

    ``num_elems`` defaults to ``row_splits[-1]`` (a host read, i.e. a sync for CUDA
    tensors); pass it when known to keep CUDA fully asynchronous. Output dtype:
    ``dtype`` if given (torch dtype for tensors, numpy dtype for arrays), else
    row_splits' dtype. ``validate=False`` skips the CPU checks. ``method``: the CUDA
    kernel, one of ``ROW_IDS_METHODS`` or None for the measured default
    (``ragged.ragged_cuda.DEFAULT_METHOD``); checked on every device, used on CUDA only.
    """
    if method is not None and method not in ROW_IDS_METHODS:
        raise ValueError(f"method must be one of {ROW_IDS_METHODS} or None, got {method!r}")
    row_splits = _as_1d_int(row_splits, "row_splits")
    is_torch = isinstance(row_splits, torch.Tensor)
    if validate:
        _validate_row_splits(row_splits)
    elif row_splits.shape[0] == 0:
        raise ValueError("row_splits must have at least one entry (num_rows + 1 >= 1)")
    num_rows = row_splits.shape[0] - 1
    if num_elems is None:
        num_elems = int(row_splits[-1])
    else:
        num_elems = check_count("num_elems", num_elems)
        if validate and not (is_torch and row_splits.is_cuda):
            last = int(row_splits[-1])
            if last != num_elems:
                raise ValueError(f"num_elems={num_elems} does not match row_splits[-1]={last}")
    if is_torch:
        out_dtype = row_splits.dtype if dtype is None else dtype
        if not isinstance(out_dtype, torch.dtype) or not is_integer_dtype(out_dtype):
            raise TypeError(f"dtype must be a torch integer dtype, got {dtype}")
        _check_holds(out_dtype, num_rows - 1, "row_ids")
        if row_splits.is_cuda:
            from .ragged_cuda import row_splits_to_row_ids_cuda

            return row_splits_to_row_ids_cuda(row_splits, num_elems, out_dtype, method)
        sizes = row_splits[1:] - row_splits[:-1]
        ids = torch.arange(num_rows, dtype=out_dtype)
        return torch.repeat_interleave(ids, sizes, output_size=num_elems)
    out_dtype = row_splits.dtype if dtype is None else _numpy_dtype(dtype)
    _check_holds(out_dtype, num_rows - 1, "row_ids")
    sizes = np.diff(row_splits)
    return np.repeat(np.arange(num_rows, dtype=out_dtype), sizes)


def _numpy_dtype(dtype):
    """The integer numpy dtype an array's output takes; TypeError for a torch dtype or a non-integer one."""
    if isinstance(dtype, torch.dtype) or not np.issubdtype(np.dtype(dtype), np.integer):
        raise TypeError(f"dtype must be a numpy integer dtype for numpy arrays, got {dtype}")
    return np.dtype(dtype)


def row_of(row_splits, elems):
    """The row of each element index in ``elems`` (torch int64 tensors): the r with
    ``row_splits[r] <= e < row_splits[r + 1]`` (past empty rows), as row_splits_to_row_ids(row_splits)[elems]
    but in O(len(elems) log num_rows), without the row_ids of every element. The host twin of
    ``ragged/row_ids.cuh``'s row_of (upper bound - 1). ``elems`` must lie in [0, row_splits[-1]): unchecked."""
    return torch.searchsorted(row_splits, elems, right=True) - 1


def row_ids_to_row_splits(row_ids, num_rows, *, dtype=None, validate=True):
    """row_splits (num_rows + 1,) from nondecreasing row_ids in [0, num_rows).

    Output dtype: ``dtype`` if given, else row_ids' dtype (numpy and torch alike;
    int32 row_ids give int32 row_splits, enough for < 2^31 elements).
    """
    row_ids = _as_1d_int(row_ids, "row_ids")
    num_rows = check_count("num_rows", num_rows)
    is_torch = isinstance(row_ids, torch.Tensor)
    n = row_ids.shape[0]
    if is_torch:
        out_dtype = row_ids.dtype if dtype is None else dtype
        if not isinstance(out_dtype, torch.dtype) or not is_integer_dtype(out_dtype):
            raise TypeError(f"dtype must be a torch integer dtype, got {dtype}")
    else:
        out_dtype = row_ids.dtype if dtype is None else _numpy_dtype(dtype)
    _check_holds(out_dtype, n, "row_splits")
    if validate and n and not (is_torch and row_ids.is_cuda):
        lo, hi = int(row_ids.min()), int(row_ids.max())
        if lo < 0 or hi >= num_rows:
            raise ValueError(f"row_ids must lie in [0, num_rows={num_rows}), got values in [{lo}, {hi}]")
        if n > 1 and bool((row_ids[1:] < row_ids[:-1]).any()):
            raise ValueError("row_ids must be nondecreasing")
    if is_torch:
        if row_ids.is_cuda:
            from .ragged_cuda import row_ids_to_row_splits_cuda

            return row_ids_to_row_splits_cuda(row_ids, num_rows, out_dtype)
        counts = torch.bincount(row_ids.to(torch.int64), minlength=num_rows)[:num_rows]
        out = torch.zeros(num_rows + 1, dtype=out_dtype)
        out[1:] = counts.cumsum(0)
        return out
    counts = np.bincount(row_ids.astype(np.int64), minlength=num_rows)[:num_rows]
    out = np.zeros(num_rows + 1, dtype=out_dtype)
    out[1:] = np.cumsum(counts)
    return out


class RaggedShape:
    """A two-axis ragged shape: ``dim0`` rows holding ``numel`` elements in total.

    ``RaggedShape(row_splits, row_ids=None, num_elems=None)``: row_ids is computed
    lazily (on first access) when not given; ``num_elems`` avoids a host read of
    ``row_splits[-1]`` on CUDA (it is also taken from ``row_ids`` when given).
    ``RaggedShape.from_sizes(sizes, num_elems=None)`` builds row_splits = [0, cumsum(sizes)].
    ``row_ids_dtype`` (torch dtype / numpy dtype) picks the dtype of computed row_ids.
    """

    def __init__(self, row_splits, row_ids=None, num_elems=None, *, row_ids_dtype=None, validate=True):
        row_splits = _as_1d_int(row_splits, "row_splits")
        if validate:
            _validate_row_splits(row_splits)
        elif row_splits.shape[0] == 0:
            raise ValueError("row_splits must have at least one entry (num_rows + 1 >= 1)")
        self._validate = validate
        self.row_splits = row_splits
        self._row_ids_dtype = row_ids_dtype
        on_cuda = isinstance(row_splits, torch.Tensor) and row_splits.is_cuda
        if num_elems is not None:
            num_elems = check_count("num_elems", num_elems)
        if row_ids is not None:
            row_ids = _as_1d_int(row_ids, "row_ids")
            if isinstance(row_ids, torch.Tensor) != isinstance(row_splits, torch.Tensor):
                raise TypeError("row_ids and row_splits must both be torch tensors or both numpy arrays")
            if num_elems is not None and row_ids.shape[0] != num_elems:
                raise ValueError(f"row_ids has {row_ids.shape[0]} entries but num_elems={num_elems}")
            num_elems = row_ids.shape[0]
        if num_elems is not None and validate and not on_cuda:
            last = int(row_splits[-1])
            if last != num_elems:
                name = "row_ids" if row_ids is not None else "num_elems"
                raise ValueError(f"{name} gives {num_elems} elements but row_splits[-1]={last}")
        if row_ids is not None and validate and not on_cuda:
            ref = row_splits_to_row_ids(row_splits, num_elems, dtype=row_ids.dtype, validate=False)
            same = bool((ref == row_ids).all()) if isinstance(ref, torch.Tensor) else bool(np.array_equal(ref, row_ids))
            if not same:
                raise ValueError("row_ids does not match row_splits")
        self._row_ids = row_ids
        self._num_elems = num_elems

    @classmethod
    def from_sizes(cls, sizes, num_elems=None, **kw):
        sizes = _as_1d_int(sizes, "sizes")
        if isinstance(sizes, torch.Tensor):
            if not sizes.is_cuda and sizes.numel():
                if int(sizes.min()) < 0:
                    raise ValueError("sizes must be >= 0")
                _check_holds(sizes.dtype, int(sizes.sum(dtype=torch.int64)), "sizes' running sums (row_splits)")
            rs = torch.zeros(sizes.shape[0] + 1, dtype=sizes.dtype, device=sizes.device)
            if sizes.numel():
                rs[1:] = torch.cumsum(sizes, 0)
        else:
            if sizes.size and sizes.min() < 0:
                raise ValueError("sizes must be >= 0")
            _check_holds(sizes.dtype, int(sizes.sum(dtype=np.int64)), "sizes' running sums (row_splits)")
            rs = np.zeros(sizes.shape[0] + 1, dtype=sizes.dtype)
            rs[1:] = np.cumsum(sizes)
        return cls(rs, num_elems=num_elems, **kw)

    @property
    def dim0(self) -> int:
        return self.row_splits.shape[0] - 1

    @property
    def numel(self) -> int:
        if self._num_elems is None:
            self._num_elems = int(self.row_splits[-1])
        return self._num_elems

    def tot_size(self, axis: int) -> int:
        if axis == 0:
            return self.dim0
        if axis == 1:
            return self.numel
        raise ValueError(f"axis must be 0 or 1, got {axis}")

    @property
    def row_ids(self):
        if self._row_ids is None:
            self._row_ids = row_splits_to_row_ids(
                self.row_splits, self.numel, dtype=self._row_ids_dtype, validate=False
            )
        return self._row_ids

    @property
    def device(self):
        return self.row_splits.device if isinstance(self.row_splits, torch.Tensor) else "cpu"

    def row_sizes(self):
        return self.row_splits[1:] - self.row_splits[:-1]

    def __repr__(self):
        n = self._num_elems if self._num_elems is not None else "?"
        return f"RaggedShape(dim0={self.dim0}, numel={n})"
