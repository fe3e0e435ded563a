"""reduce(x, axis, op): sum / max / logsumexp over one axis.

The input is seen as (outer, R, inner) with R = x.shape[axis]:
- axis = last (inner == 1): one warp per row on CUDA (one block, or several
  blocks plus a combine pass, for long rows) -- the transducer's ``den``;
- axis = 0 (outer == 1, the highest axis reduced with the rest flattened: the
  case of Paddle's ReduceHigherDimKernel, paddle/phi/kernels/funcs/reduce_function.h):
  tiles of 32 inner columns x 8 row-slices per block, R split across blocks when
  the grid would otherwise be too small;
- anything else: the same tiled kernel with an outer grid dimension.

Dtypes: float16 / bfloat16 accumulate in float32 and return float32; float32
and float64 return their own dtype. Empty axis: sum 0, max -inf, logsumexp -inf.
logsumexp follows torch: m = max (0 where it is +-inf), result = log(sum(exp(x - m))) + m,
so an all -inf slice gives -inf and any +inf gives +inf; max and logsumexp propagate NaN.
numpy inputs return numpy arrays, torch inputs torch tensors (CUDA via reduce.cu).
"""

from __future__ import annotations

import numpy as np
import torch

from .dtypes import FLOAT_DTYPES, accumulate_dtype
from .numeric import logsumexp

__all__ = ["reduce", "REDUCE_OPS"]

REDUCE_OPS = ("sum", "max", "logsumexp")


def reduce(x, axis, op, *, keepdim=False, out=None):
    """Reduce ``x`` over ``axis`` (negative allowed) with ``op`` in ("sum", "max", "logsumexp").

    Returns float32 for float16/bfloat16/float32 inputs, float64 for float64.
    ``out`` (torch only): tensor of the result shape and dtype to write into.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    is_np = not isinstance(x, torch.Tensor)
    if is_np:
        if out is not None:
            raise TypeError("out is only supported for torch tensors")
        xn = np.asarray(x)
        if xn.dtype not in (np.float16, np.float32, np.float64):
            raise TypeError(f"x must be a float16/float32/float64 array, got dtype {xn.dtype}")
        if not xn.flags.c_contiguous and not xn.flags.f_contiguous:
            xn = np.ascontiguousarray(xn)
        x = torch.from_numpy(xn)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got dtype {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int, got {type(axis).__name__}")
    nd = x.dim()
    a = int(axis) + nd if axis < 0 else int(axis)
    if not 0 <= a < nd:
        raise ValueError(f"axis={axis} out of range for x of rank {nd}")
    acc = accumulate_dtype(x.dtype)
    res_shape = list(x.shape)
    if keepdim:
        res_shape[a] = 1
    else:
        del res_shape[a]
    res_shape = tuple(res_shape)
    if out is not None and (tuple(out.shape) != res_shape or out.dtype != acc or out.device != x.device):
        raise ValueError(
            f"out must have shape {res_shape}, dtype {acc}, device {x.device}; "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )

    if x.is_cuda:
        from .reduce_cuda import reduce_cuda

        res = reduce_cuda(x, a, op, res_shape, out)
    else:
        res = _reduce_cpu(x, a, op, acc, keepdim)
        if out is not None:
            out.copy_(res)
            res = out
    return res.numpy() if is_np else res


def _reduce_cpu(x, a, op, acc, keepdim):
    if x.shape[a] == 0:
        shape = list(x.shape)
        if keepdim:
            shape[a] = 1
        else:
            del shape[a]
        fill = 0.0 if op == "sum" else float("-inf")
        return torch.full(shape, fill, dtype=acc)
    if op == "sum":
        return x.sum(a, keepdim=keepdim, dtype=acc)
    if op == "max":  # exact in the input dtype; widen the (smaller) result
        return x.amax(a, keepdim=keepdim).to(acc)
    xa = x if x.dtype == acc else x.to(acc)
    if xa.requires_grad and torch.is_grad_enabled():  # ops.numeric gives values only
        return torch.logsumexp(xa, a, keepdim=keepdim)
    res = logsumexp(xa, a)  # torch.logsumexp's values without MKL's exp (ops/numeric.py)
    return res.unsqueeze(a) if keepdim else res
