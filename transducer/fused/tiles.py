"""What the fused loss's two tile paths share: the pass's tensors (``Step``), the tiles' bounds and sizes, the
projection and the hidden, and the interface the paths implement (``TilePath``), chosen in one place
(``tile_path``): transducer/fused/cublas_tiles.py (torch's GEMMs and the stages, every device) and
transducer/fused/hopper_tiles.py (the CuTe DSL kernels of transducer.hopper, sm_90).
"""

import copy
from typing import Iterator, NamedTuple, Optional, Protocol, Tuple

import torch
from torch import Tensor

from ..joiner import Dropout
from ..lattices import Kind, Lattice, LogProbs
from ..layout import Layout
from ..options import LossOptions

__all__ = [
    "Step",
    "TilePath",
    "TilePathBase",
    "tile_path",
    "tiles",
    "first_tile",
    "tiles_after",
    "default_max_rows",
    "gemm_rows",
    "projection",
    "hidden_buffer",
    "hidden",
    "rows_in_place",
    "extra_columns",
]

# Tile buffers (two of the tile's hidden, logits and dh) of about this many bytes when max_rows is not
# given: on CUDA smaller tiles cost launches, host time and GEMM efficiency, on the CPU a few thousand rows
# already keep the GEMMs efficient (the peaks and times: DESIGN.md, Few large tiles on CUDA, small ones on
# the CPU).
_TILE_BYTES = {"cuda": 256 << 20, "cpu": 16 << 20}
_ROW_MULTIPLES = (128, 8)  # the projection's rows are padded to a multiple of the first that costs <= 3%


class Step(NamedTuple):
    """What every tile of one pass (forward or backward) reads: the stages of the inputs' device, the joiner's
    inputs and options (``dropout``: a Dropout or None), the layout, the lattice and its options, the labels, the
    token columns V and the extra columns D (TDT's durations; else 0)."""

    stages: object
    encoder_out: Tensor
    predictor_out: Tensor
    layout: Layout
    activation: str
    dropout: Optional[Dropout]
    kind: Kind
    options: LossOptions
    targets: Tensor
    V: int
    D: int


class TilePath(Protocol):
    """One way to run the fused loss's tiles. ``forward`` writes every row's log-probs (``arrays``, the lattice's
    per-row arrays) over the tiles of ``num_rows`` rows of at most ``max_rows`` rows of hidden and logits;
    ``begin_forward``, called before the host knows the row count (at most ``bound``), launches the first tile's work
    that needs none (``first_tile``; on CUDA) and keeps it for the next ``forward`` (``begun``);
    ``gradient_tiles`` gives, tile by tile over the tiles of ``tiles``, (start, end, hx, dz): the rows [start, end)'s
    hidden ``hx`` (with its bias columns: ``projection``) and the gradient of their logits ``dz`` (rows past end -
    start and columns past the projection's rows zero), each of ``gemm_rows`` rows, for the weight gradient ``dz^T
    hx`` and dh = ``dz W``. ``hx`` is a contiguous tensor in memory of the pass's own, which the next tile
    overwrites: once the weight gradient has read it, dh may take its place (``rows_in_place``). ``Wx`` is
    backward's projection (``projection``); ``for_step`` gives the path for another pass's step (or None, a path
    kept for later) over the same weight, bias and compute dtype, sharing what this one made of them (the eager
    backward takes forward's)."""

    Wx: Tensor

    def begin_forward(self, max_rows: int, bound: int) -> None: ...

    def forward(self, num_rows: int, max_rows: int, arrays: LogProbs) -> None: ...

    def gradient_tiles(
        self, num_rows: int, max_rows: int, lattice: Lattice, scale: Tensor
    ) -> Iterator[Tuple[int, int, Tensor, Tensor]]: ...

    def for_step(self, step: Optional[Step]) -> "TilePath": ...


