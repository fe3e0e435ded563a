"""ops: fast_divmod, gather, reduce (numpy/torch on CPU, CuPy kernels on GPU).

- ``FastDivmod(d)``: division by invariant integers (Granlund-Montgomery); host
  methods perform the exact 32-bit device arithmetic of ``fast_divmod.cuh``.
- ``gather(params, indices, axis=None, batch_dims=0, *, shard_offset=None, ...)``
  and ``sharded_gather``: numpy.take / tf.gather semantics.
- ``reduce(x, axis, op)``: sum / max / logsumexp over one axis.
- ``cuda_include_dir()`` / ``CUDA_INCLUDE_DIR``: the directory holding
  ``fast_divmod.cuh`` (pass ``-I`` + it to a CuPy RawModule).
"""

import os as _os

from .fast_divmod import FAST_DIVMOD_DTYPE, MAX_DIVISOR, MAX_NUMERATOR, FastDivmod
from .gather import gather, sharded_gather
from .reduce import REDUCE_OPS, reduce

CUDA_INCLUDE_DIR = _os.path.dirname(_os.path.abspath(__file__))


def cuda_include_dir() -> str:
    """Directory holding fast_divmod.cuh, for ``-I`` in RawModule options."""
    return CUDA_INCLUDE_DIR


__all__ = [
    "FastDivmod", "FAST_DIVMOD_DTYPE", "MAX_DIVISOR", "MAX_NUMERATOR",
    "gather", "sharded_gather", "reduce", "REDUCE_OPS",
    "cuda_include_dir", "CUDA_INCLUDE_DIR",
]
