"""The fused step's logits GEMMs on Hopper GPUs (sm_90), CuTe DSL kernels (transducer/hopper/kernels.py) over
Z = H W^T + bias whose epilogues replace the logits:

- ``logits_statistics``: for each row r, over the V columns of the vocabulary,

      den[r] = logsumexp_v Z[r, v],    z_blank[r] = Z[r, blank],    z_label[r] = Z[r, labels[r]]

  without Z in memory: the epilogue keeps a running max and sum per row over the vocabulary tiles (as flash
  attention does over its key tiles) and picks the two entries as their tile passes;
- ``logits_gradient``: the loss's gradient G = dL/dZ formed from each row's coefficients as each tile of Z leaves
  the MMAs, written once in H's dtype (Z itself never is).

The kernels need ``nvidia-cutlass-dsl`` and ``apache-tvm-ffi`` (the ``hopper`` extra), imported only when a kernel is
first compiled: importing this module, or ``transducer``, never needs them. Kernels are compiled once per (J,
vocabulary tiles, dtype, kernel shape, epilogue, extra columns) for TVM FFI's calling convention (a launch costs the
host a few microseconds), kept for the process and kept on disk for later ones (transducer/hopper/compile.py: by
default in ``~/.cache/transducer-loss/hopper``, elsewhere where ``TRANSDUCER_HOPPER_CACHE`` names an absolute
directory, never where it is 0; a directory or file that another user could have written is not used), which load a
kept kernel instead of compiling it; the row count, V, the bias, the blank, the clamp and the
first extra column are run-time arguments. The fused loss makes a ``Projection`` (W, its column bias, the kernel shape,
the softmax's columns and the extra ones: TDT's duration scores, multi-blank's big blanks) once a pass and calls
``statistics_tile`` and ``gradient_tile`` on its tiles; ``self_test`` checks once per device that the kernels run.
"""

import importlib.util
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .compile import compiled as _compiled
from .compile import launch as _launch
from .compile import lock as _lock

__all__ = [
    "available",
    "self_test",
    "logits_statistics",
    "logits_gradient",
    "Projection",
    "projection",
    "statistics_tile",
    "gradient_tile",
]


class Config(NamedTuple):
    """A kernel's shape (transducer.hopper.kernels.LogitsGemm): vocabulary tiles of ``tile_n`` columns,
    ``warpgroups`` warpgroups of 64 rows each, clusters of ``cluster_m`` CTAs along the rows, ``occupancy`` CTAs per
    SM sizing the ring of loads; or with ``pingpong`` 1, LogitsGemmPingpong's (128 rows a CTA, H kept in shared
    memory, two consumer warpgroups taking the vocabulary tiles of ``tile_n`` columns in turns; the other fields
    2, 1, 1), with ``pingpong`` 2 the same kernel over two row blocks a CTA, one a consumer, H streamed, and the
    gradient's vocabulary tiles of a row-block pair split among ``vocab_groups`` CTAs launched one after the other
    (at most the tiles; 1 otherwise), so that the CTAs running at once share rows of H."""

    tile_n: int = 256
    warpgroups: int = 2
    cluster_m: int = 1
    occupancy: int = 1
    pingpong: int = 0
    vocab_groups: int = 1


DTYPES = (torch.bfloat16, torch.float16)
# the most extra columns a projection may have (the statistics store each in its tile): TDT's durations on CUDA
MAX_EXTRA = 16


# the widest rows whose tile of 128 rows stays in the ping-pong kernel's shared memory beside three stages of W
PINGPONG_MAX_J = 640


def default_config(V, J):
    """The kernels' shape for V columns of rows of J entries: the ping-pong kernel (two consumer warpgroups taking
    turns, one's epilogue beside the other's MMAs; tiles of 128 x 128): up to 1024 columns over two row blocks a CTA,
    one a consumer, H streamed with W; wider, for J up to PINGPONG_MAX_J, one row block a CTA whose tile of H stays
    in shared memory for every vocabulary tile, the consumers taking the vocabulary tiles in turns; wider rows,
    tiles of 128 x 256 and one CTA per SM with the deepest ring of loads that fits (CUTLASS's cooperative Hopper
    GEMM) (DESIGN.md: The logits kernels in ping-pong). Over two row blocks, the gradient's vocabulary tiles, where
    there are two or more, are split between two CTAs a row-block pair."""
    if V <= 1024:
        return Config(128, 2, 1, 1, 2, 2 if V > 128 else 1)
    return Config(128, 2, 1, 1, 1) if J <= PINGPONG_MAX_J else Config(256, 2, 1, 1)


