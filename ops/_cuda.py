"""CuPy glue shared by the ops and ragged launchers (imported only for CUDA tensors).

- ``load_module(path)``: a ``cupy.RawModule`` compiled from a ``.cu`` file with
  ``-std=c++17 -I<ops dir>``, cached per (file, device);
- ``torch_stream(tensor)``: context manager that selects the tensor's device
  and makes CuPy launch on torch's *current* stream (no host sync, capturable
  by ``torch.cuda.CUDAGraph``);
- ``ptr(t)``: a tensor's device pointer as ``numpy.uint64`` (8 bytes, what a
  ``T*`` kernel parameter takes);
- ``launch(path, name, t, grid, block, args)``: one kernel launch on torch's
  current stream of ``t``'s device with the least host work (the loss's hot
  path): the compiled function is cached, no context managers are entered.
Scalar kernel arguments must be numpy scalars of the exact C type
(numpy.int32 for int, numpy.int64 for long long, numpy.uint32 for unsigned).
"""

from __future__ import annotations

import contextlib
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


class _StreamHandle:
    """A raw cudaStream_t seen through the CUDA stream protocol (what CuPy 14's Stream.from_external takes)."""

    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _external_stream(cp, handle: int, device_id: int):
    try:
        return cp.cuda.Stream.from_external(_StreamHandle(handle))
    except (AttributeError, TypeError):  # CuPy < 14
        return cp.cuda.ExternalStream(handle, device_id)


def _current_raw_stream(device_id: int) -> int:
    """torch's current stream as a raw cudaStream_t (torch's private fast path when present)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device_id) if raw is not None else torch.cuda.current_stream(device_id).cuda_stream


_streams: dict = {}


@contextlib.contextmanager
def torch_stream(t: torch.Tensor):
    """Launch CuPy kernels on torch's current stream of ``t``'s device."""
    cp = cupy()
    dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
    with cp.cuda.Device(dev):
        handle = _current_raw_stream(dev)
        # the wrapper only holds the handle; cache it (cheap launches, capture-safe)
        s = _streams.get((handle, dev))
        if s is None:
            s = _streams[(handle, dev)] = _external_stream(cp, handle, dev)
        with s:
            yield cp


class _RawStream:
    """What a CuPy kernel call reads from its ``stream`` argument: the raw handle, as ``ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


_functions: dict = {}
_raw_streams: dict = {}


def _function(path, name, include_dirs, dev):
    """The cupy Function for ``name`` of ``path``, loaded on device ``dev``."""
    cp = cupy()
    with cp.cuda.Device(dev):
        fn = load_module(path, include_dirs, (name,) if name.endswith(">") else ()).get_function(name).kernel
    _functions[(path, name, dev)] = fn
    return fn


def launch(path: str, name: str, t: torch.Tensor, grid, block, args, shared_mem: int = 0, include_dirs=()):
    """Launch kernel ``name`` (an extern "C" name or a template instantiation) of the .cu file at
    ``path`` on torch's current stream of ``t``'s device. Arguments as for a CuPy kernel: pointers may
    be Python ints (``t.data_ptr()``), other scalars numpy scalars of the exact C type."""
    dev = t.get_device()
    fn = _functions.get((path, name, dev)) or _function(path, name, tuple(include_dirs), dev)
    handle = _current_raw_stream(dev)
    stream = _raw_streams.get(handle) or _raw_streams.setdefault(handle, _RawStream(handle))
    if torch._C._cuda_getDevice() == dev:
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
