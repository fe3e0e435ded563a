"""The joiner and the loss in one pass over row tiles: exactly

    transducer_loss(F.linear(act(pack(encoder_out, predictor_out, T, U)), weight, bias), targets, T, U, ...)

without the (sum_TU, V) logits or the (sum_TU, J) hidden in memory, in forward or backward (the idea of
Liger-Kernel's fused linear cross-entropy, for the transducer); with ``durations``, likewise
``tdt_loss(F.linear(...), targets, T, U, durations, ...)`` over a (V + D, J) projection.

Rows are processed in tiles of at most ``max_rows`` (forward's on the Hopper kernels: below): forward packs a tile's
joiner input with the activation applied (one pass), runs the output GEMM, and keeps only the tile's den and blank /
label (and duration) log-probabilities (the log_probs stage); alpha and beta then run over all rows as in the unfused
loss. Backward recomputes each tile's hidden and logits (a fourth GEMM, the price of not storing them), turns the
logits into their gradient in place (the gradient stage), and accumulates dW = dz^T h and db = sum dz (one GEMM: a
bias rides as a column of the projection against a column of ones) and dh = dz W, whose rows, times act'(h), are
summed back into the encoder and predictor gradients (pack's backward, tile by tile, in fp32, the activation's
derivative in the same pass, h recomputed there from the input rows, which stay in cache, rather than kept and read
back). GEMMs go through torch (cuBLAS), except on an sm_90 GPU with the ``hopper`` extra (transducer/fused_hopper.py
says where): there the logits GEMM and the log-probs stage of forward, and the recompute and the gradient stage of
backward, are transducer.hopper's kernels, whose epilogues keep the logits on the chip (the first such call compiles
them and runs their self-test, with a few host reads, once per process and device), and forward's tiles, which hold
only the hidden, take as many rows as fill the bytes of ``max_rows`` rows of hidden and logits. The inputs may have
different dtypes: the sum and the activation run in their promoted dtype, as ``enc + pred`` does, the GEMMs in the
autocast dtype under autocast (else the promoted one) and the loss arithmetic in fp32, as in the unfused path; the
pack passes read the inputs in their own dtypes and write (read) the tiles in the GEMMs' dtype.

The op ``transducer::fused_joiner_loss`` and its backward ``transducer::fused_joiner_loss_backward`` are
registered like ``transducer::loss`` (a ``custom_ops.Op``: an eager path skips the op's Python layers), with the
loss's options flat as there and the lattice (RNN-T, TDT, multi-blank) a ``lattices.Kind``.
Sizing the tiles reads the layout (row count and row_splits) on the host: one device-to-host transfer in
forward; the eager backward takes forward's host copy, a traced one reads it again.
"""

import bisect
import functools
import operator
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ops import accumulate_dtype

from . import cuda_stages, fused_hopper, hopper
from .backend import stages_for
from .checks import (FLOAT_DTYPES, INDEX_DTYPES, bad_labels_error, check_blank, check_tensor, duration_scores_note,
                     is_index, plural)
from .custom_ops import Op, fake_outputs, lattice_of, lattice_outputs, saved_tensors
from .joiner import ACTIVATIONS, Dropout
from .lattices import check_supported, kind_of
from .layout import MAX_ROWS, NUM_STATS, Layout
from .loss import reduce_losses
from .options import BY_NAME, LATTICES, REQUIRED, LossOptions, check_device_limits, joint_checks
from .sharding import full_parameters
from .signatures import Entry, LossModule, Param, check_options, public_function

__all__ = ["fused_joiner_loss", "FusedJoinerLoss"]

# Tile buffers (two of the tile's hidden, logits and dh) of about this many bytes when max_rows is not
# given: on CUDA smaller tiles cost launches, host time and GEMM efficiency, on the CPU a few thousand rows
# already keep the GEMMs efficient (the peaks and times: DESIGN.md, Few large tiles on CUDA, small ones on
# the CPU).
_TILE_BYTES = {"cuda": 256 << 20, "cpu": 16 << 20}