class TilePathBase:
    """What both tile paths share: ``for_step``, as TilePath says, a shallow copy over another step (the copy keeps
    what this one made of the weight)."""

    step: Optional[Step]
    begun = None  # begin_forward's work, which forward takes

    def for_step(self, step):
        other = copy.copy(self)
        other.step = step
        return other


def tile_path(step: Step, weight: Tensor, bias: Optional[Tensor], compute_dtype: torch.dtype) -> TilePath:
    """The tile path for ``step``: the Hopper kernels where transducer/fused/hopper_tiles.py's ``use_hopper`` says
    they run, else torch's GEMMs and the stages. Both launch their set-up (the projection in the GEMMs' dtype)
    here, before the pass reads the layout on the host."""
    from .cublas_tiles import CublasTiles
    from .hopper_tiles import HopperTiles, use_hopper

    if use_hopper(step.kind, compute_dtype, step.encoder_out.device, step.encoder_out.size(2)):
        return HopperTiles(step, weight, bias, compute_dtype)
    return CublasTiles(step, weight, bias, compute_dtype)


def default_max_rows(J, V, itemsize, device_type="cuda"):
    """Rows per tile so that the two tile buffers alive at a time (hidden and logits, then logits and dh)
    take about 256 MiB on CUDA, 16 MiB on the CPU (at least 256 rows); ``itemsize``: the GEMMs' dtype's."""
    return max(256, _TILE_BYTES.get(device_type, _TILE_BYTES["cuda"]) // ((J + V) * itemsize) // 256 * 256)


def tiles(num_rows: int, max_rows: int) -> Iterator[Tuple[int, int]]:
    """[start, end) of the fewest tiles of at most max_rows rows, of about equal sizes: a small last tile would
    cost a tile's launches and slow, thin GEMMs for little work. Tiles of 64 rows and more start on multiples
    of 8 rows: a GEMM over a tile whose row count is odd (K of the weight gradient's) runs cuBLAS's slower kernels
    for unaligned operands."""
    align = 8 if max_rows >= 64 else 1
    count = -(-num_rows // (max_rows - align + 1))
    bounds = [min(num_rows, -(-(i * num_rows // count) // align) * align) for i in range(count)] + [num_rows]
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            yield start, end


def first_tile(max_rows, bound, device_type):
    """The rows of forward's first tile where it is launched before the host knows the row count (the layout's read,
    which it then overlaps: ``TilePath.begin_forward``): max_rows (on a multiple of 8 from 64 rows on, where ``tiles``
    starts its tiles), on CUDA where ``bound`` on the row count (B * maxT * (maxU+1)) is at least twice that; else 0,
    none (on the CPU nothing overlaps, and a batch of fewer rows than the tile would pay for the tile's rows past its
    own: with the bound at twice the tile's rows, only a batch padded past twice its rows does)."""
    rows = max_rows // 8 * 8 if max_rows >= 64 else max_rows
    return rows if device_type == "cuda" and rows > 0 and bound >= 2 * rows else 0


def tiles_after(first, num_rows, max_rows):
    """The tiles [start, end) of ``num_rows`` rows whose first one was launched as ``first`` rows (``first_tile``):
    [0, min(first, num_rows)), then ``tiles`` of the rows past it."""
    if num_rows <= first:
        return [(0, num_rows)] if num_rows > 0 else []
    return [(0, first)] + [(first + start, first + end) for start, end in tiles(num_rows - first, max_rows)]


def gemm_rows(rows, device_type):
    """The row count a tile's torch GEMMs run on: on CUDA ``rows`` rounded up to a multiple of 1/32 of its
    power of two, and of 8 (the rows past ``rows`` zeros: at most 3.2% more from 256 rows on), elsewhere
    ``rows``. cuBLAS picks its kernel once per shape, at a host cost of up to milliseconds a GEMM, so that tiles
    whose row counts change every step would pay it every step; rounded, a training run's tiles come in a few
    shapes (DESIGN.md: Few GEMM shapes across steps)."""
    if device_type != "cuda":
        return rows
    granule = max(8, 1 << max(0, rows.bit_length() - 6))
    return -(-rows // granule) * granule


def extra_columns(V, D, options):
    """The Hopper kernels' extra columns (hopper.projection's ``extra``): TDT's D duration scores after the V token
    columns, or the multi-blank loss's K big blanks, the columns blank - K ... blank - 1; else none."""
    K = len(options.big_blank_durations)
    return (V, D) if D else (options.blank - K, K)


def projection(weight, bias, compute_dtype):
    """(Wx, W): the output projection in the compute dtype, and with a bias Wx = [W | b | 0] (the bias as
    column J, zero columns up to a multiple of 8) against hidden rows [h | 1 ... 1] (``hidden``): the bias is
    added by the GEMM, and its gradient, the logits' gradient's column sums, comes out of the weight
    gradient's GEMM as column J, or from a GEMV of its own (transducer/fused/op.py: bias_gradient_apart;
    DESIGN.md: The bias gradient from the weight gradient's GEMM). Without a bias, Wx = W. W = Wx[:, :J].

    The rows are padded with zero rows to a multiple of 128 where that adds at most 3% to the GEMMs, else
    of 8: the tile's rows then start on 16-byte boundaries, so that cuBLAS runs its fast kernels on them
    (DESIGN.md: The fused projection padded to a multiple of 128 rows) and the log-probs and gradient
    stages read them in vectors. The stages read the V (+ D) real columns; the padding columns get no
    gradient."""
    rows, J = weight.shape
    pad = next(p for p in (-rows % m for m in _ROW_MULTIPLES) if p <= 0.03 * rows or p < 8)
    cols = J if bias is None else (J + 8) // 8 * 8
    Wx = weight.new_zeros(rows + pad, cols, dtype=compute_dtype)
    Wx[:rows, :J] = weight
    if bias is not None:
        Wx[:rows, J] = bias
    return Wx, Wx[:, :J]


def hidden_buffer(step, Wx, rows):
    """The memory of a pass's hidden tiles (``hidden``'s ``buffer``): ``rows`` rows (its largest tile's) of Wx's
    width and dtype."""
    return step.encoder_out.new_empty(rows, Wx.size(1), dtype=Wx.dtype)


def hidden(step, Wx, start, end, rows=None, buffer=None):
    """The GEMMs' operand against Wx (``projection``) for the rows [start, end), in Wx's dtype: h = dropout(act(
    encoder_out[b, t] + predictor_out[b, u])) (the sum and act in the inputs' promoted dtype, as the unfused
    composition computes them, then rounded to Wx's dtype by the pack pass itself: no tile of the promoted dtype),
    then with a bias columns of ones; ``rows`` rows (``gemm_rows``; default end - start), those past end - start
    zeros in every column, so that their logits are zeros and give dW nothing: one pack pass writes it all. In
    the first rows of ``buffer`` (``hidden_buffer``: a pass's tiles take turns in it), else in a new tensor. The
    backward recomputes act'(a) and the mask from the inputs (pack_backward_add), so h is not kept."""
    rows = rows or end - start
    hx = buffer[:rows] if buffer is not None else step.encoder_out.new_empty(rows, Wx.size(1), dtype=Wx.dtype)
    step.stages.pack_forward(
        step.encoder_out, step.predictor_out, step.layout, end - start, start, step.activation, hx, step.dropout
    )
    return hx


def rows_in_place(hx, width):
    """A contiguous (len(hx), width) tensor in the memory of the contiguous ``hx`` (width <= hx.size(1)): dh takes
    the place of the tile's hidden once the weight gradient has read it, so that a tile holds two buffers at a
    time (``default_max_rows``)."""
    return hx.view(-1)[: hx.size(0) * width].view(hx.size(0), width)
