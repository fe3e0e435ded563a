"""The fused step's logits statistics on Hopper GPUs (sm_90), from one CuTe DSL kernel (transducer/hopper_kernel.py):
for each row r of Z = H W^T + bias, over the V columns of the vocabulary,

    den[r] = logsumexp_v Z[r, v],    z_blank[r] = Z[r, blank],    z_label[r] = Z[r, labels[r]]

without Z in memory: the GEMM's epilogue keeps a running max and sum per row over the vocabulary tiles (as flash
attention does over its key tiles) and picks the two entries as their tile passes.

The kernel needs ``nvidia-cutlass-dsl``, imported only when a kernel is first compiled: importing this module, or
``transducer``, never needs it. Kernels are compiled once per (J, vocabulary tiles, dtype, kernel shape) and kept for
the process; the row count, V, the bias and the blank are run-time arguments.
"""

import functools
import importlib.util
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["available", "logits_statistics"]


class Config(NamedTuple):
    """A kernel's shape (transducer.hopper_kernel.LogitsStatistics): vocabulary tiles of ``tile_n`` columns,
    ``warpgroups`` warpgroups of 64 rows each, clusters of ``cluster_m`` CTAs along the rows, ``occupancy`` CTAs per
    SM sizing the ring of loads."""
    tile_n: int = 256
    warpgroups: int = 2
    cluster_m: int = 1
    occupancy: int = 1


DTYPES = (torch.bfloat16, torch.float16)


def default_config(V):
    """The kernel's shape for V columns: up to 1024, tiles of 128 x 128 and two CTAs per SM, so that one CTA's
    epilogue overlaps the other's MMAs; wider, tiles of 128 x 256 and one CTA per SM with the deepest ring of loads
    that fits (CUTLASS's cooperative Hopper GEMM), where the epilogue weighs less against the longer main loop
    (DESIGN.md: The logits statistics on Hopper)."""
    return Config(128, 2, 1, 2) if V <= 1024 else Config(256, 2, 1, 1)


def available(device=None) -> bool:
    """Whether ``logits_statistics`` runs on ``device`` (default: the current CUDA device): an sm_90 GPU and
    ``nvidia-cutlass-dsl`` importable."""
    if not torch.cuda.is_available():
        return False
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    return importlib.util.find_spec("cutlass") is not None


def logits_statistics(H: Tensor, W: Tensor, bias: Optional[Tensor], labels: Tensor, blank: int
                      ) -> Tuple[Tensor, Tensor, Tensor]:
    """Each row's log-softmax denominator and its blank and label logits, without the logits in memory.

    Args:
        H (Tensor): ``(N, J)`` bfloat16 or float16, contiguous, ``J`` a multiple of 8: the joiner's hidden rows.
        W (Tensor): ``(V, J)``, H's dtype, contiguous: the output projection.
        bias (Tensor or None): ``(V,)``, any floating dtype (added in fp32).
        labels (Tensor): ``(N,)`` int32: each row's label column in ``[0, V)``, or -1 for none.
        blank (int): the blank's column, in ``[0, V)``.

    Returns:
        (den, z_blank, z_label), each ``(N,)`` float32: ``logsumexp(Z[r, :V])``, ``Z[r, blank]`` and
        ``Z[r, labels[r]]`` (0 where ``labels[r]`` is -1), with ``Z = H W^T + bias`` accumulated in fp32.
    """
    if not isinstance(H, Tensor) or H.dim() != 2 or H.dtype not in DTYPES:
        raise ValueError(f"H: expected a 2-D bfloat16 or float16 tensor, got {_describe(H)}")
    N, J = H.shape
    if not H.is_cuda or not H.is_contiguous() or J % 8 or J == 0:
        raise ValueError(f"H: expected a contiguous CUDA tensor with J a positive multiple of 8 (16-byte rows), got "
                         f"{_describe(H)}")
    if not isinstance(W, Tensor) or W.dim() != 2 or W.size(1) != J or W.dtype != H.dtype:
        raise ValueError(f"W: expected a (V, {J}) tensor of H's dtype {H.dtype}, got {_describe(W)}")
    if W.device != H.device or not W.is_contiguous():
        raise ValueError(f"W: expected a contiguous tensor on {H.device}, got {_describe(W)}")
    V = W.size(0)
    if V < 1:
        raise ValueError("W: expected at least one row (V >= 1), got 0")
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (V,) or not bias.is_floating_point()
                             or bias.device != H.device):
        raise ValueError(f"bias: expected None or a floating ({V},) tensor on {H.device}, got {_describe(bias)}")
    if not isinstance(labels, Tensor) or labels.shape != (N,) or labels.dtype != torch.int32 \
            or labels.device != H.device:
        raise ValueError(f"labels: expected an int32 ({N},) tensor on {H.device}, got {_describe(labels)}")
    if not 0 <= blank < V:
        raise ValueError(f"blank: expected a column in [0, {V}), got {blank}")
    return _logits_statistics(H, W, bias, labels, blank, default_config(V))


def _logits_statistics(H, W, bias, labels, blank, config):
    """logits_statistics on checked arguments, with the kernel of ``config``."""
    N, J = H.shape
    V = W.size(0)
    n_tiles = -(-V // config.tile_n)
    col_bias = torch.full((n_tiles * config.tile_n,), float("-inf"), device=H.device, dtype=torch.float32)
    if bias is None:
        col_bias[:V] = 0
    else:
        col_bias[:V] = bias
    den, z_blank, z_label = (torch.empty(N, device=H.device, dtype=torch.float32) for _ in range(3))
    if N == 0:
        return den, z_blank, z_label
    kernel = _compiled(J, n_tiles, H.dtype, config)
    args = [_cute(x, 16) for x in (H, W, col_bias)] + [_cute(x, 4) for x in (labels, den, z_blank, z_label)]
    kernel(*args, blank, _stream())
    return den, z_blank, z_label


def _describe(x):
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)} on {x.device}" + ("" if x.is_contiguous() else
                                                                              ", not contiguous")
    return repr(x)


def _cute(x, align):
    """x as a CuTe tensor of dynamic shape and strides, its start aligned to ``align`` bytes (TMA's operands: 16)."""
    from cutlass.cute.runtime import from_dlpack
    return from_dlpack(x, assumed_align=align).mark_layout_dynamic(leading_dim=x.dim() - 1)


def _stream():
    import cuda.bindings.driver as cuda
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


@functools.lru_cache(maxsize=None)
def _compiled(J, n_tiles, dtype, config):
    """The kernel of ``config`` compiled for rows of J entries of ``dtype`` and ``n_tiles`` vocabulary tiles (any row
    count, V and blank): compiled on first use, kept for the process."""
    import cutlass
    import cutlass.cute as cute

    from .hopper_kernel import LogitsStatistics

    device = torch.cuda.current_device()
    H = torch.empty(128, J, device=device, dtype=dtype)
    W = torch.empty(n_tiles * config.tile_n, J, device=device, dtype=dtype)
    vectors = [torch.empty(128, device=device, dtype=d) for d in (torch.int32,) + (torch.float32,) * 3]
    col_bias = torch.empty(n_tiles * config.tile_n, device=device, dtype=torch.float32)
    kernel = LogitsStatistics(n_tiles, *config)
    args = [_cute(x, 16) for x in (H, W, col_bias)] + [_cute(x, 4) for x in vectors]
    return cute.compile(kernel, *args, cutlass.Int32(0), _stream())
