"""gather: numpy.take / tf.gather semantics with batch_dims, plus a sharded variant.

Shapes (``bd`` = batch_dims, ``a`` = axis):

    out.shape = params.shape[:a] + indices.shape[bd:] + params.shape[a+1:]
    params.shape[:bd] == indices.shape[:bd]              (bd <= a)

Everything is flattened to

    params  (B, O, G, K)   B = prod(params.shape[:bd]), O = prod(params.shape[bd:a]),
                           G = params.shape[a],        K = prod(params.shape[a+1:])
    indices (B, I)         I = prod(indices.shape[bd:])
    out     (B, O, I, K)   out[b, o, i, k] = params[b, o, indices[b, i], k]

and a flat output position is split into (b, o, i, k) with FastDivmod, as ONNX
Runtime's Gather splits its flat index with ``fast_divmod``
(onnxruntime/core/providers/cuda/tensor/gather_impl.cu). On CPU the split is done
per output *row* (b, o, i) and whole K-rows are copied (vectorised torch/numpy, no
Python loop over elements); the CUDA kernel (gather.cu) splits per output word,
in 16-byte words where the row's bytes allow (OneFlow's gather primitive moves
rows the same way: oneflow/user/kernels/gather_kernel_util.cu).

Indices: negative values wrap (idx + G); values outside [-G, G) raise
``IndexError`` naming ``indices`` (the check costs one host sync for CUDA
tensors); with ``check_bounds=False`` they produce zeros instead (no sync).

Sharded variant (params split along ``axis``, OneFlow's gather of a tensor split
along the gathered axis, whose kernel takes the shard's ``offset`` and writes zeros
for indices outside the shard; the partial results are then summed): pass
``shard_offset=k``; params then holds rows [k, k + params.shape[axis]) of the
full tensor along ``axis``, indices are *global*, and every index outside the
shard gives 0, so summing the results of all shards gives the full gather.
Negative indices wrap by ``full_size`` (the full tensor's length along ``axis``)
when it is given, and are an error otherwise; with ``full_size`` given and
``check_bounds=True`` indices outside [-full_size, full_size) raise.
``sharded_gather(params_shard, indices, axis, shard_offset, ...)`` is the same call.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .dtypes import check_count, check_index_dtype
from .fast_divmod import MAX_NUMERATOR, FastDivmod

__all__ = ["gather", "sharded_gather"]


class _Plan:
    __slots__ = ("B", "O", "G", "K", "I", "out_shape", "axis", "batch_dims")


def _plan(pshape, ishape, axis, batch_dims) -> _Plan:
    nd, ni = len(pshape), len(ishape)
    if not isinstance(batch_dims, (int, np.integer)) or isinstance(batch_dims, bool):
        raise TypeError(f"batch_dims must be an int, got {type(batch_dims).__name__}")
    bd = int(batch_dims)
    if bd < 0:
        bd += ni
    if not 0 <= bd <= ni:
        raise ValueError(f"batch_dims={batch_dims} out of range for indices of rank {ni}")
    if axis is None:
        axis = bd
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int, got {type(axis).__name__}")
    a = int(axis)
    if a < 0:
        a += nd
    if not 0 <= a < nd:
        raise ValueError(f"axis={axis} out of range for params of rank {nd}")
    if bd > a:
        raise ValueError(f"batch_dims={batch_dims} must be <= axis={axis}")
    if tuple(pshape[:bd]) != tuple(ishape[:bd]):
        raise ValueError(
            f"the first batch_dims={bd} dims of params {tuple(pshape)} and indices {tuple(ishape)} must match"
        )
    p = _Plan()
    p.B = math.prod(pshape[:bd])
    p.O = math.prod(pshape[bd:a])
    p.G = int(pshape[a])
    p.K = math.prod(pshape[a + 1 :])
    p.I = math.prod(ishape[bd:])
    p.out_shape = tuple(pshape[:a]) + tuple(ishape[bd:]) + tuple(pshape[a + 1 :])
    p.axis, p.batch_dims = a, bd
    return p


def _index_array(indices):
    """``indices`` as a numpy array; an empty list or tuple, which numpy types as float64, as int64 (np.take
    takes it)."""
    array = np.asarray(indices)
    return array.astype(np.int64) if array.size == 0 and isinstance(indices, (list, tuple)) else array


def _bounds(idx, is_torch):
    if is_torch:
        lo, hi = torch.aminmax(idx)
        return int(lo), int(hi)
    return int(idx.min()), int(idx.max())


def gather(params, indices, axis=None, batch_dims=0, *, shard_offset=None, full_size=None, check_bounds=True, out=None):
    """numpy.take / tf.gather(params, indices, axis, batch_dims).

    ``axis`` defaults to ``batch_dims`` (0 without batch dims), as in tf.gather.
    ``params``/``indices``: numpy arrays or torch tensors (CPU or CUDA; indices are
    moved to params' family/device). Returns the same family as ``params``.
    ``out`` (torch only): a contiguous tensor of the output shape and dtype to write.
    See the module docstring for ``shard_offset``/``full_size``/``check_bounds``.
    """
    is_torch = isinstance(params, torch.Tensor)
    if not is_torch:
        params = np.asarray(params)
        if isinstance(indices, torch.Tensor):
            indices = indices.detach().cpu().numpy()
        indices = _index_array(indices)
        if out is not None:
            raise TypeError("out is only supported for torch tensors")
    else:
        if not isinstance(indices, torch.Tensor):
            indices = torch.as_tensor(_index_array(indices))
        if indices.device != params.device:
            indices = indices.to(params.device)
    check_index_dtype("indices", indices.dtype)
    plan = _plan(tuple(params.shape), tuple(indices.shape), axis, batch_dims)
    G = plan.G

    sharded = shard_offset is not None
    if sharded:
        shard_offset = check_count("shard_offset", shard_offset)
        if full_size is not None:
            full_size = check_count("full_size", full_size)
            if full_size < shard_offset + G:
                raise ValueError(
                    f"full_size={full_size} is smaller than shard_offset + shard length ({shard_offset} + {G})"
                )
        wrap = full_size  # None: negative indices are an error
        offset = shard_offset
    else:
        if full_size is not None:
            raise ValueError("full_size only applies with shard_offset")
        wrap, offset = G, 0

    if out is not None:
        if tuple(out.shape) != plan.out_shape or out.dtype != params.dtype or out.device != params.device:
            raise ValueError(
                f"out must have shape {plan.out_shape}, dtype {params.dtype}, device {params.device}; "
                f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
            )

    # bounds: one min/max over indices (host sync on CUDA)
    lo = hi = None
    if indices.numel() if is_torch else indices.size:
        need_lo = check_bounds or (sharded and wrap is None)
        if need_lo:
            lo, hi = _bounds(indices, is_torch)
            if sharded and wrap is None and lo < 0:
                raise IndexError(
                    f"indices has negative values (min {lo}); pass full_size to let them wrap in a sharded gather"
                )
            if check_bounds:
                bound = wrap if wrap is not None else None
                if bound is not None and (lo < -bound or hi >= bound):
                    raise IndexError(f"indices out of range: values in [{lo}, {hi}] for an axis of size {bound}")

    if is_torch and params.is_cuda:
        from .gather_cuda import gather_cuda

        return gather_cuda(params, indices, plan, offset, wrap, out)

    # what the bounds check proved: no negatives to wrap / nothing to mask
    need_wrap = lo is None or lo < 0
    need_mask = sharded or not check_bounds
    res = _gather_cpu(params, indices, plan, offset, wrap if need_wrap else None, need_mask, is_torch)
    if out is not None:
        out.copy_(res)
        return out
    return res


def sharded_gather(
    params_shard, indices, axis=None, shard_offset=0, *, full_size=None, batch_dims=0, check_bounds=True, out=None
):
    """gather from a shard holding rows [shard_offset, shard_offset + len) of ``axis``;
    indices outside the shard give 0 (sum over shards == full gather)."""
    return gather(
        params_shard,
        indices,
        axis,
        batch_dims,
        shard_offset=shard_offset,
        full_size=full_size,
        check_bounds=check_bounds,
        out=out,
    )


def _gather_cpu(params, indices, plan, offset, wrap, need_mask, is_torch):
    B, O, G, K, I = plan.B, plan.O, plan.G, plan.K, plan.I
    n_rows = B * O * I
    if is_torch:
        idx = indices.reshape(-1).to(torch.int64)
    else:
        idx = indices.reshape(-1).astype(np.int64, copy=False)
    where = torch.where if is_torch else np.where
    if n_rows == 0 or K == 0:
        return params.new_zeros(plan.out_shape) if is_torch else np.zeros(plan.out_shape, dtype=params.dtype)
    # wrap negatives, localise to the shard, mask everything outside [0, G)
    if wrap is not None:
        idx = where(idx < 0, idx + wrap, idx)
    if offset:
        idx = idx - offset
    if need_mask:
        valid = (idx >= 0) & (idx < G)
        all_valid = bool(valid.all())
    else:
        valid, all_valid = None, True
    if G == 0:
        return params.new_zeros(plan.out_shape) if is_torch else np.zeros(plan.out_shape, dtype=params.dtype)
    if not all_valid:
        idx = where(valid, idx, 0)

    # fast path: per-row pick along the last axis (B, G) x (B, I) -> (B, I) == torch.gather
    if O == 1 and K == 1 and plan.batch_dims > 0:
        if is_torch:
            res = torch.gather(params.reshape(B, G), 1, idx.reshape(B, I))
        else:
            res = np.take_along_axis(params.reshape(B, G), idx.reshape(B, I), axis=1)
        if not all_valid:
            res = _zero_rows(res.reshape(-1, 1), valid, is_torch, B, O, I)
        return res.reshape(plan.out_shape)

    # general path: output row r in [0, B*O*I) -> (b, o, i) by FastDivmod
    if n_rows < MAX_NUMERATOR:
        r = torch.arange(n_rows, dtype=torch.int64) if is_torch else np.arange(n_rows, dtype=np.int64)
        if B > 1:
            b, rem = FastDivmod(O * I).divmod(r, check=False)
        else:
            b, rem = 0, r
        o, i = FastDivmod(I).divmod(rem, check=False)
    else:  # beyond the 32-bit device formula's range: plain 64-bit division
        r = torch.arange(n_rows, dtype=torch.int64) if is_torch else np.arange(n_rows, dtype=np.int64)
        b, rem = r // (O * I), r % (O * I)
        o, i = rem // I, rem % I
    src = (b * O + o) * G + idx[b * I + i]
    p2 = params.reshape(B * O * G, K)
    if is_torch:
        res = p2.index_select(0, src)
    else:
        res = np.take(p2, src, axis=0)
    if not all_valid:
        res = _zero_rows(res, valid, is_torch, B, O, I)
    return res.reshape(plan.out_shape)


def _zero_rows(res, valid, is_torch, B, O, I):
    """Zero output rows (b, o, i) whose index was invalid; valid is (B*I,)."""
    if O > 1:
        v = valid.reshape(B, 1, I)
        v = v.expand(B, O, I) if is_torch else np.broadcast_to(v, (B, O, I))
        v = v.reshape(-1)
    else:
        v = valid
    if is_torch:
        return torch.where(v.reshape(-1, 1), res, torch.zeros((), dtype=res.dtype))
    return np.where(v.reshape(-1, 1), res, np.zeros((), dtype=res.dtype))
