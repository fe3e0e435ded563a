"""Division by invariant integers (Granlund & Montgomery 1994, fig. 4.1).

For a divisor ``d`` fixed ahead of time the host computes

    l = ceil(log2 d)                                  (0 <= l <= 31)
    m = floor(2^32 * (2^l - d) / d) + 1               (1 <= m < 2^32)

and a numerator ``0 <= n < 2^31`` is divided with one multiply-high, one add
and one shift, all in 32-bit unsigned arithmetic:

    q = (umulhi(m, n) + n) >> l        umulhi(a, b) = (a * b) >> 32 (64-bit product)
    r = n - q * d

The host methods below perform exactly this arithmetic (in 64-bit integers
that cannot overflow: m < 2^32 and n < 2^31 give m * n < 2^63, and
umulhi(m, n) + n < 2^32), so the CPU tests over edge divisors and numerators
prove the device formula in ``fast_divmod.cuh``.

Range: 1 <= d <= 2^31 and 0 <= n < 2^31. d = 2^31 works (l = 31, m = 1, q = 0
for every n < 2^31); d > 2^31 would need l = 32, a shift the 32-bit device
code cannot do, and is rejected. The restriction n < 2^31 keeps the 32-bit sum
``umulhi(m, n) + n`` from wrapping.
"""

from __future__ import annotations

import functools
import numbers

import numpy as np
import torch

from .dtypes import is_integer_dtype
from .params import FAST_DIVMOD

__all__ = ["FastDivmod", "MAX_DIVISOR", "MAX_NUMERATOR"]

MAX_DIVISOR = 1 << 31
#: numerators must be < MAX_NUMERATOR
MAX_NUMERATOR = 1 << 31


