"""CuPy glue shared by the ops and ragged launchers (imported only for CUDA tensors).

- ``load_module(path)``: a ``cupy.RawModule`` compiled from a ``.cu`` file with
  ``-std=c++17 -I<ops dir>``, cached per (file, device);
- ``torch_stream(tensor)``: context manager that selects the tensor's device
  and makes CuPy launch on torch's *current* stream (no host sync, capturable
  by ``torch.cuda.CUDAGraph``);
- ``ptr(t)``: a tensor's device pointer as ``numpy.uint64`` (8 bytes, what a
  ``T*`` kernel parameter takes).
Scalar kernel arguments must be numpy scalars of the exact C type
(numpy.int32 for int, numpy.int64 for long long, numpy.uint32 for unsigned).
"""

from __future__ import annotations

import contextlib
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


def load_module(path: str, extra_include_dirs=()):
    """RawModule for the .cu file at ``path`` on the current CuPy device (cached)."""
    cp = cupy()
    dev = cp.cuda.Device().id
    key = (path, dev, tuple(extra_include_dirs))
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                with open(path) as f:
                    code = f.read()
                opts = ("-std=c++17", f"-I{OPS_DIR}") + tuple(f"-I{d}" for d in extra_include_dirs)
                mod = cp.RawModule(code=code, options=opts)
                _modules[key] = mod
    return mod


def _external_stream(cp, handle: int, device_id: int):
    Stream = cp.cuda.Stream
    if hasattr(Stream, "from_external"):
        try:
            return Stream.from_external(handle, device_id=device_id)
        except TypeError:
            return Stream.from_external(handle)
    return cp.cuda.ExternalStream(handle, device_id)


_streams: dict = {}


@contextlib.contextmanager
def torch_stream(t: torch.Tensor):
    """Launch CuPy kernels on torch's current stream of ``t``'s device."""
    cp = cupy()
    dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
    with cp.cuda.Device(dev):
        handle = torch.cuda.current_stream(dev).cuda_stream
        # the wrapper only holds the handle; cache it (cheap launches, capture-safe)
        s = _streams.get((handle, dev))
        if s is None:
            s = _streams[(handle, dev)] = _external_stream(cp, handle, dev)
        with s:
            yield cp


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def num_sms(t: torch.Tensor) -> int:
    return torch.cuda.get_device_properties(t.device).multi_processor_count


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
