"""CPU exponentials for the stages' passes over the logits (the host twin of numeric.cuh's math).

torch's ``exp`` and ``log`` on CPU call MKL's vector math (VML) where torch is built with MKL (the PyPI
wheels): once per contiguous run, so once per row of a strided view (a (N, V) column slice of NeMo's
(N, V + D) TDT joint: 24800 calls a chunk), and MKL threads even a few hundred elements, whose fork and join
cost more than the work on a many-core host (a TDT walk step's (B, 2D + 1, U + 1) terms). ``exp2`` is
torch's own vectorised loop (Sleef): one loop over any layout, threaded only past torch's grain size
(DESIGN.md: exp2, not MKL's exp, on the CPU).

- ``exp_(x)``: x = exp(x) in place, as exp2(x * log2(e)).
- ``logsumexp(x, dim, out=None)``: torch.logsumexp's values and conventions (the max is taken as 0 where
  it is infinite: all -inf gives -inf, a +inf gives +inf; NaN propagates; an empty dim gives -inf), through
  ``exp_`` and ``log1p(s - 1)`` (s >= 1 for a finite max; log1p is not VML either).

Both take float32 / float64 tensors (the stages' accumulation dtypes; in 16 bits the product's rounding would
cost about 1% in exp2) and give values only, no autograd (the stages run without it; ``ops.reduce`` hands a
tensor that requires grad to torch.logsumexp).
"""

from __future__ import annotations

import math

import torch

__all__ = ["exp_", "logsumexp", "LOG2E"]

LOG2E = 1.0 / math.log(2.0)


def _check(x):
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float64) or x.is_cuda:
        got = f"a {x.dtype} tensor on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x: expected a float32 or float64 CPU tensor, got {got}")


def exp_(x: torch.Tensor) -> torch.Tensor:
    """``x.exp_()`` computed as exp2(x * log2(e)), in place; returns x. Floating CPU tensors of any layout.
    Relative error: up to (|x| + 2) ulps of x's dtype (log2 e and the product rounded to it move the exponent);
    the stages take exp of x - max <= 0, where the terms that matter have |x| < 30."""
    _check(x)
    return x.mul_(LOG2E).exp2_()


def logsumexp(x: torch.Tensor, dim: int, out: torch.Tensor = None) -> torch.Tensor:
    """``torch.logsumexp(x, dim)`` (into ``out`` when given: the result's shape and x's dtype) without MKL's
    exp and log (see the module's docstring)."""
    _check(x)
    if x.size(dim) == 0:
        shape = x.shape[: dim % x.dim()] + x.shape[dim % x.dim() + 1 :]
        return out.fill_(-math.inf) if out is not None else x.new_full(shape, -math.inf)
    m = x.amax(dim, keepdim=True)
    m.masked_fill_(torch.isinf(m), 0.0)
    s = exp_(torch.sub(x, m)).sum(dim)
    return torch.log1p(s.sub_(1.0), out=out).add_(m.squeeze(dim))
