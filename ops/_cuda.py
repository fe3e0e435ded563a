"""CuPy glue shared by every launcher (ops, ragged, transducer; imported only for CUDA tensors).

- ``launch(path, name, t, grid, block, args)``: one kernel launch on torch's
  *current* stream of ``t``'s device (no host sync, capturable by
  ``torch.cuda.CUDAGraph``), with the least host work: the compiled function is
  cached per (file, kernel, device) and called directly;
- ``load_module(path)``: the ``cupy.RawModule`` compiled from a ``.cu`` file with
  ``-std=c++17 -I<ops dir>``, cached per (file, device);
- ``ptr(t)``: a tensor's device pointer as ``numpy.uint64`` (8 bytes, what a
  ``T*`` kernel parameter takes; a Python int does as well).
Scalar kernel arguments must be numpy scalars of the exact C type
(numpy.int32 for int, numpy.int64 for long long, numpy.uint32 for unsigned).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading

import numpy as np
import torch

OPS_DIR = os.path.dirname(os.path.abspath(__file__))

_lock = threading.Lock()
_modules: dict = {}


def cupy():
    try:
        import cupy as cp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "CUDA tensors need CuPy: pip install -e '.[cuda]' (cupy-cuda13x) or '.[cuda12]'"
        ) from e
    return cp


@functools.lru_cache(maxsize=None)
def _headers_digest(include_dirs):
    """A hash of every header the kernels may include: CuPy's on-disk cache keys on the
    source text and options only, so an edited header must change the source."""
    h = hashlib.sha1()
    for d in include_dirs:
        for name in sorted(os.listdir(d)):
            if name.endswith(".cuh"):
                with open(os.path.join(d, name), "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def load_module(path: str, extra_include_dirs=(), name_expressions=()):
    """RawModule for the .cu file at ``path`` on the current CuPy device (cached).

    ``name_expressions`` names the template instantiations to compile (see
    ``cupy.RawModule``); each distinct tuple is its own module."""
    cp = cupy()
    dev = cp.cuda.Device().id
    key = (path, dev, tuple(extra_include_dirs), tuple(name_expressions))
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                include_dirs = (OPS_DIR,) + tuple(extra_include_dirs)
                with open(path) as f:
                    code = f"// headers {_headers_digest(include_dirs)}\n" + f.read()
                opts = ("-std=c++17",) + tuple(f"-I{d}" for d in include_dirs)
                mod = cp.RawModule(code=code, options=opts, name_expressions=tuple(name_expressions) or None)
                _modules[key] = mod
    return mod


def _current_raw_stream(device_id: int) -> int:
    """torch's current stream as a raw cudaStream_t (torch's private fast path when present)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device_id) if raw is not None else torch.cuda.current_stream(device_id).cuda_stream


class _RawStream:
    """What a CuPy kernel call reads from its ``stream`` argument: the raw handle, as ``ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


_functions: dict = {}
_raw_streams: dict = {}
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _function(path, name, include_dirs, dev):
    """The cupy Function for ``name`` of ``path``, loaded on device ``dev``."""
    cp = cupy()
    with cp.cuda.Device(dev):
        fn = load_module(path, include_dirs, (name,) if name.endswith(">") else ()).get_function(name).kernel
    _functions[(path, name, dev)] = fn
    return fn


def launch(path: str, name: str, t: torch.Tensor, grid, block, args, shared_mem: int = 0, include_dirs=()):
    """Launch kernel ``name`` (an extern "C" name or a template instantiation) of the .cu file at
    ``path`` on torch's current stream of ``t``'s device. ``args``: tensors (passed as their device
    pointers), other scalars numpy scalars of the exact C type.

    Pass tensors, not ``x.contiguous().data_ptr()``: ``args`` holds every tensor until the kernel is
    queued, whereas a temporary copy whose pointer alone is kept is freed at once, and its memory may
    be handed to the next temporary before the kernel runs."""
    args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    dev = t.get_device()
    fn = _functions.get((path, name, dev)) or _function(path, name, tuple(include_dirs), dev)
    handle = _current_raw_stream(dev)
    stream = _raw_streams.get(handle) or _raw_streams.setdefault(handle, _RawStream(handle))
    if _current_device() == dev:
        fn(grid, block, args, shared_mem, stream)
    else:  # the function belongs to dev's context
        with torch.cuda.device(dev):
            fn(grid, block, args, shared_mem, stream)


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


@functools.lru_cache(maxsize=None)
def _device_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_sms(t) -> int:
    """Multiprocessors of the device of tensor (or torch.device) ``t``."""
    return _device_sms(t if isinstance(t, torch.device) else t.device)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