def default_max_rows(J, V, itemsize, device_type="cuda"):
    """Rows per tile so that the two tile buffers alive at a time (hidden and logits, then logits and dh)
    take about 256 MiB on CUDA, 16 MiB on the CPU (at least 256 rows); ``itemsize``: the GEMMs' dtype's."""
    return max(256, _TILE_BYTES.get(device_type, _TILE_BYTES["cuda"]) // ((J + V) * itemsize) // 256 * 256)


def _tiles(num_rows, max_rows):
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


def _gemm_rows(rows, device_type):
    """The row count a tile's torch GEMMs run on: on CUDA ``rows`` rounded up to a multiple of 1/32 of its
    power of two, and of 8 (the rows past ``rows`` zeros: at most 3.2% more from 256 rows on), elsewhere
    ``rows``. cuBLAS picks its kernel once per shape, at a host cost of up to milliseconds a GEMM, so that tiles
    whose row counts change every step would pay it every step; rounded, a training run's tiles come in a few
    shapes (DESIGN.md: Few GEMM shapes across steps)."""
    if device_type != "cuda":
        return rows
    granule = max(8, 1 << max(0, rows.bit_length() - 6))
    return -(-rows // granule) * granule


def _utterances(row_splits, start, end):
    """The utterances [first, last + 1) whose rows meet [start, end) (row_splits: a host list)."""
    return bisect.bisect_right(row_splits, start) - 1, bisect.bisect_left(row_splits, end, lo=1)


def _check_fused_values(encoder_out, predictor_out, targets, vocab_size, extra_columns, stats, blank, big_blanks):
    t_min, t_max, u_min, u_max, cells, bad, _ = stats
    if t_min < 1 or t_max > encoder_out.size(1):
        raise ValueError(f"logit_lengths: expected values in [1, {encoder_out.size(1)}] (encoder_out.size(1)), "
                         f"got [{t_min}, {t_max}]")
    if u_min < 0 or u_max + 1 > predictor_out.size(1) or u_max > targets.size(1):
        raise ValueError(f"target_lengths: expected values in [0, {min(predictor_out.size(1) - 1, targets.size(1))}] "
                         f"(predictor_out.size(1) - 1 and targets.size(1)), got [{u_min}, {u_max}]")
    if cells > MAX_ROWS:  # a saturated count (CELLS_CAP) is larger too
        raise ValueError(f"logit_lengths, target_lengths: sum_b T_b*(U_b+1) = {cells} rows; at most 2^31 - 1 are "
                         f"supported")
    if bad:
        extra = duration_scores_note(extra_columns, vocab_size + extra_columns, "weight's", "rows") \
            if extra_columns else ""
        raise bad_labels_error(targets, stats, vocab_size, blank, big_blanks, extra)


def _fused_forward(encoder_out: Tensor, predictor_out: Tensor, weight: Tensor, bias: Optional[Tensor],
                   targets: Tensor, logit_lengths: Tensor, target_lengths: Tensor, option_ints: List[int],
                   option_floats: List[float], activation: str, dropout: float, seed: Tensor, check_inputs: bool,
                   compute_dtype: torch.dtype, max_rows: int, static_shapes: bool
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                              Tensor]:
    """(nll, *custom_ops.lattice_outputs)."""
    options = LossOptions.from_flat(option_ints, option_floats)
    kind = kind_of(options)
    check_supported(options, kind, encoder_out.device.type)
    stages = stages_for(encoder_out.device)
    D = kind.extra_columns(options)
    V = weight.size(0) - D  # the token columns
    big = len(options.big_blank_durations)
    layout = stages.layout(logit_lengths, target_lengths, targets.size(1) + 1, 0, targets, V, options.blank,
                           check_inputs, big)
    hopper_tiles = fused_hopper.use_hopper(kind, compute_dtype, encoder_out.device, encoder_out.size(2))
    if hopper_tiles:  # Wx = W: the kernel adds the bias in its epilogue; both launched before the wait below
        Wx = weight.to(compute_dtype).contiguous()
        projection = hopper.projection(Wx, bias, tokens=V, extra=_extra_columns(V, D, options))
    else:
        Wx, _ = _projection(weight, bias, compute_dtype)
    table = layout.table.tolist()  # the row count and row_splits size the tiles: one transfer
    B = layout.batch_size
    layout.table.host_row_splits = table[3 * B:4 * B + 1]  # for the eager backward (_setup_context)
    if check_inputs:
        _check_fused_values(encoder_out, predictor_out, targets, V, D, table[-NUM_STATS:], options.blank, big)
    num_rows = table[4 * B]
    bound = _capacity(encoder_out, predictor_out)
    if num_rows > bound:
        raise ValueError(f"logit_lengths, target_lengths: sum_b T_b*(U_b+1) = {num_rows} rows exceeds "
                         f"B * maxT * (maxU+1) = {bound}")
    # static_shapes (set while torch.compile traces): the per-row arrays have room for B * maxT * (maxU+1)
    # rows, a bound known from the shapes, so that the op's outputs have static shapes, and the rows past
    # num_rows hold zeros; in eager mode they have num_rows rows.
    capacity = bound if static_shapes else num_rows
    new = encoder_out.new_zeros if static_shapes else encoder_out.new_empty  # the tiles write rows < num_rows
    arrays = kind.new_arrays(functools.partial(new, dtype=accumulate_dtype(compute_dtype)), capacity, options)
    joiner = (activation, Dropout(dropout, int(seed)) if dropout else None)
    if hopper_tiles:  # each row's den, z_blank, z_label (and duration or big blank scores), then the log-probs
        labels = cuda_stages.row_labels(targets, layout, options.blank, num_rows)
        statistics = encoder_out.new_empty(3 + projection.extra, num_rows, dtype=torch.float32)
    # the Hopper kernels' tiles hold only the hidden: as many rows as fill the bytes of a tile of hidden and logits
    J = encoder_out.size(2)
    forward_rows = max_rows * (J + weight.size(0)) // J if hopper_tiles else max_rows
    for start, end in _tiles(num_rows, forward_rows):
        if hopper_tiles:  # no torch GEMM in forward
            hx = _hidden(stages, encoder_out, predictor_out, layout, start, end, joiner, Wx)
            hopper.statistics_tile(projection, hx, labels[start:end], options.blank, statistics[:, start:end])
        else:
            rows = end - start
            hx = _hidden(stages, encoder_out, predictor_out, layout, start, end, joiner, Wx,
                         _gemm_rows(rows, encoder_out.device.type))
            z = F.linear(hx, Wx)[:rows]
            kind.log_probs(stages, z[:, :V], z[:, V:V + D] if D else None, targets, layout, options, start, arrays)
            del z
        del hx
    if hopper_tiles:  # the extra columns' bias: the kernel's statistics have none
        first, count = projection.extra_start, projection.extra
        extra_bias = None if bias is None or not count else bias[first:first + count].to(torch.float32).contiguous()
        if D:
            cuda_stages.tdt_row_log_probs(statistics, extra_bias, targets, layout, options, arrays)
        else:
            cuda_stages.row_log_probs(statistics, targets, layout, options, arrays.lp, arrays.den, arrays.lp_arcs,
                                      extra_bias)
    lattice = kind.lattice(stages, layout, arrays, options)
    if capacity > num_rows:
        for x in (lattice.alpha, lattice.beta) + (lattice.rnnt[:2] if lattice.rnnt else ()):
            x[num_rows:] = 0
    return (kind.nll(lattice, options),) + lattice_outputs(lattice)


_ROW_MULTIPLES = (128, 8)  # the projection's rows are padded to a multiple of the first that costs <= 3%


def _extra_columns(V, D, options):
    """The Hopper kernels' extra columns (hopper.projection's ``extra``): TDT's D duration scores after the V token
    columns, or the multi-blank loss's K big blanks, the columns blank - K ... blank - 1; else none."""
    K = len(options.big_blank_durations)
    return (V, D) if D else (options.blank - K, K)


def _projection(weight, bias, compute_dtype):
    """(Wx, W): the output projection in the compute dtype, and with a bias Wx = [W | b | 0] (the bias as
    column J, zero columns up to a multiple of 8) against hidden rows [h | 1 ... 1] (_hidden): the bias is
    added by the GEMM, and its gradient, the logits' gradient's column sums, comes out of the weight
    gradient's GEMM as column J, or from a GEMV of its own (_bias_gradient_apart; DESIGN.md: The bias gradient
    from the weight gradient's GEMM). Without a bias, Wx = W. W = Wx[:, :J].

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


def _hidden(stages, encoder_out, predictor_out, layout, start, end, joiner, Wx, gemm_rows=None):
    """The GEMMs' operand against Wx (_projection) for the rows [start, end), in Wx's dtype: h = dropout(act(
    encoder_out[b, t] + predictor_out[b, u])) (``joiner`` = (activation, Dropout or None); the sum and act in
    the inputs' promoted dtype, as the unfused composition computes them, then rounded to Wx's dtype by the
    pack pass itself: no tile of the promoted dtype), then with a bias columns of ones; ``gemm_rows`` rows
    (_gemm_rows; default end - start), those past end - start zeros in every column, so that their logits are
    zeros and give dW nothing. The backward recomputes act'(a) and the mask from the inputs
    (pack_backward_add), so h is not kept."""
    J, rows = encoder_out.size(2), end - start
    hx = encoder_out.new_empty(gemm_rows or rows, Wx.size(1), dtype=Wx.dtype)
    if hx.size(0) > rows:
        hx[rows:] = 0
    if Wx.size(1) > J:  # a bias: its columns of ones
        hx[:rows, J:] = 1
    stages.pack_forward(encoder_out, predictor_out, layout, rows, start, joiner[0], hx[:rows, :J], joiner[1])
    return hx


# torch's addmm accumulating 16-bit operands' product into a float32 tensor on CUDA: out_dtype came in torch 2.8, but
# a float32 ``self`` beside 16-bit operands was refused there (pytorch/pytorch#154086); used from 2.11, the release
# this runs on in its GPU tests
_ADDMM_OUT_DTYPE = torch.__version__ >= "2.11" and hasattr(torch.ops.aten.addmm, "dtype_out")


def _add_product(acc, a, b):
    """acc += a @ b, accumulated by the GEMM into ``acc`` (its epilogue's beta = 1) where it can: operands of acc's
    dtype, or 16-bit ones on CUDA with a float32 ``acc``; else the product in the operands' dtype, then added. A
    tile's weight gradient then costs no pass of its own over dW, nor a rounding to 16 bits."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _ADDMM_OUT_DTYPE and acc.is_cuda and acc.dtype == torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += a.mm(b)


def _bias_gradient_apart(hx, J):
    """Whether the weight gradient's GEMM takes the J columns of the hidden alone and db (its column J) a GEMV of its
    own: for fp32 tiles on CUDA without TF32 where J is a multiple of 64, as cuBLAS's SIMT fp32 GEMMs run slower at
    the J + 8 columns that put db into the GEMM (DESIGN.md: The bias gradient from the weight gradient's GEMM)."""
    return hx.is_cuda and hx.dtype == torch.float32 and J % 64 == 0 and not _tf32_matmul()


def _tf32_matmul():
    """Whether CUDA's fp32 matmuls may run in TF32: torch.backends.cuda.matmul.fp32_precision from torch 2.9 (it also
    reflects the older settings, whose getters raise once this one is set), else allow_tf32."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    return precision == "tf32" if precision is not None else torch.backends.cuda.matmul.allow_tf32


def _capacity(encoder_out, predictor_out):
    return encoder_out.size(0) * encoder_out.size(1) * predictor_out.size(1)


def _fused_backward(grad_nll: Tensor, encoder_out: Tensor, predictor_out: Tensor, weight: Tensor,
                    bias: Optional[Tensor], targets: Tensor, table: Tensor, lp: Tensor, den: Tensor, lp_arcs: Tensor,
                    den_arcs: Tensor, alpha: Tensor, beta: Tensor, nll: Tensor, alpha_r: Tensor, beta_r: Tensor,
                    rnnt_nll: Tensor, option_ints: List[int], option_floats: List[float], activation: str,
                    dropout: float, seed: Tensor, compute_dtype: torch.dtype, max_rows: int,
                    row_splits: Optional[List[int]]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_encoder_out, grad_predictor_out, grad_weight, grad_bias) of sum_b grad_nll[b] * loss[b], each in
    its input's dtype; the last is zeros when there is no bias. ``row_splits``: the layout's, on the host (the
    eager path has forward's), or None to read them from ``table``."""
    options = LossOptions.from_flat(option_ints, option_floats)
    kind = kind_of(options)
    stages = stages_for(encoder_out.device)
    B, max_t, J = encoder_out.shape
    D = kind.extra_columns(options)
    V = weight.size(0) - D
    layout = Layout(table, False, targets.size(1) + 1)
    lattice = lattice_of(layout, (lp, den, lp_arcs, den_arcs, alpha, beta, nll, alpha_r, beta_r, rnnt_nll), options)
    acc = lp.dtype
    grad_enc = encoder_out.new_zeros(B, max_t, J, dtype=acc)
    grad_pred = predictor_out.new_zeros(B, predictor_out.size(1), J, dtype=acc)
    Wx, W = _projection(weight, bias, compute_dtype)
    hopper_tiles = fused_hopper.use_hopper(kind, compute_dtype, encoder_out.device, J)
    if hopper_tiles:  # the kernel's operand; it adds the bias itself
        projection = hopper.projection(weight.to(compute_dtype), bias, tokens=V, extra=_extra_columns(V, D, options))
    grad_wx = weight.new_zeros(Wx.shape, dtype=acc)  # [dW | db | ...] (_projection)
    scale = grad_nll.to(acc)
    if row_splits is None:
        row_splits = layout.row_splits.tolist()  # a transfer, after the launches above
    joiner = (activation, Dropout(dropout, int(seed)) if dropout else None)
    for start, end in _tiles(row_splits[-1], max_rows):
        tile_rows = end - start
        if hopper_tiles and D:  # the tile's rows' labels and gradient coefficients for the kernel, and TDT's
            coefficients, labels, duration_gradient = cuda_stages.tdt_row_coefficients(
                targets, lattice, scale, options, start, tile_rows, compute_dtype)
        elif hopper_tiles:
            coefficients, labels = cuda_stages.row_coefficients(targets, lattice, scale, options, start, tile_rows)
        hx = _hidden(stages, encoder_out, predictor_out, layout, start, end, joiner, Wx,
                     _gemm_rows(tile_rows, encoder_out.device.type))
        width = Wx.size(0)
        if hopper_tiles:  # the gradient from the recompute's epilogue; it and Wx are zeros past V
            dz = hopper.gradient_tile(projection, hx[:tile_rows, :J], labels, options.blank, coefficients,
                                      max(options.clamp, 0.0), hx.size(0))
            if D:  # the duration columns, zeros from the kernel
                dz[:tile_rows, V:V + D] = duration_gradient
            width = min(dz.size(1), width)
            dz = dz[:, :width]
        else:
            dz = F.linear(hx, Wx)  # the tile's logits, turned into their gradient in place; zeros past tile_rows
            tokens, extra = dz[:tile_rows, :V], dz[:tile_rows, V:V + D] if D else None
            kind.gradient(stages, tokens, extra, targets, lattice, scale, options, tokens, extra, start)
            del tokens, extra  # views of dz, which is freed below: a view left alive kept a third tile buffer
            if W.size(0) > weight.size(0):  # the padding columns: no gradient (and no NaN from a non-finite h)
                dz[:, weight.size(0):] = 0
        if Wx.size(1) > J and _bias_gradient_apart(hx, J):
            _add_product(grad_wx[:width, :J], dz.t(), hx[:, :J])
            grad_wx[:width, J].addmv_(dz.t(), hx[:, J])
        else:
            _add_product(grad_wx[:width], dz.t(), hx)
        del hx  # a tile holds two of (hidden, logits, dh) at a time: default_max_rows
        dh = dz.mm(W[:width])
        del dz
        # dh in the compute dtype: pack_backward_add reads it as it is, with the inputs of their own dtypes
        stages.pack_backward_add(dh[:tile_rows], layout, start, _utterances(row_splits, start, end), grad_enc,
                                 grad_pred, (encoder_out, predictor_out), *joiner)
        del dh
    rows = weight.size(0)  # without the padding rows
    grad_w = grad_wx[:rows, :J].to(weight.dtype).contiguous()
    grad_b = grad_wx[:rows, J].clone() if bias is not None else grad_wx.new_zeros(rows)  # outputs may not alias
    return grad_enc.to(encoder_out.dtype), grad_pred.to(predictor_out.dtype), grad_w, grad_b.to(weight.dtype)


def _setup_context(ctx, inputs, output):
    (encoder_out, predictor_out, weight, bias, targets, _, _, option_ints, option_floats, activation, dropout, seed,
     _, compute_dtype, max_rows, _) = inputs
    nll, *lattice = output
    ctx.mark_non_differentiable(*lattice)
    ctx.save_for_backward(encoder_out, predictor_out, weight, bias, targets, *lattice, seed)
    ctx.option_flat = (option_ints, option_floats)
    ctx.joiner = (activation, dropout, compute_dtype, max_rows)
    # the eager path's backward sizes its tiles with forward's host copy of row_splits (no transfer); a traced
    # backward must not bake one batch's row_splits into its graph
    ctx.row_splits = getattr(lattice[0], "host_row_splits", None) if getattr(ctx, "eager", False) else None


def _gradient(ctx, grad_nll, backward):
    *tensors, seed = saved_tensors(ctx)
    activation, dropout, compute_dtype, max_rows = ctx.joiner
    grad_enc, grad_pred, grad_w, grad_b = backward(grad_nll, *tensors, *ctx.option_flat, activation, dropout, seed,
                                                   compute_dtype, max_rows, ctx.row_splits)
    bias = tensors[3]
    return {"encoder_out": grad_enc, "predictor_out": grad_pred, "weight": grad_w,
            "bias": None if bias is None else grad_b}


fused = Op("fused_joiner_loss", _fused_forward, _fused_backward, _setup_context, _gradient)
fused_op, fused_backward_op = fused.op, fused.backward_op


@fused_op.register_fake
def _(encoder_out, predictor_out, weight, bias, targets, logit_lengths, target_lengths, option_ints, option_floats,
      activation, dropout, seed, check_inputs, compute_dtype, max_rows, static_shapes):
    rows = _capacity(encoder_out, predictor_out) if static_shapes else torch.library.get_ctx().new_dynamic_size()
    return fake_outputs(encoder_out, accumulate_dtype(compute_dtype), logit_lengths.size(0), rows,
                        LossOptions.from_flat(option_ints, option_floats))


@fused_backward_op.register_fake
def _(grad_nll, encoder_out, predictor_out, weight, bias, *rest):
    return (torch.empty_like(encoder_out), torch.empty_like(predictor_out), torch.empty_like(weight),
            weight.new_empty(weight.size(0)))


_TENSORS = (
    Param("encoder_out", "Tensor", "``(B, maxT, J)``, ``J >= 1``, float16 / bfloat16 / float32 / float64."),
    Param("predictor_out", "Tensor", "``(B, maxU+1, J)``, a floating dtype (may differ from encoder_out's), same "
          "device."),
    Param("weight", "Tensor", "``(V, J)``, the output projection (a ``Linear(J, V)``'s weight); with ``durations``, "
          "``(V + D, J)``: V token rows then D duration rows (NeMo's joint layout)."),
    Param("bias", "Tensor", "``(weight.size(0),)``, or None.", REQUIRED),
    Param("targets", "Tensor", "``(B, S)`` int32 / int64, ``S >= max U_b``, labels in ``[0, V)``, not a blank."),
    Param("logit_lengths", "Tensor", "``(B,)`` int32 / int64, ``1 <= T_b <= maxT``."),
    Param("target_lengths", "Tensor", "``(B,)`` int32 / int64, ``0 <= U_b <= maxU``."),
)
_DOCS = {
    "blank": "the blank's column among the token rows of ``weight``, in ``[-V, V)``; negative counts from the end.",
    "check_inputs": "check lengths and labels against the tensors; sizing the tiles reads the layout on the host "
                    "whatever check_inputs (one transfer in forward; the eager backward reuses it, a traced one "
                    "reads it again).",
    "durations": "TDT's durations, as for :func:`transducer.tdt_loss`: the loss is TDT's, over ``weight``'s last "
                 "D = len(durations) rows (not with one_sym_per_frame).",
    "big_blank_durations": "as for :func:`transducer.multiblank_loss` (with ``sigma``): the multi-blank loss.",
}
FUSED_JOINER_LOSS = Entry("fused_joiner_loss", LATTICES, _TENSORS, exclude=("from_log_softmax",), docs=_DOCS)


def _checked(options, device, blank_columns, columns):
    """The loss's checked options and the joiner's: (LossOptions, call options); ``blank_columns``: the token
    columns the blank is checked against (None: only its type, a module before a call)."""
    o = check_options(options)
    call = {name: o.pop(name) for name in _JOINER_OPTIONS if name in o}
    if blank_columns is not None:
        o["blank"] = check_blank(o["blank"], blank_columns, columns)
    loss_options = LossOptions(**o)
    kind = kind_of(loss_options)
    check_supported(loss_options, kind, device.type if device is not None else None)
    if device is not None:
        check_device_limits(loss_options, device)
    if blank_columns is not None:
        joint_checks(loss_options)
    return loss_options, call


# the options of the call, not of the lattice
_JOINER_OPTIONS = ("reduction", "zero_infinity", "check_inputs", "activation", "dropout", "generator", "max_rows")


def _fused_joiner_loss(encoder_out, predictor_out, weight, bias, targets, logit_lengths, target_lengths, options):
    r"""The joiner ``F.linear(dropout(act(encoder_out[b, t] + predictor_out[b, u])), weight, bias)`` and the
    transducer loss over its logits, without the logits or the joiner's hidden in memory.

    Equal to ``transducer_loss(F.linear(act(pack(encoder_out, predictor_out, T, U)), weight, bias), targets,
    T, U, ...)`` with the same options (:func:`transducer.transducer_loss`); with ``durations``, to
    ``tdt_loss(F.linear(...), targets, T, U, durations, ...)`` (:func:`transducer.tdt_loss`); with
    ``big_blank_durations``, to ``multiblank_loss(F.linear(...), ...)`` (:func:`transducer.multiblank_loss`).
    Gradients flow to ``encoder_out``, ``predictor_out``, ``weight`` and ``bias``, each in its own dtype.

    Args:
        {args}

    Returns:
        Tensor: float32 loss (float64 for float64 inputs): ``(B,)`` for ``"none"``, else a scalar. Memory: a few
        floats per row of the grids (under torch.compile, per row of B * maxT * (maxU+1), a bound known from
        the shapes) plus one tile of ``max_rows * (J + V)``. The sum and the activation run in the inputs'
        promoted dtype (as ``enc + pred``), the GEMMs in the autocast dtype under autocast (else the promoted
        one), the loss arithmetic in fp32.

    Example::

        >>> enc, pred = torch.randn(2, 5, 8, requires_grad=True), torch.randn(2, 4, 8, requires_grad=True)
        >>> joiner = torch.nn.Linear(8, 6)
        >>> loss = fused_joiner_loss(enc, pred, joiner.weight, joiner.bias, torch.tensor([[1, 2, 3], [4, 5, 0]]),
        ...                          torch.tensor([5, 3]), torch.tensor([3, 2]))
        >>> loss.backward()
    """
    weight, bias = full_parameters(weight, bias, encoder_out=encoder_out, predictor_out=predictor_out, targets=targets,
                                   logit_lengths=logit_lengths, target_lengths=target_lengths)  # FSDP2's shards
    check_tensor("encoder_out", encoder_out, FLOAT_DTYPES, (3,), None)
    device = encoder_out.device
    check_tensor("predictor_out", predictor_out, FLOAT_DTYPES, (3,), device, "encoder_out")
    check_tensor("weight", weight, FLOAT_DTYPES, (2,), device, "encoder_out")
    if bias is not None:
        check_tensor("bias", bias, FLOAT_DTYPES, (1,), device, "encoder_out")
    check_tensor("targets", targets, INDEX_DTYPES, (2,), device, "encoder_out")
    check_tensor("logit_lengths", logit_lengths, INDEX_DTYPES, (1,), device, "encoder_out")
    check_tensor("target_lengths", target_lengths, INDEX_DTYPES, (1,), device, "encoder_out")
    B, _, J = encoder_out.shape
    if J == 0:
        raise ValueError(f"encoder_out: expected rows of at least one entry (B, maxT, J >= 1), got shape "
                         f"{tuple(encoder_out.shape)}")
    rows = weight.size(0)  # the token columns and, with durations, the duration columns
    durations = options.get("durations")
    D = len(BY_NAME["durations"].check(durations))
    if rows - D < 2:
        before = f" before the {D} duration rows" if D else ""
        raise ValueError(f"weight: expected at least 2 token rows{before}, got shape {tuple(weight.shape)}")
    options, call = _checked(options, device, rows - D, "the token rows of weight")
    if B == 0:
        raise ValueError("encoder_out: expected at least one utterance, got an empty batch")
    if predictor_out.size(0) != B or predictor_out.size(2) != J:
        raise ValueError(f"predictor_out: expected shape ({B}, maxU+1, {J}) to match encoder_out "
                         f"{tuple(encoder_out.shape)}, got {tuple(predictor_out.shape)}")
    if weight.size(1) != J:
        raise ValueError(f"weight: expected shape (V, {J}) (J = encoder_out.size(2)), got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"bias: expected shape ({rows},) (weight.size(0)), got {tuple(bias.shape)}")
    for name, x in (("logit_lengths", logit_lengths), ("target_lengths", target_lengths), ("targets", targets)):
        if x.size(0) != B:
            raise ValueError(f"{name}: expected {plural(B, 'entry', 'entries')} along dim 0 (one per utterance), "
                             f"got shape {tuple(x.shape)}")
    dropout, max_rows = call["dropout"], call["max_rows"]
    # the GEMMs' dtype: the autocast dtype, as F.linear under autocast takes it, else the inputs' promoted one
    compute_dtype = torch.promote_types(encoder_out.dtype, predictor_out.dtype)
    if torch.is_autocast_enabled(device.type) and compute_dtype != torch.float64:
        compute_dtype = torch.get_autocast_dtype(device.type)
    if max_rows is None:
        max_rows = default_max_rows(J, rows, torch.finfo(compute_dtype).bits // 8, device.type)
    # dropout's seed: 63 bits from a CPU generator, a CPU tensor (no device work, and torch.compile traces it)
    seed = torch.randint((1 << 63) - 1, (), generator=call["generator"]) if dropout else \
        torch.zeros((), dtype=torch.int64)
    inputs = (encoder_out.contiguous(), predictor_out.contiguous(), weight, bias, targets.contiguous(), logit_lengths,
              target_lengths, *options.flat(), call["activation"], dropout, seed, call["check_inputs"], compute_dtype,
              max_rows, torch.compiler.is_compiling())
    with torch.autocast(device.type, enabled=False):  # the op casts for its GEMMs itself
        nll = fused(*inputs)[0]
    return reduce_losses(nll, call["reduction"], call["zero_infinity"])


fused_joiner_loss = public_function(FUSED_JOINER_LOSS, _fused_joiner_loss)


_MODULE_PARAMS = (
    Param("joiner_dim", "int", "J >= 1, the width of ``enc + pred``."),
    Param("vocab_size", "int", "V >= 2, the token columns (blank included)."),
    "activation",
    Param("bias", "bool", "the projection has a bias.", True),
    "blank", "reduction", "one_sym_per_frame", "zero_infinity", "check_inputs", "max_rows", "clamp", "fastemit_lambda",
    "delay_penalty", "durations", "sigma", "omega", "big_blank_durations", "dropout",
    Param("device", "torch.device", "the projection's device.", None),
    Param("dtype", "torch.dtype", "the projection's dtype.", None),
)
_MODULE_DOCS = dict(_DOCS, blank="the blank's column; negative counts from the end.",
                    dropout="the rate of dropout on the joiner's hidden in training mode, as for "
                            ":func:`fused_joiner_loss` (its seed drawn from torch's default CPU generator); none in "
                            "eval mode.")
_MODULE = Entry("FusedJoinerLoss", LATTICES, _MODULE_PARAMS, exclude=("from_log_softmax",), docs=_MODULE_DOCS)


class FusedJoinerLoss(LossModule, entry=_MODULE):
    """A joiner ``output(act(enc + pred))`` and the transducer loss over it, fused (:func:`fused_joiner_loss`).

    ``loss = m(encoder_out, predictor_out, targets, T, U)`` trains; ``m.logits(enc, pred)`` gives the joiner's
    logits for decoding, with broadcasting (for example enc ``(B, T, 1, J)`` and pred ``(B, 1, U+1, J)``).
    The module owns the output projection as ``m.output`` (a ``Linear(joiner_dim, vocab_size)``), so a model
    swaps its joiner's last layer for it and keeps the weights. With ``durations`` (TDT) the projection is a
    ``Linear(joiner_dim, vocab_size + len(durations))``: token scores then duration scores, as
    :func:`transducer.tdt_loss` reads them; with ``big_blank_durations`` the big blanks are among the
    ``vocab_size`` columns, before the blank.

    Args:
        {args}

    Example::

        >>> m = FusedJoinerLoss(8, 6)
        >>> enc, pred = torch.randn(2, 5, 8), torch.randn(2, 4, 8)
        >>> m(enc, pred, torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([5, 3]), torch.tensor([3, 2])).backward()
        >>> m.logits(enc[:, :, None], pred[:, None]).shape
        torch.Size([2, 5, 4, 6])
    """

    def build(self, joiner_dim, vocab_size, bias, device=None, dtype=None):
        """The projection, ``Linear(joiner_dim, vocab_size + len(durations))``; the blank checked against
        ``vocab_size``, the options against one another."""
        for name, value, least in (("joiner_dim", joiner_dim, 1), ("vocab_size", vocab_size, 2)):
            if not is_index(value):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
            if value < least:
                raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
        joiner_dim, vocab_size = operator.index(joiner_dim), operator.index(vocab_size)
        loss_options, _ = _checked(self.options, None, vocab_size, "vocab_size")
        self.options["blank"] = loss_options.blank
        self.output = torch.nn.Linear(joiner_dim, vocab_size + len(loss_options.durations), bias=bias,
                                      device=device, dtype=dtype)

    def forward(self, encoder_out, predictor_out, targets, logit_lengths, target_lengths):
        """The loss of the joiner over ``encoder_out`` (B, maxT, J) and ``predictor_out`` (B, maxU+1, J) with the
        module's projection and options (see :func:`fused_joiner_loss`)."""
        options = dict(self.options, dropout=self.options["dropout"] if self.training else 0.0)
        return fused_joiner_loss(encoder_out, predictor_out, self.output.weight, self.output.bias, targets,
                                 logit_lengths, target_lengths, **options)

    def logits(self, encoder_out, predictor_out):
        """``output(act(encoder_out + predictor_out))`` with broadcasting, for decoding."""
        return self.output(ACTIVATIONS[self.options["activation"]].forward(encoder_out + predictor_out))
