"""ops: the primitives under the transducer loss: fast_divmod, gather, reduce (torch on CPU, CUDA kernels).

- ``FastDivmod(d)``: division by invariant integers (Granlund-Montgomery); the host methods perform
  the exact 32-bit device arithmetic of ``fast_divmod.cuh``.
- ``gather(params, indices, axis=None, batch_dims=0, *, shard_offset=None, ...)`` and
  ``sharded_gather``: numpy.take / tf.gather semantics.
- ``reduce(x, axis, op)``: sum / max / logsumexp over one axis.
- ``ops.numeric``: ``exp_`` and ``logsumexp`` for CPU tensors without MKL's vector math (the CPU stages).
- dtype conventions: ``accumulate_dtype``, ``is_integer_dtype``, ``is_index_dtype``, ``check_index_dtype``,
  ``check_count``, ``ctype``, ``FLOAT_DTYPES``, ``INDEX_DTYPES``.
- ``ops.cuda``: the one launch path of every kernel (``launch``, ``vector_width``, ...), and
  ``cuda_include_dir()``, the ``-I`` folder of the device headers ``ops/numeric.cuh`` (types,
  conversions, math), ``ops/reduce.cuh`` (sum / max / logsumexp states, warp and block merges) and
  ``ops/fast_divmod.cuh``.
"""

from .cuda import cuda_include_dir
from .dtypes import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    accumulate_dtype,
    check_count,
    check_index_dtype,
    ctype,
    is_index_dtype,
    is_integer_dtype,
)
from .fast_divmod import MAX_DIVISOR, MAX_NUMERATOR, FastDivmod
from .gather import gather, sharded_gather
from .reduce import REDUCE_OPS, reduce

__all__ = [
    "FastDivmod",
    "MAX_DIVISOR",
    "MAX_NUMERATOR",
    "gather",
    "sharded_gather",
    "reduce",
    "REDUCE_OPS",
    "accumulate_dtype",
    "is_integer_dtype",
    "is_index_dtype",
    "check_index_dtype",
    "check_count",
    "ctype",
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "cuda_include_dir",
]
