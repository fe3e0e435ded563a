"""Launching the CUDA kernels of ops, ragged and transducer (imported by them for CUDA tensors only).

- ``launch(path, name, t, grid, block, args, shared_mem=0)``: one kernel launch on torch's *current*
  stream of ``t``'s device (no host sync, capturable by ``torch.cuda.CUDAGraph``), compiled at first
  use by NVRTC through ``cupy.RawModule`` and cached per (file, kernel, device), its arguments packed
  into one buffer for ``cuLaunchKernel``;
- ``vector_width(itemsize, length, tensors)``: elements per 16-byte (or narrower) access;
- ``num_sms(t)``, ``max_shared_mem(t)`` and ``ceil_div(a, b)``: launch geometry;
- ``host_reader(device, numel, dtype)``: a small device tensor's values on the host, copied behind a mark
  on torch's current stream without making that stream wait.

Kernels include the device headers of the packages as ``"ops/numeric.cuh"``,
``"ragged/row_ids.cuh"``, ...: the compiler gets ``-I`` + ``cuda_include_dir()``, the folder that
holds the packages. Importing this module never needs CuPy; launching does.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import struct
import threading

import numpy as np
import torch

__all__ = [
    "launch",
    "vector_width",
    "num_sms",
    "max_shared_mem",
    "DEFAULT_SHARED_MEM",
    "ceil_div",
    "i32",
    "i64",
    "cuda_include_dir",
    "cupy",
    "host_reader",
    "HostReader",
    "KernelArguments",
    "allow_shared_mem",
    "shared_mem_allowed",
    "current_raw_stream",
    "current_device",
]

_INCLUDE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cuda_include_dir() -> str:
    """The folder holding the packages: kernels include ``"ops/fast_divmod.cuh"`` and the like from it."""
    return _INCLUDE_ROOT


def cupy():
    try:
        import cupy as cp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("CUDA tensors need CuPy: pip install -e '.[cuda]' (cupy-cuda13x) or '.[cuda12]'") from e
    return cp


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


@functools.lru_cache(maxsize=None)
def _source(path: str) -> str:
    """The .cu file's text, headed by a hash of every header it includes (transitively): CuPy's
    on-disk cache keys on the source text and options only, so an edited header must change it."""
    h = hashlib.sha1()
    seen, todo = set(), [path]
    while todo:
        f = todo.pop()
        with open(f, "rb") as fh:
            text = fh.read()
        if f != path:
            h.update(text)
        for inc in _INCLUDE.findall(text.decode()):
            full = os.path.join(_INCLUDE_ROOT, inc)
            if full not in seen:
                seen.add(full)
                todo.append(full)
    with open(path) as fh:
        return f"// headers {h.hexdigest()}\n" + fh.read()


_lock = threading.Lock()
_functions: dict = {}


def _function(path, name, dev):
    """The compiled kernel ``name`` (a template instantiation or an extern "C" name) of ``path`` on ``dev``:
    (the CuPy function, which keeps its module loaded, its CUfunction handle, and CuPy's cuLaunchKernel)."""
    key = (path, name, dev)
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            cp = cupy()
            with cp.cuda.Device(dev):
                module = cp.RawModule(
                    code=_source(path),
                    options=("-std=c++17", f"-I{_INCLUDE_ROOT}"),
                    name_expressions=(name,) if name.endswith(">") else None,
                )
                kernel = module.get_function(name).kernel
                fn = _functions[key] = (kernel, kernel.ptr, cp.cuda.driver.launchKernel)
    return fn


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # torch's private fast path, when present


def current_raw_stream(device_id: int) -> int:
    """torch's current stream on CUDA device ``device_id`` as a raw cudaStream_t (an int), without making a
    torch.cuda.Stream (which costs the host several microseconds)."""
    return _raw_stream(device_id) if _raw_stream is not None else torch.cuda.current_stream(device_id).cuda_stream


# cuLaunchKernel's `extra` (cuda.h): CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE, CU_LAUNCH_PARAM_END
_PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE, _PARAM_END = 1, 2, 0
_SCALAR_FORMATS = {np.int32: "i", np.int64: "q", np.uint32: "I", np.uint64: "Q", np.float32: "f", np.float64: "d"}
_TENSOR, _STRUCT, _SCALAR, _NULL, _PARAMS = 0, 1, 2, 3, 4


def _alignment(dtype) -> int:
    """The C alignment of a numpy (structured) dtype: its widest field's."""
    if dtype.names is None:
        return dtype.base.alignment
    return max(_alignment(dtype.fields[f][0].base) for f in dtype.names)


class KernelArguments:
    """A kernel's arguments laid out as the C ABI lays out its parameters, for one tuple of argument types:
    cuLaunchKernel takes them as one buffer (its `extra` argument), so a launch packs them with one
    ``struct.pack_into`` instead of making an object per argument (DESIGN.md: One buffer of launch arguments).
    Tensors are pointers, numpy scalars their C types, structured numpy scalars their bytes at their widest
    field's alignment, parameter structs (ops.params) their fields in the C layout, and the Python int 0 a
    NULL pointer. The driver cannot check the buffer against the kernel's parameters: a wrong type shifts
    every later argument, so anything else is refused (a kernel that takes one named struct, filled by field
    name, avoids the question). One per thread (the buffer is written right before each launch)."""

    def __init__(self, args):
        fmt, kinds, self.structs, self.nulls, self.params = "@", [], [], [], []
        for i, a in enumerate(args):
            if hasattr(type(a), "c_flatten"):
                kinds.append(_PARAMS)
                self.params.append((i, type(a)))
                fmt += f"{-struct.calcsize(fmt) % type(a).c_align}x{type(a).c_format}"
            elif isinstance(a, torch.Tensor):
                kinds.append(_TENSOR)
                fmt += "P"
            elif isinstance(a, np.void):
                align = _alignment(a.dtype)
                if a.dtype.itemsize % align:
                    raise TypeError(
                        f"launch: struct argument {i} of dtype {a.dtype} lacks its trailing padding "
                        f"(make the dtype with align=True)"
                    )
                kinds.append(_STRUCT)
                self.structs.append((i, a.dtype))
                fmt += f"{-struct.calcsize(fmt) % align}x{a.dtype.itemsize}s"
            elif type(a) is int:
                kinds.append(_NULL)
                self.nulls.append(i)
                fmt += "P"
            else:
                code = _SCALAR_FORMATS.get(type(a))
                if code is None:
                    raise TypeError(
                        f"launch: argument {i} has type {type(a).__name__}; expected a tensor, a numpy "
                        f"scalar of the parameter's C type (i32, i64, numpy.float32, ...), a structured "
                        f"numpy scalar or 0 (a NULL pointer)"
                    )
                kinds.append(_SCALAR)
                fmt += code
        self.kinds = tuple(kinds)
        self.tensors = tuple(i for i, k in enumerate(kinds) if k == _TENSOR)
        self.layout = struct.Struct(fmt)
        self.buffer = ctypes.create_string_buffer(max(self.layout.size, 1))
        self.size = ctypes.c_size_t(self.layout.size)
        self.extra = (ctypes.c_void_p * 5)(
            _PARAM_BUFFER_POINTER,
            ctypes.addressof(self.buffer),
            _PARAM_BUFFER_SIZE,
            ctypes.addressof(self.size),
            _PARAM_END,
        )
        self.extra_ptr = ctypes.addressof(self.extra)

    def pack(self, args) -> int:
        """``args`` into the buffer; the address of cuLaunchKernel's `extra` that points at it."""
        for i in self.nulls:
            if args[i] != 0:
                raise TypeError(
                    f"launch: argument {i} is the Python int {args[i]}; only 0 (a NULL pointer) may be "
                    f"a Python int, integers go as i32() / i64()"
                )
        for i, dtype in self.structs:
            if args[i].dtype != dtype:
                raise TypeError(f"launch: struct argument {i} has dtype {args[i].dtype}, this kernel took {dtype}")
        for i, cls in self.params:
            if type(args[i]) is not cls:
                raise TypeError(
                    f"launch: argument {i} is a {type(args[i]).__name__}, this kernel took a {cls.__name__}"
                )
        if self.params:  # a parameter struct flattens into its fields
            values = []
            for a, kind in zip(args, self.kinds):
                if kind == _PARAMS:
                    type(a).c_flatten(a, values)
                else:
                    values.append(a.data_ptr() if kind == _TENSOR else a.tobytes() if kind == _STRUCT else a)
        else:
            values = list(args)
            for i in self.tensors:
                values[i] = args[i].data_ptr()
            for i, _ in self.structs:
                values[i] = args[i].tobytes()
        self.layout.pack_into(self.buffer, 0, *values)
        return self.extra_ptr


#: Shared memory (static + dynamic) a block may take without opting in, on every GPU the project supports.
DEFAULT_SHARED_MEM = 48 * 1024
# cuFuncSetAttribute's attribute that raises a kernel's dynamic limit (cuda.h:
# CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
#: (file, kernel, device) -> the dynamic shared memory the kernel is opted in to (allow_shared_mem)
shared_mem_allowed: dict = {}


def allow_shared_mem(key, fn, shared_mem):
    """Opt kernel ``fn`` in to ``shared_mem`` bytes of dynamic shared memory (once per size it grows to)."""
    if shared_mem_allowed.get(key, DEFAULT_SHARED_MEM) >= shared_mem:  # without the lock a compile holds
        return
    with _lock:
        if shared_mem_allowed.get(key, DEFAULT_SHARED_MEM) < shared_mem:
            cupy().cuda.driver.funcSetAttribute(fn, _MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem)
            shared_mem_allowed[key] = shared_mem


_per_thread = threading.local()
#: () -> the current CUDA device's index: torch's private fast path, when present
current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def launch(path: str, name: str, t: torch.Tensor, grid, block, args, shared_mem: int = 0):
    """Launch kernel ``name`` of the .cu file at ``path`` on torch's current stream of ``t``'s device.

    ``name`` is an extern "C" name or a template instantiation (``"kernel<float, 4>"``, compiled on
    first use). ``args``: tensors (passed as their device pointers) and numpy scalars of the kernel
    parameters' exact C types (numpy.int32 for int, numpy.int64 for long long, a structured scalar
    for a struct). Pass tensors, not ``x.contiguous().data_ptr()``: ``args`` holds every tensor until
    the kernel is queued, whereas a temporary copy whose pointer alone is kept is freed at once, and
    its memory may be handed to the next temporary before the kernel runs. ``shared_mem`` over 48 KiB,
    up to ``max_shared_mem(t)``, opts the kernel in first.
    """
    dev = t.get_device()
    fn, launch_kernel, packed = _entry(path, name, dev, args)
    gx, gy, gz = grid if len(grid) == 3 else (tuple(grid) + (1, 1))[:3]
    bx, by, bz = block if len(block) == 3 else (tuple(block) + (1, 1))[:3]
    stream = current_raw_stream(dev)
    if current_device() == dev:
        if shared_mem > DEFAULT_SHARED_MEM:
            allow_shared_mem((path, name, dev), fn, shared_mem)
        launch_kernel(fn, gx, gy, gz, bx, by, bz, shared_mem, stream, 0, packed.pack(args))
    else:  # the function belongs to dev's context
        with torch.cuda.device(dev):
            if shared_mem > DEFAULT_SHARED_MEM:
                allow_shared_mem((path, name, dev), fn, shared_mem)
            launch_kernel(fn, gx, gy, gz, bx, by, bz, shared_mem, stream, 0, packed.pack(args))


def _entry(path, name, dev, args):
    """This thread's (CUfunction, cuLaunchKernel, KernelArguments) of kernel ``name`` on device ``dev`` for the
    types of ``args``, made on first use."""
    try:
        launches = _per_thread.launches
    except AttributeError:
        launches = _per_thread.launches = {}
    key = (path, name, dev, tuple(map(type, args)))
    entry = launches.get(key)
    if entry is None:
        _, fn, launch_kernel = _functions.get((path, name, dev)) or _function(path, name, dev)
        entry = launches[key] = (fn, launch_kernel, KernelArguments(args))
        # A thread that only torch has used (autograd's device thread) may have no current context, and a kernel
        # compiled on another thread would then be launched without one (CUDA_ERROR_INVALID_CONTEXT): once per
        # kernel and thread, make the device's primary context current (cudaSetDevice does; on another device
        # the launch below enters torch.cuda.device, which calls it).
        if current_device() == dev:
            cupy().cuda.runtime.setDevice(dev)
    return entry


def launch_each(path: str, kernels, t: torch.Tensor, args):
    """Launch each kernel of ``kernels``, ``(name, grid, block, shared_mem)`` in order, of the .cu file at ``path``
    with the same ``args`` (as ``launch`` takes them), on torch's current stream of ``t``'s device: the arguments
    are packed once for all of them (the passes of one stage that take one parameter struct)."""
    dev = t.get_device()
    extra = stream = None
    here = current_device() == dev
    with contextlib.nullcontext() if here else torch.cuda.device(dev):  # a function belongs to dev's context
        for name, grid, block, shared_mem in kernels:
            fn, launch_kernel, packed = _entry(path, name, dev, args)
            if extra is None:  # the first kernel's buffer holds the arguments: cuLaunchKernel copies them
                extra, stream = packed.pack(args), current_raw_stream(dev)
            gx, gy, gz = grid if len(grid) == 3 else (tuple(grid) + (1, 1))[:3]
            bx, by, bz = block if len(block) == 3 else (tuple(block) + (1, 1))[:3]
            if shared_mem > DEFAULT_SHARED_MEM:
                allow_shared_mem((path, name, dev), fn, shared_mem)
            launch_kernel(fn, gx, gy, gz, bx, by, bz, shared_mem, stream, 0, extra)


class HostReader:
    """Reads a small device tensor on the host without making torch's current stream wait: ``mark()`` records
    where the copy may start (on the current stream), ``read(src)`` queues the copy of ``src`` into pinned
    memory on a side stream that waits for that mark alone, waits for the copy and returns the values as a
    list. So kernels queued between the two run on while the host reads (the loss queues its first big
    kernel there). Raw CUDA streams and events, through CuPy's runtime API: torch's Stream and Event objects
    and its stream context cost several times the host time a call, and a stream from torch's pool may be
    the caller's own. One per thread, device, size and dtype (``host_reader``), which reads tensors of at most
    that many elements (a size rounded up serves tensors whose length changes from call to call): a read ends
    before the next mark. Its stream and events are destroyed with it (when its thread ends)."""

    def __init__(self, device: torch.device, numel: int, dtype: torch.dtype):
        device = _cuda_device(device)
        rt = cupy().cuda.runtime
        self.device, self.numel, self.dtype = device.index, numel, dtype
        with torch.cuda.device(device):
            self.host = torch.empty(numel, dtype=dtype, pin_memory=True)
            self.stream = rt.streamCreateWithFlags(1)  # cudaStreamNonBlocking: no sync with the legacy stream
            self.marked, self.copied = rt.eventCreateWithFlags(2), rt.eventCreateWithFlags(2)  # DisableTiming
        self.nbytes = self.host.nbytes
        self.runtime = rt  # CuPy's runtime API (a test may stand a spy in for it)

    def __del__(self):
        # A thread's readers go with its threading.local when it ends, and their stream and events with them (a
        # process that runs the loss from many short-lived threads would otherwise keep a set per thread). Work
        # still queued on them is not cut short: CUDA releases the handles once it completes.
        rt = getattr(self, "runtime", None)
        if rt is None:
            return
        try:
            with torch.cuda.device(self.device):
                rt.streamDestroy(self.stream)
                rt.eventDestroy(self.marked)
                rt.eventDestroy(self.copied)
        except Exception:  # noqa: BLE001 - at interpreter exit CuPy or the CUDA context may be gone first
            pass

    def mark(self) -> None:
        self.runtime.eventRecord(self.marked, current_raw_stream(self.device))

    def read(self, src: torch.Tensor) -> list:
        n = src.numel()
        if n > self.numel or src.dtype != self.dtype or src.get_device() != self.device or not src.is_contiguous():
            raise ValueError(
                f"HostReader.read: src must be a contiguous {self.dtype} tensor of at most {self.numel} "
                f"elements on cuda:{self.device}, got {src.dtype} {tuple(src.shape)} on {src.device}"
            )
        rt = self.runtime
        rt.streamWaitEvent(self.stream, self.marked, 0)
        nbytes = n * src.element_size()
        rt.memcpyAsync(self.host.data_ptr(), src.data_ptr(), nbytes, rt.memcpyDeviceToHost, self.stream)
        rt.eventRecord(self.copied, self.stream)
        rt.eventSynchronize(self.copied)  # src lives until here: the caller holds it
        return self.host.tolist() if n == self.numel else self.host[:n].tolist()


def _cuda_device(device) -> torch.device:
    """``device`` as a torch.device with its index (``"cuda"``: the current one); ValueError if not CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def host_reader(device: torch.device, numel: int, dtype: torch.dtype) -> HostReader:
    """This thread's HostReader for up to ``numel`` elements of ``dtype`` on CUDA ``device`` (made once: a pinned
    allocation, a stream and events cost host time in every step)."""
    if not (isinstance(device, torch.device) and device.type == "cuda" and device.index is not None):
        device = _cuda_device(device)  # the loss passes a tensor's device: no conversion
    readers = _per_thread.__dict__.setdefault("host_readers", {})
    key = (device, numel, dtype)
    reader = readers.get(key)
    if reader is None:
        reader = readers[key] = HostReader(device, numel, dtype)
    return reader


def vector_width(itemsize: int, length: int, tensors) -> int:
    """Elements per access: the widest of 16, 8, 4, 2 bytes that divides ``length`` elements and every
    tensor's base address (1 if none does)."""
    vec = 16 // itemsize
    while vec > 1:
        if length % vec == 0 and all(t.data_ptr() % (vec * itemsize) == 0 for t in tensors):
            return vec
        vec //= 2
    return 1


@functools.lru_cache(maxsize=None)
def _device_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_sms(t) -> int:
    """Multiprocessors of the device of tensor (or torch.device) ``t``."""
    return _device_sms(t if isinstance(t, torch.device) else t.device)


@functools.lru_cache(maxsize=None)
def _device_shared_mem(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return max(DEFAULT_SHARED_MEM, getattr(props, "shared_memory_per_block_optin", DEFAULT_SHARED_MEM))


def max_shared_mem(t) -> int:
    """Bytes of shared memory a block may take on the device of tensor (or torch.device) ``t`` when its
    kernel opts in (``launch`` does for sizes over 48 KiB): 227 KiB on an H100."""
    return _device_shared_mem(t if isinstance(t, torch.device) else t.device)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# A kernel's ``int`` and ``long long`` arguments: numpy scalars of those types, made once per value (a step passes
# about 30, mostly the same from step to step; a numpy scalar's construction costs several times a cache hit on
# the GPU machine's host). Out-of-range values raise OverflowError as numpy's constructors do.
i32 = functools.lru_cache(maxsize=4096)(np.int32)
i64 = functools.lru_cache(maxsize=4096)(np.int64)
