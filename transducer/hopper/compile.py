"""Compilation of transducer.hopper's kernels (transducer/hopper/kernels.py) and their disk cache: a kernel is
compiled once per (J, vocabulary tiles, dtype, kernel shape, epilogue, extra columns) for TVM FFI's calling convention
(a launch costs the host a few microseconds), kept for the process, and kept on disk for later processes, which load
it instead of compiling it.

The disk cache (``_cache_file``) is by default ``~/.cache/transducer-loss/hopper``, elsewhere the absolute directory
``TRANSDUCER_HOPPER_CACHE`` names, and off where that is 0. A process loads and runs the code it finds there, so the
cache is used only where no one else can have put it there: its directory is made 0700 and its files 0600 whatever
the umask, and a directory or file that is a symlink, is not the user's own, or is writable by group or others is not
used (one warning; the kernels are then compiled in memory), nor is a relative ``TRANSDUCER_HOPPER_CACHE``. Files are
written through a new file opened with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and renamed into place, so that no process
loads a file cut short and no symlink is written through.
"""

import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import secrets
import stat
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

from ops.cuda import current_device, current_raw_stream

_log = logging.getLogger("transducer")
# the compiled kernels' function name in the disk cache's object files (_compile)
_CACHED_NAME = "logits_gemm"

# compilation (the DSL's tracer) and the self-tests' results, one thread at a time (DataParallel's replicas call the
# loss from several); reentrant: a self-test compiles
lock = threading.RLock()
# the disk cache's problems already warned of (one warning each per process)
_warned = set()


@functools.lru_cache(maxsize=None)
def _runtime():
    """(make_ptr, the global address space, the CuTe type of each torch dtype the kernels take), imported once."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    types = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
    }
    return make_ptr, cute.AddressSpace.gmem, types


def launch(kernel, H, *arguments):
    """Runs a compiled kernel on H's device and on torch's current stream there (entering the device where it is not
    the current one, as ops.cuda.launch does): the kernels take addresses, which carry no device."""
    device = H.get_device()
    if device == current_device():
        kernel(*arguments, current_raw_stream(device))
    else:
        with torch.cuda.device(device):
            kernel(*arguments, current_raw_stream(device))


def compiled(J, n_tiles, dtype, config, gradient, clamp, extra):
    """_compile's kernel, compiled once per process, one thread at a time; the statistics' under vocab_groups 1,
    whatever the config says (they never split their vocabulary tiles: measured no faster, benchmarks/RESULTS.md), so
    that configs differing only there share one statistics kernel."""
    if not gradient:
        config = config._replace(vocab_groups=1)
    with lock:
        return _compile(J, n_tiles, dtype, config, gradient, clamp, extra)


@functools.lru_cache(maxsize=None)
def _compile(J, n_tiles, dtype, config, gradient, clamp, extra):
    """The kernel of ``config`` compiled for rows of J entries of ``dtype`` and ``n_tiles`` vocabulary tiles (any row
    count, V, blank, clamp and first extra column), with the gradient epilogue (clamping or not) or the statistics,
    and ``extra`` extra columns (stored by the statistics, their terms subtracted by the gradient): compiled on first
    use, kept for the process, and kept on disk (``_cache_file``) for the next process to load. Compiled for TVM
    FFI's calling convention (CuTe DSL's ``--enable-tvm-ffi``): a call takes addresses, numbers and the stream's
    handle as Python ints and floats, which costs the host far less than the DSL's own argument handling
    (benchmarks/RESULTS.md, The fused step on Hopper's kernels)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import load_module

    from .kernels import Epilogue, LogitsGemm, LogitsGemmPingpong

    file = _cache_file(J, n_tiles, dtype, config, gradient, clamp, extra)
    if file is not None and not _usable(file):
        file = None
    try:
        if file is not None and file.exists():
            return getattr(load_module(str(file), enable_tvm_ffi=True), _CACHED_NAME)
    except Exception as e:  # noqa: BLE001  (a file from another build, cut short or unreadable: compiled again)
        _log.debug("transducer.hopper: compiling again, %s could not be loaded (%s: %s)", file, type(e).__name__, e)

    make_ptr, gmem, types = _runtime()
    pointers = [
        make_ptr(types[d], 0, gmem, assumed_align=a)
        for d, a in ((dtype, 16), (dtype, 16), (torch.float32, 16), (torch.int32, 4), (torch.float32, 4), (dtype, 16))
    ]
    epilogue = Epilogue(gradient, clamp, extra)
    if config.pingpong:
        kernel = LogitsGemmPingpong(
            J, n_tiles, config.tile_n, epilogue, resident=config.pingpong == 1, vocab_groups=config.vocab_groups
        )
    else:
        kernel = LogitsGemm(J, n_tiles, *config[:4], epilogue=epilogue)
    result = cute.compile(
        kernel,
        *pointers,
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Int64(8),
        cutlass.Int64(1),
        cutlass.Int64(8),
        cutlass.Int32(0),
        cutlass.Float32(0.0),
        cutlass.Int32(1),
        cuda.CUstream(torch.cuda.current_stream().cuda_stream),
        options="--enable-tvm-ffi",
    )
    if file is not None:
        _write_cached(result, file)
    return result


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"transducer.hopper: {message}; the kernels are compiled in memory", RuntimeWarning, stacklevel=3)