def _constants(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(m, l) as int64 arrays for int64 divisors 1 <= d <= 2^31: the one computation of the constants."""
    # l = ceil(log2 d): the exponent of (d - 1) in frexp, exact for d <= 2^31; 0 for d == 1
    l = np.where(d > 1, np.frexp((d - 1).astype(np.float64))[1], 0).astype(np.int64)
    # m = floor(2^32 (2^l - d) / d) + 1; 2^32 * (2^l - d) < 2^63 since 2^l - d < d <= 2^31
    m = ((np.int64(1) << 32) * ((np.int64(1) << l) - d)) // d + 1
    return m, l


@functools.lru_cache(maxsize=4096)
def _scalar_constants(d: int) -> tuple[int, int]:
    """``_constants`` of one divisor, as Python ints; memoised, since launchers build one per launch."""
    m, l = _constants(np.array([d], dtype=np.int64))
    return int(m[0]), int(l[0])


class FastDivmod:
    """Precomputed constants for dividing by ``d`` (an int, or a 1-D array of divisors).

    ``FastDivmod(7).divmod(n)`` == ``(n // 7, n % 7)`` for 0 <= n < 2^31, using the
    device formula. With a 1-D array/tensor of divisors the object is vectorised:
    ``d``, ``m``, ``l`` are arrays and broadcast against ``n`` with numpy rules
    (e.g. per-row divisors of shape (R,) against numerators of shape (R,) or (K, R)).

    Attributes ``d``, ``m``, ``l`` are Python ints (scalar) or uint32 numpy arrays
    (vectorised). ``params()`` gives a scalar divisor's constants as the field of a
    kernel's parameter struct (ops.params.FAST_DIVMOD, ``struct FastDivmod``);
    ``as_tensor(device)`` gives an (..., 3) int64 tensor [d, m, l].
    """

    __slots__ = ("d", "m", "l", "_vector", "_cache")

    def __init__(self, d):
        self._cache = {}
        if isinstance(d, torch.Tensor) or isinstance(d, np.ndarray):
            arr = d.detach().cpu().numpy() if isinstance(d, torch.Tensor) else d
            if not is_integer_dtype(arr.dtype):
                raise TypeError(f"d must hold integers, got dtype {arr.dtype}")
            if arr.ndim == 0:
                self.__init__(int(arr))
                return
            if arr.ndim != 1:
                raise ValueError(f"d must be an int or a 1-D array of divisors, got shape {tuple(arr.shape)}")
            a = arr.astype(np.int64)
            if a.size and (a.min() < 1 or a.max() > MAX_DIVISOR):
                bad = a[(a < 1) | (a > MAX_DIVISOR)][0]
                raise ValueError(f"d must satisfy 1 <= d <= 2^31, got {int(bad)}")
            m, l = _constants(a)
            self.d = a.astype(np.uint32)
            self.m = m.astype(np.uint32)
            self.l = l.astype(np.uint32)
            self._vector = True
            return
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
            raise TypeError(f"d must be an int or a 1-D integer array, got {type(d).__name__}")
        d = int(d)
        if not 1 <= d <= MAX_DIVISOR:
            raise ValueError(f"d must satisfy 1 <= d <= 2^31, got {d}")
        self.m, self.l = _scalar_constants(d)
        self.d = d
        self._vector = False

    # ------------------------------------------------------------------ info
    @property
    def vectorised(self) -> bool:
        return self._vector

    def __len__(self):
        if not self._vector:
            raise TypeError("scalar FastDivmod has no len()")
        return len(self.d)

    def __repr__(self):
        if self._vector:
            return f"FastDivmod(d=array(len={len(self.d)}))"
        return f"FastDivmod(d={self.d}, m={self.m}, l={self.l})"

    def params(self):
        """The constants of a scalar divisor as ops.params.FAST_DIVMOD, for a field of a kernel's parameter
        struct."""
        if self._vector:
            raise TypeError("params() needs a scalar divisor")
        return FAST_DIVMOD(self.d, self.m, self.l)

    def as_tensor(self, device=None) -> torch.Tensor:
        """(3,) or (len, 3) int64 tensor of [d, m, l] (for torch-side use or upload)."""
        if self._vector:
            t = np.stack([self.d, self.m, self.l], axis=-1).astype(np.int64)
        else:
            t = np.array([self.d, self.m, self.l], dtype=np.int64)
        return torch.from_numpy(t).to(device)

    # ------------------------------------------------------------ arithmetic
    def _consts_for(self, n):
        """d, m, l in n's array family (int64), cached per torch device."""
        if not self._vector:
            return self.d, self.m, self.l
        if isinstance(n, torch.Tensor):
            key = n.device
            c = self._cache.get(key)
            if c is None:
                c = tuple(torch.from_numpy(x.astype(np.int64)).to(n.device) for x in (self.d, self.m, self.l))
                self._cache[key] = c
            return c
        c = self._cache.get("np")
        if c is None:
            c = tuple(x.astype(np.int64) for x in (self.d, self.m, self.l))
            self._cache["np"] = c
        return c

    @staticmethod
    def _as_int64(n):
        if isinstance(n, torch.Tensor):
            if not is_integer_dtype(n.dtype):
                raise TypeError(f"n must hold integers, got dtype {n.dtype}")
            return n.to(torch.int64), "torch"
        if isinstance(n, numbers.Integral) and not isinstance(n, bool):
            if not -(2**63) <= int(n) < 2**63:  # past int64, which the range check reads n as
                raise ValueError(f"n must satisfy 0 <= n < 2^31, got {int(n)}")
            return np.int64(n), "int"
        arr = np.asarray(n)
        if not is_integer_dtype(arr.dtype):
            raise TypeError(f"n must hold integers, got dtype {arr.dtype}")
        return arr.astype(np.int64), "numpy"

    @staticmethod
    def _check_range(n, kind):
        if kind == "torch":
            if n.numel() == 0:
                return
            lo, hi = torch.aminmax(n)
            lo, hi = int(lo), int(hi)
        else:
            if np.size(n) == 0:
                return
            lo, hi = int(np.min(n)), int(np.max(n))
        if lo < 0 or hi >= MAX_NUMERATOR:
            raise ValueError(f"n must satisfy 0 <= n < 2^31, got values in [{lo}, {hi}]")

    def divmod(self, n, check: bool = True):
        """(q, r) with q = n // d, r = n % d by the 32-bit device formula.

        Results are int64 (torch tensor for a tensor n, numpy otherwise; numpy int64
        scalars for an int n). ``check=False`` skips the 0 <= n < 2^31 test (a host
        sync for CUDA tensors) for callers that know their range.
        """
        n, kind = self._as_int64(n)
        if check:
            self._check_range(n, kind)
        d, m, l = self._consts_for(n)
        # umulhi(m, n): m < 2^32, n < 2^31 -> product < 2^63, no int64 overflow
        q = ((m * n) >> 32) + n
        q = q >> l
        r = n - q * d
        return q, r

    def div(self, n, check: bool = True):
        return self.divmod(n, check)[0]

    def mod(self, n, check: bool = True):
        return self.divmod(n, check)[1]