def available(device=None) -> bool:
    """Whether the kernels run on ``device`` (default: the current CUDA device): an sm_90 GPU, and
    ``nvidia-cutlass-dsl`` and ``apache-tvm-ffi`` importable."""
    if not torch.cuda.is_available():
        return False
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    return all(importlib.util.find_spec(name) is not None for name in ("cutlass", "tvm_ffi"))


# the self-tests' results by device index, kept under compile.lock (a self-test compiles)
_self_tests = {}


def self_test(device: torch.device) -> Optional[str]:
    """Whether the kernels run on ``device`` (an sm_90 GPU where ``available`` says they can): None if both compile
    and give float64 arithmetic's results on 200 rows there (bf16, the kernels of V <= 1024, and the statistics
    kernel of wider V with J <= PINGPONG_MAX_J), else why not (the exception, or the largest error). It finds a
    machine whose driver or toolkit cannot run what the DSL builds, once per device and process, before a fused step
    relies on the kernels (three small kernels compiled, and host reads). Not run, and not kept, during CUDA graph
    capture; an out-of-memory error is raised.

    Args:
        device (torch.device): the CUDA device.

    Returns:
        str or None: None, or why the kernels cannot be used there.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _self_tests:
        return _self_tests[index]
    if torch.cuda.is_current_stream_capturing():
        return "not run during CUDA graph capture"
    with _lock, torch.cuda.device(index), torch.autocast("cuda", enabled=False):
        if index in _self_tests:
            return _self_tests[index]
        try:
            g = torch.Generator(device=f"cuda:{index}").manual_seed(0)
            H = torch.randn(200, 64, device=f"cuda:{index}", generator=g).to(torch.bfloat16)
            W = (torch.randn(40, 64, device=H.device, generator=g) / 8).to(torch.bfloat16)
            labels = torch.randint(-1, 40, (200,), device=H.device, generator=g, dtype=torch.int32)
            den, z_blank, z_label = logits_statistics(H, W, None, labels, 0)
            pingpong = statistics_tile(projection(W, None, Config(128, 2, 1, 1, 1)), H, labels, 0)
            coefficients = torch.stack(
                [den, torch.ones_like(den), torch.zeros_like(den), torch.zeros_like(den), torch.ones_like(den)]
            )
            G = logits_gradient(H, W, None, labels, 0, coefficients)[:, :40].double()
            Z = H.double() @ W.double().t()
            picked = torch.where(labels >= 0, Z[torch.arange(200, device=H.device), labels.clamp(min=0).long()], 0)
            error = max(
                float((den - torch.logsumexp(Z, 1)).abs().max()),
                float((z_blank - Z[:, 0]).abs().max()),
                float((z_label - picked).abs().max()),
                float((G - torch.softmax(Z, 1)).abs().max()),
                max(float((a - b).abs().max()) for a, b in zip(pingpong, (den, z_blank, z_label))),
            )
            result = None if error < 1e-2 else f"their results are off by {error:.3g}"
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001  (a compiler, driver or library error of any kind)
            result = f"{type(e).__name__}: {str(e)[:300]}"
        _self_tests[index] = result
    return result


def logits_statistics(
    H: Tensor, W: Tensor, bias: Optional[Tensor], labels: Tensor, blank: int, out: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor]:
    """Each row's log-softmax denominator and its blank and label logits, without the logits in memory.

    Args:
        H (Tensor): ``(N, J)`` bfloat16 or float16, unit column stride, rows starting on 16-byte boundaries (a row
            stride that is a multiple of 8), ``J`` a multiple of 8: the joiner's hidden rows.
        W (Tensor): ``(V, J)``, H's dtype, contiguous: the output projection.
        bias (Tensor or None): ``(V,)``, any floating dtype (added in fp32).
        labels (Tensor): ``(N,)`` int32: each row's label column in ``[0, V)``, or -1 for none.
        blank (int): the blank's column, in ``[0, V)``.
        out (Tensor or None): ``(3, N)`` float32 of unit column stride to write the three results into, or None
            for a new one. Default: None.

    Returns:
        (den, z_blank, z_label), each ``(N,)`` float32 (the rows of ``out``): ``logsumexp(Z[r, :V])``,
        ``Z[r, blank]`` and ``Z[r, labels[r]]`` (0 where ``labels[r]`` is -1), with ``Z = H W^T + bias`` accumulated
        in fp32.
    """
    _check(H, W, bias, labels, blank)
    if out is not None:
        _check_rows("out", out, 3, H)
    return statistics_tile(projection(W, bias), H, labels, blank, out)


def logits_gradient(
    H: Tensor, W: Tensor, bias: Optional[Tensor], labels: Tensor, blank: int, coefficients: Tensor, clamp: float = 0.0
) -> Tensor:
    """The gradient of a loss with respect to the logits Z = H W^T + bias, from each row's coefficients, without Z in
    memory: for row r and column v < V (transducer/cuda/stages.cu's gradient_kernel, elementwise),

        G[r, v] = scale[r] * c(exp(Z[r, v] - den[r]) * occupancy[r] - [v == blank] blank_arc[r]
                               - [v == labels[r]] label_arc[r]),

    c clamping to ``[-clamp, clamp]`` when ``clamp > 0`` (else none).

    Args:
        H, W, bias, labels, blank: as logits_statistics's.
        coefficients (Tensor): ``(5, N)`` float32 of unit column stride: each row's den (the logsumexp of its logits),
            occupancy, blank_arc, label_arc and scale; a row with den = +inf and the rest 0 gets zeros.
        clamp (float): the clamp, or 0 for none. Default: 0.0.

    Returns:
        Tensor: ``(N, width)`` of H's dtype, ``width`` >= V a multiple of the kernel's vocabulary tile, rows
        contiguous: G in the first V columns, zeros past them.
    """
    _check(H, W, bias, labels, blank)
    _check_rows("coefficients", coefficients, 5, H)
    if not clamp >= 0:
        raise ValueError(f"clamp: expected a number >= 0, got {clamp}")
    return gradient_tile(projection(W, bias), H, labels, blank, coefficients, float(clamp))


def _check(H, W, bias, labels, blank):
    """The arguments both kernels share, checked."""
    if not isinstance(H, Tensor) or H.dim() != 2 or H.dtype not in DTYPES:
        raise ValueError(f"H: expected a 2-D bfloat16 or float16 tensor, got {_describe(H)}")
    N, J = H.shape
    if not H.is_cuda or H.stride(1) != 1 or H.stride(0) % 8 or H.data_ptr() % 16 or J % 8 or J == 0:
        raise ValueError(
            f"H: expected a CUDA tensor of unit column stride, rows on 16-byte boundaries and J a "
            f"positive multiple of 8, got {_describe(H)}"
        )
    if not isinstance(W, Tensor) or W.dim() != 2 or W.size(1) != J or W.dtype != H.dtype:
        raise ValueError(f"W: expected a (V, {J}) tensor of H's dtype {H.dtype}, got {_describe(W)}")
    if W.device != H.device or not W.is_contiguous() or W.data_ptr() % 16:
        raise ValueError(
            f"W: expected a contiguous tensor on {H.device} starting on a 16-byte boundary, got {_describe(W)}"
        )
    V = W.size(0)
    if V < 1:
        raise ValueError("W: expected at least one row (V >= 1), got 0")
    if bias is not None and (
        not isinstance(bias, Tensor) or bias.shape != (V,) or not bias.is_floating_point() or bias.device != H.device
    ):
        raise ValueError(f"bias: expected None or a floating ({V},) tensor on {H.device}, got {_describe(bias)}")
    if (
        not isinstance(labels, Tensor)
        or labels.shape != (N,)
        or labels.dtype != torch.int32
        or labels.device != H.device
    ):
        raise ValueError(f"labels: expected an int32 ({N},) tensor on {H.device}, got {_describe(labels)}")
    if not 0 <= blank < V:
        raise ValueError(f"blank: expected a column in [0, {V}), got {blank}")


def _check_rows(name, x, count, H):
    """A (count, N) float32 tensor of unit column stride (per-row values), N = H's rows, checked."""
    N = H.size(0)
    if (
        not isinstance(x, Tensor)
        or x.shape != (count, N)
        or x.dtype != torch.float32
        or x.device != H.device
        or (N > 1 and x.stride(1) != 1)
    ):
        raise ValueError(
            f"{name}: expected a float32 ({count}, {N}) tensor of unit column stride on {H.device}, got {_describe(x)}"
        )


class Projection(NamedTuple):
    """What both kernels take of the output projection, made once for the tiles of a pass (``projection``): W
    ``(V, J)``, the column bias ``col_bias`` (the bias, 0 without one, for the softmax's ``tokens`` columns, then
    -inf up to whole vocabulary tiles; fp32), the kernels' shape, and ``extra`` extra columns from ``extra_start``
    on, whose entries of H W^T the statistics return (TDT's duration scores, past the softmax's columns; multi-blank's
    big blanks, among them)."""

    W: Tensor
    col_bias: Tensor
    config: Config
    tokens: int
    extra_start: int
    extra: int

    @property
    def n_tiles(self):
        return self.col_bias.size(0) // self.config.tile_n


def projection(
    W: Tensor,
    bias: Optional[Tensor],
    config: Optional[Config] = None,
    tokens: Optional[int] = None,
    extra: Optional[Tuple[int, int]] = None,
) -> Projection:
    """What the kernels take of the output projection, made once for the tiles of a pass.

    Args:
        W (Tensor): ``(V, J)`` bfloat16 or float16 on the GPU: copied where it is not contiguous or does not start
            on a 16-byte boundary (TMA's operands do).
        bias (Tensor or None): ``(V,)``, any floating dtype (added in fp32), or None.
        config (Config or None): the kernels' shape, or None for ``default_config(V, J)``. Default: None.
        tokens (int or None): the softmax's columns, W's first rows (gradient_tile gives the rest zeros); None for
            V. Default: None.
        extra ((int, int) or None): (start, count): ``count`` columns from ``start`` on, at most ``MAX_EXTRA``, whose
            entries of H W^T (without the bias) statistics_tile returns, and on which gradient_tile subtracts a term
            of each row if given; None for the columns past ``tokens``. Default: None.

    Returns:
        Projection: W, the column bias, the shape, the token count and the extra columns.
    """
    if not W.is_contiguous() or W.data_ptr() % 16:
        W = W.clone(memory_format=torch.contiguous_format)
    V = W.size(0)
    tokens = V if tokens is None else tokens
    if not 1 <= tokens <= V:
        raise ValueError(f"tokens: expected a count in [1, V = {V}], got {tokens}")
    start, count = (tokens, V - tokens) if extra is None else extra
    if not (0 <= start and 0 <= count <= MAX_EXTRA and start + count <= V):
        raise ValueError(
            f"extra: expected (start, count), count <= {MAX_EXTRA} columns of the V = {V}, got {(start, count)}"
        )
    config = default_config(V, W.size(1)) if config is None else config
    pingpong_shape = config.pingpong in (1, 2) and config.tile_n in (64, 128) and config[1:4] == (2, 1, 1)
    if config.pingpong and not pingpong_shape:
        raise ValueError(f"config: expected a ping-pong shape (64 or 128, 2, 1, 1, 1 or 2), got {tuple(config)}")
    n_tiles = -(-V // config.tile_n)
    if config.vocab_groups != 1 and not (config.pingpong == 2 and 1 < config.vocab_groups <= n_tiles):
        raise ValueError(
            f"config: expected vocab_groups 1, or at most the {n_tiles} vocabulary tiles with pingpong "
            f"2, got {tuple(config)}"
        )
    col_bias = torch.full((n_tiles * config.tile_n,), float("-inf"), device=W.device, dtype=torch.float32)
    col_bias[:tokens] = 0 if bias is None else bias[:tokens]
    return Projection(W, col_bias, config, tokens, start, count)


def statistics_tile(
    projection: Projection, H: Tensor, labels: Tensor, blank: int, out: Optional[Tensor] = None
) -> Tuple[Tensor, ...]:
    """logits_statistics of ``projection``'s W and bias, without its checks (the fused loss's tiles): the caller
    gives what logits_statistics checks (H of W's dtype and J, rows on 16-byte boundaries and a row stride that is
    a multiple of 8, labels int32 (N,), ``out`` float32 (3 + E, N) of unit column stride, all on W's device).

    Args:
        projection (Projection): ``projection(W, bias, ...)``, with E = ``projection.extra`` extra columns.
        H (Tensor): ``(N, J)``: the hidden rows.
        labels (Tensor): ``(N,)`` int32: each row's label column, or -1.
        blank (int): the blank's column.
        out (Tensor or None): ``(3 + E, N)`` float32 to write into, or None for a new one. Default: None.

    Returns:
        (den, z_blank, z_label, *extra), each ``(N,)`` float32: as logits_statistics over the softmax's columns,
        then ``(H W^T)[r, extra_start + i]`` for each extra column i (no bias).
    """
    N, J = H.shape
    extra = projection.extra
    statistics = torch.empty(3 + extra, N, device=H.device, dtype=torch.float32) if out is None else out
    if N > 0:
        kernel = _compiled(J, projection.n_tiles, H.dtype, projection.config, False, False, extra)
        _launch(kernel, H, *_arguments(H, projection, labels, statistics, H), blank, 0.0, projection.extra_start)
    return tuple(statistics)


def gradient_tile(
    projection: Projection, H: Tensor, labels: Tensor, blank: int, coefficients: Tensor, clamp: float, rows: int = 0
) -> Tensor:
    """logits_gradient of ``projection``'s W and bias, without its checks (the fused loss's tiles): the caller
    gives what logits_gradient checks (as statistics_tile's, and ``coefficients`` float32 (5, N) or (5 + E, N) of
    unit column stride, ``clamp`` >= 0).

    Args:
        projection (Projection): ``projection(W, bias, ...)``, with E = ``projection.extra`` extra columns.
        H (Tensor): ``(N, J)``: the hidden rows.
        labels (Tensor): ``(N,)`` int32: each row's label column, or -1.
        blank (int): the blank's column.
        coefficients (Tensor): ``(5, N)`` float32: each row's den, occupancy, blank arc, label arc and scale; or
            ``(5 + E, N)``: then also each row's term subtracted on extra column i (before the clamp), as the
            blank's and the label's arcs are (multi-blank's big blank arcs).
        clamp (float): the clamp, or 0 for none.
        rows (int): the rows of G returned, if more than N: those past N are zeros (the fused loss's GEMM rows).
            Default: ``0``.

    Returns:
        Tensor: as logits_gradient, with ``max(N, rows)`` rows.
    """
    N, J = H.shape
    extra = coefficients.size(0) - 5
    if extra not in (0, projection.extra):
        raise ValueError(
            f"coefficients: expected 5 or 5 + {projection.extra} rows (the projection's extra columns), "
            f"got {coefficients.size(0)}"
        )
    tile_m = 64 * projection.config.warpgroups
    # whole row tiles, so that the epilogue's stores are whole subtiles: the kernel writes zeros in the last one's rows
    # past N (their den is +inf and their scale 0)
    written = -(-N // tile_m) * tile_m
    G = torch.empty(max(written, rows), projection.col_bias.size(0), device=H.device, dtype=H.dtype)
    if N > 0:
        kernel = _compiled(J, projection.n_tiles, H.dtype, projection.config, True, clamp > 0, extra)
        _launch(kernel, H, *_arguments(H, projection, labels, coefficients, G), blank, clamp, projection.extra_start)
    if rows > written:
        G[written:rows] = 0
    return G[: max(N, rows)]


def _arguments(H, projection, labels, row_values, G):
    """The kernels' arguments but the blank, the clamp and the stream: the tensors' addresses (aligned as TMA needs:
    checked by ``_check``, or given so by the fused loss), the row and column counts and the row strides (the
    statistics pass H for G, which they never touch)."""
    W = projection.W
    return (
        H.data_ptr(),
        W.data_ptr(),
        projection.col_bias.data_ptr(),
        labels.data_ptr(),
        row_values.data_ptr(),
        G.data_ptr(),
        H.size(0),
        W.size(0),
        H.stride(0),
        row_values.stride(0),
        G.stride(0),
    )


def _describe(x):
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)} on {x.device}" + (
            "" if x.is_contiguous() else ", not contiguous"
        )
    return repr(x)