def _unsafe(path, directory):
    """Why ``path`` (a directory, or a file) may hold another user's code, or None: a symlink, not a directory (not
    a regular file), not the user's own, or writable by group or others."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink"
    if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        return f"{path} is not a {'directory' if directory else 'regular file'}"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by user {st.st_uid}, not by this process's user {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _make_directory(directory):
    """``directory`` and its missing parents made, each 0700 whatever the umask."""
    missing = []
    while not os.path.lexists(directory):
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # made by another process meanwhile: checked as any other
            continue
        os.chmod(path, 0o700)


def _usable(file: Path) -> bool:
    """Whether the disk cache may keep ``file`` and load it: its directory (made where it is missing) and the file
    where there is one are the user's own, not symlinks, and writable by no one else. Else one warning, and False;
    False without one where the directory cannot be made (a full or read-only disk)."""
    try:
        _make_directory(file.parent)
    except OSError as e:
        _log.debug(
            "transducer.hopper: the disk cache's directory %s not made (%s: %s)", file.parent, type(e).__name__, e
        )
        return False
    try:
        problem = _unsafe(file.parent, True)
        if problem is None and os.path.lexists(file):
            problem = _unsafe(file, False)
    except OSError as e:
        problem = f"{file} could not be checked ({type(e).__name__}: {e})"
    if problem is not None:
        _warn_once(f"the kernels' disk cache is not used: {problem}")
        return False
    return True


def _write_cached(result, file):
    """The compiled kernel's object file written to ``file``: exported into a private temporary directory, copied
    into a new file beside ``file`` (opened with O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600), then renamed, so that no
    process loads a file cut short and nothing is written through a symlink; nothing written (a debug line) where
    that fails, as on a full or read-only disk."""
    part = None  # once this process has made it
    try:
        with tempfile.TemporaryDirectory() as private:
            exported = os.path.join(private, "kernel.o")
            result.export_to_c(exported, function_name=_CACHED_NAME)
            with open(exported, "rb") as f:
                data = f.read()
        name = file.parent / f".{file.name}.{secrets.token_hex(8)}.part"
        handle = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        part = name
        try:
            os.fchmod(handle, 0o600)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(handle, view) :]
        finally:
            os.close(handle)
        os.replace(part, file)
    except Exception as e:  # noqa: BLE001  (any failure leaves the kernel to be compiled in the next process)
        _log.debug("transducer.hopper: %s not written (%s: %s)", file, type(e).__name__, e)
        if part is not None:
            try:
                os.remove(part)
            except OSError:
                pass


def _cache_file(J, n_tiles, dtype, config, gradient, clamp, extra) -> Optional[Path]:
    """Where _compile keeps a compiled kernel for later processes, or None where ``TRANSDUCER_HOPPER_CACHE`` is 0
    (or false, off, no), where it is a relative path (a warning), or where no home directory is known: an object
    file in the directory ``TRANSDUCER_HOPPER_CACHE`` names, by default (or where it is 1, true, on, yes)
    ``$XDG_CACHE_HOME/transducer-loss/hopper`` (``~/.cache/transducer-loss/hopper``), named by a hash of what builds
    it (_source_key) and of the kernel (_kernel_key). _usable says whether it may be used."""
    setting = os.environ.get("TRANSDUCER_HOPPER_CACHE", "").strip()
    if setting.lower() in ("0", "false", "off", "no"):
        return None
    try:
        if setting and setting.lower() not in ("1", "true", "on", "yes"):
            root = Path(setting).expanduser()
            if not root.is_absolute():  # against the current directory, it would move with it
                _warn_once(f"TRANSDUCER_HOPPER_CACHE={setting!r} is not used: expected an absolute directory")
                return None
        else:  # a relative XDG_CACHE_HOME is ignored, as the XDG Base Directory specification says
            xdg = os.environ.get("XDG_CACHE_HOME", "")
            root = (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "transducer-loss" / "hopper"
        return root / f"{_source_key()}-{_kernel_key(J, n_tiles, dtype, config, gradient, clamp, extra)}.o"
    except (RuntimeError, OSError):  # Path.home() without HOME or a user entry; sources that cannot be read
        return None


@functools.lru_cache(maxsize=None)
def _source_key():
    """The part of a cached kernel's name that changes with the sources and the libraries that build it: every
    Python file of this package (an edited kernel is compiled again), and the versions of nvidia-cutlass-dsl, of
    its compiler's libraries for each CUDA major version, and of apache-tvm-ffi."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for path in sorted(here.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for package in (
        "nvidia-cutlass-dsl",
        "nvidia-cutlass-dsl-libs-base",
        "nvidia-cutlass-dsl-libs-cu12",
        "nvidia-cutlass-dsl-libs-cu13",
        "apache-tvm-ffi",
    ):
        try:
            digest.update(f"{package} {importlib.metadata.version(package)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{package} unknown".encode())
    return digest.hexdigest()[:16]


def _kernel_key(J, n_tiles, dtype, config, gradient, clamp, extra):
    """The part of a cached kernel's name that names the kernel and what it is built for: its arguments, the GPU's
    compute capability, the DSL's compiler library loaded (its CUDA version and the host's architecture in its name)
    and the DSL's ``CUTE_DSL_*`` settings in the environment (the target arch, line information, debugging)."""
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    compiler = getattr(sys.modules.get("cutlass._mlir._mlir_libs._cutlass_ir"), "__file__", None)
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL_"))
    arguments = (
        J,
        n_tiles,
        str(dtype),
        tuple(config),
        bool(gradient),
        bool(clamp),
        extra,
        capability,
        os.path.basename(compiler) if compiler else platform.machine(),
        settings,
    )
    return hashlib.sha256(repr(arguments).encode()).hexdigest()[:16]
