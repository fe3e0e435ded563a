"""The fused joiner loss's registered op: the joiner and the loss in one pass over row tiles, exactly

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
back). The tiles run on one of two paths (transducer/fused/tiles.py's TilePath, chosen by ``tile_path``): torch's GEMMs
(cuBLAS) and the stages (transducer/fused/cublas_tiles.py), or on an sm_90 GPU with the ``hopper`` extra
(transducer/fused/hopper_tiles.py says where) the path where the logits GEMM and the log-probs stage of forward,
and the recompute and the gradient stage of backward, are transducer.hopper's kernels, whose epilogues keep the logits on the chip (the first such call compiles
them and runs their self-test, with a few host reads, once per process and device), and forward's tiles, which hold
only the hidden, take as many rows as fill the bytes of ``max_rows`` rows of hidden and logits. The inputs may have
different dtypes: the sum and the activation run in their promoted dtype, as ``enc + pred`` does, the GEMMs in the
autocast dtype under autocast (else the promoted one) and the loss arithmetic in fp32, as in the unfused path; the
pack passes read the inputs in their own dtypes and write (read) the tiles in the GEMMs' dtype.

The op ``transducer::fused_joiner_loss`` and its backward ``transducer::fused_joiner_loss_backward`` are
registered like ``transducer::loss`` (a ``custom_ops.Op``: an eager path skips the op's Python layers), with the
loss's options flat as there and the lattice (RNN-T, TDT, multi-blank) a ``lattices.Kind``.
Sizing the tiles reads the layout (row count and row_splits) on the host: one device-to-host transfer in
forward, which on CUDA the first tile's work launched before it overlaps (TilePath.begin_forward); the eager backward
takes forward's host copy, a traced one reads it again. The eager backward also takes
forward's tile path, with the projections it made of the weight (docs/design.md: The eager backward takes forward's
projections).
"""

import bisect
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ops import accumulate_dtype
from ops.cuda import host_reader

from ..backend import stages_for
from ..checks import bad_labels_error, duration_scores_note, row_count
from ..custom_ops import Op, fake_outputs, lattice_of, lattice_outputs, saved_tensors
from ..joiner import Dropout
from ..lattices import check_supported, kind_of
from ..layout import MAX_ROWS, NUM_STATS, LabelCheck, Layout
from ..options import LossOptions
from .tiles import Step, rows_in_place, tile_path

__all__ = ["fused", "fused_op", "fused_backward_op", "capacity", "tf32_matmul"]


def _step(encoder_out, predictor_out, weight, targets, layout, option_flat, joiner):
    """The Step of a pass (transducer/fused/tiles.py), from the op's arguments; ``joiner``: (activation, dropout,
    dropout's seed)."""
    activation, dropout, seed = joiner
    options = LossOptions.from_flat(*option_flat)
    kind = kind_of(options)
    D = kind.extra_columns(options)
    return Step(
        stages_for(encoder_out.device),
        encoder_out,
        predictor_out,
        layout,
        activation,
        Dropout(dropout, int(seed)) if dropout else None,
        kind,
        options,
        targets,
        weight.size(0) - D,
        D,
    )


def _check_fused_values(encoder_out, predictor_out, targets, vocab_size, extra_columns, stats, blank, big_blanks):
    t_min, t_max, u_min, u_max, cells, bad, _ = stats
    if t_min < 1 or t_max > encoder_out.size(1):
        raise ValueError(
            f"logit_lengths: expected values in [1, {encoder_out.size(1)}] (encoder_out.size(1)), "
            f"got [{t_min}, {t_max}]"
        )
    if u_min < 0 or u_max + 1 > predictor_out.size(1) or u_max > targets.size(1):
        raise ValueError(
            f"target_lengths: expected values in [0, {min(predictor_out.size(1) - 1, targets.size(1))}] "
            f"(predictor_out.size(1) - 1 and targets.size(1)), got [{u_min}, {u_max}]"
        )
    if cells > MAX_ROWS:  # a saturated count (CELLS_CAP) is larger too
        raise ValueError(
            f"logit_lengths, target_lengths: sum_b T_b*(U_b+1) = {row_count(cells)} rows; at most "
            f"2^31 - 1 are supported"
        )
    if bad:
        extra = (
            duration_scores_note(extra_columns, vocab_size + extra_columns, "weight's", "rows") if extra_columns else ""
        )
        raise bad_labels_error(targets, stats, vocab_size, blank, big_blanks, extra)


def capacity(encoder_out, predictor_out):
    """B * maxT * (maxU+1): the rows the shapes allow, at least the layout's."""
    return encoder_out.size(0) * encoder_out.size(1) * predictor_out.size(1)


def _table_reader(table):
    """On CUDA, a reader of the layout's ``table`` marked behind the layout (ops.cuda.HostReader: the work queued
    after the mark runs on while the host reads), of a power-of-two size, so that a run's batch sizes share a few;
    else None."""
    if not table.is_cuda:
        return None
    reader = host_reader(table.device, 1 << (table.numel() - 1).bit_length(), table.dtype)
    reader.mark()
    return reader


def _fused_forward(
    encoder_out: Tensor,
    predictor_out: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    option_ints: List[int],
    option_floats: List[float],
    activation: str,
    dropout: float,
    seed: Tensor,
    check_inputs: bool,
    compute_dtype: torch.dtype,
    max_rows: int,
    static_shapes: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(nll, *custom_ops.lattice_outputs)."""
    return _forward(
        encoder_out,
        predictor_out,
        weight,
        bias,
        targets,
        logit_lengths,
        target_lengths,
        option_ints,
        option_floats,
        activation,
        dropout,
        seed,
        check_inputs,
        compute_dtype,
        max_rows,
        static_shapes,
    )[0]


def _forward(
    encoder_out,
    predictor_out,
    weight,
    bias,
    targets,
    logit_lengths,
    target_lengths,
    option_ints,
    option_floats,
    activation,
    dropout,
    seed,
    check_inputs,
    compute_dtype,
    max_rows,
    static_shapes,
):
    """_fused_forward's outputs, and what the eager backward takes of its work on the host: (outputs,
    (row_splits, path)), the layout's row_splits as a list and the tile path (with its projections)."""
    options = LossOptions.from_flat(option_ints, option_floats)
    kind = kind_of(options)
    check_supported(options, kind, encoder_out.device.type)
    stages = stages_for(encoder_out.device)
    D = kind.extra_columns(options)
    V = weight.size(0) - D  # the token columns
    big = len(options.big_blank_durations)
    layout = stages.layout(
        logit_lengths, target_lengths, targets.size(1) + 1, 0, LabelCheck(targets, V, options.blank, big), check_inputs
    )
    # the row count and row_splits size the tiles: one transfer, behind the layout alone on CUDA, where the tile
    # path's set-up and the first tile's work run on while the host waits for it
    reader = _table_reader(layout.table)
    step = _step(
        encoder_out, predictor_out, weight, targets, layout, (option_ints, option_floats), (activation, dropout, seed)
    )
    path = tile_path(step, weight, bias, compute_dtype)
    bound = capacity(encoder_out, predictor_out)
    path.begin_forward(max_rows, bound)
    table = reader.read(layout.table) if reader is not None else layout.table.tolist()
    B = layout.batch_size
    if check_inputs:
        _check_fused_values(encoder_out, predictor_out, targets, V, D, table[-NUM_STATS:], options.blank, big)
    num_rows = table[4 * B]
    if num_rows > bound:
        raise ValueError(
            f"logit_lengths, target_lengths: sum_b T_b*(U_b+1) = {num_rows} rows exceeds B * maxT * (maxU+1) = {bound}"
        )
    # static_shapes (set while torch.compile traces): the per-row arrays have room for B * maxT * (maxU+1)
    # rows, a bound known from the shapes, so that the op's outputs have static shapes, and the rows past
    # num_rows hold zeros; in eager mode they have num_rows rows.
    rows = bound if static_shapes else num_rows
    new = encoder_out.new_zeros if static_shapes else encoder_out.new_empty  # the tiles write rows < num_rows
    arrays = kind.new_arrays(lambda *shape: new(*shape, dtype=accumulate_dtype(compute_dtype)), rows, options)
    path.forward(num_rows, max_rows, arrays)
    lattice = kind.lattice(stages, layout, arrays, options)
    if rows > num_rows:
        for x in (lattice.alpha, lattice.beta) + (lattice.rnnt[:2] if lattice.rnnt else ()):
            x[num_rows:] = 0
    return (kind.nll(lattice, options),) + lattice_outputs(lattice), (table[3 * B : 4 * B + 1], path)


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


def _bias_gradient_apart(Wx, J):
    """Whether the weight gradient's GEMM takes the J columns of the hidden alone and db (its column J) a GEMV of its
    own, for tiles against the projection ``Wx``: for fp32 tiles on CUDA without TF32 where J is a multiple of 64,
    as cuBLAS's SIMT fp32 GEMMs run slower at the J + 8 columns that put db into the GEMM (DESIGN.md: The bias
    gradient from the weight gradient's GEMM)."""
    return Wx.is_cuda and Wx.dtype == torch.float32 and J % 64 == 0 and not tf32_matmul()


def tf32_matmul():
    """Whether CUDA's fp32 matmuls may run in TF32: torch.backends.cuda.matmul.fp32_precision from torch 2.9 (it also
    reflects the older settings, whose getters raise once this one is set), else allow_tf32."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    return precision == "tf32" if precision is not None else torch.backends.cuda.matmul.allow_tf32


def _utterances(row_splits, start, end):
    """The utterances [first, last + 1) whose rows meet [start, end) (row_splits: a host list)."""
    return bisect.bisect_right(row_splits, start) - 1, bisect.bisect_left(row_splits, end, lo=1)


def _fused_backward(
    grad_nll: Tensor,
    encoder_out: Tensor,
    predictor_out: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    table: Tensor,
    lp: Tensor,
    den: Tensor,
    lp_arcs: Tensor,
    den_arcs: Tensor,
    alpha: Tensor,
    beta: Tensor,
    nll: Tensor,
    alpha_r: Tensor,
    beta_r: Tensor,
    rnnt_nll: Tensor,
    option_ints: List[int],
    option_floats: List[float],
    activation: str,
    dropout: float,
    seed: Tensor,
    compute_dtype: torch.dtype,
    max_rows: int,
    row_splits: Optional[List[int]],
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_encoder_out, grad_predictor_out, grad_weight, grad_bias) of sum_b grad_nll[b] * loss[b], each in
    its input's dtype; the last is zeros when there is no bias. ``row_splits``: the layout's, on the host (the
    eager path has forward's), or None to read them from ``table``."""
    return _backward(
        grad_nll,
        encoder_out,
        predictor_out,
        weight,
        bias,
        targets,
        table,
        (lp, den, lp_arcs, den_arcs, alpha, beta, nll, alpha_r, beta_r, rnnt_nll),
        (option_ints, option_floats),
        (activation, dropout, seed),
        compute_dtype,
        max_rows,
        row_splits,
    )


def _backward(
    grad_nll,
    encoder_out,
    predictor_out,
    weight,
    bias,
    targets,
    table,
    lattice_tensors,
    option_flat,
    joiner,
    compute_dtype,
    max_rows,
    row_splits,
    forward_path=None,
):
    """_fused_backward's work; ``forward_path``: forward's tile path, whose projections the eager backward
    reuses (TilePath.for_step), or None to make them again."""
    layout = Layout(table, False, targets.size(1) + 1)
    step = _step(encoder_out, predictor_out, weight, targets, layout, option_flat, joiner)
    activation = step.activation
    lattice = lattice_of(layout, lattice_tensors, step.options)
    path = tile_path(step, weight, bias, compute_dtype) if forward_path is None else forward_path.for_step(step)
    Wx = path.Wx  # [W | b | 0] (tiles.projection), launched before the transfer below
    W, J = Wx[:, : encoder_out.size(2)], encoder_out.size(2)
    acc = lattice.lp.dtype
    grad_enc = encoder_out.new_zeros(encoder_out.shape, dtype=acc)
    grad_pred = predictor_out.new_zeros(predictor_out.shape, dtype=acc)
    grad_wx = weight.new_zeros(Wx.shape, dtype=acc)  # [dW | db | ...]
    scale = grad_nll.to(acc)
    if row_splits is None:
        row_splits = layout.row_splits.tolist()  # a transfer, after the launches above
    apart = Wx.size(1) > J and _bias_gradient_apart(Wx, J)
    for start, end, hx, dz in path.gradient_tiles(row_splits[-1], max_rows, lattice, scale):
        width = dz.size(1)
        if apart:
            _add_product(grad_wx[:width, :J], dz.t(), hx[:, :J])
            grad_wx[:width, J].addmv_(dz.t(), hx[:, J])
        else:
            _add_product(grad_wx[:width], dz.t(), hx)
        # dh in the hidden's place: a tile holds two of (hidden, logits, dh) at a time (tiles.default_max_rows)
        dh = torch.mm(dz, W[:width], out=rows_in_place(hx, J))
        del hx, dz
        # dh in the compute dtype: pack_backward_add reads it as it is, with the inputs of their own dtypes
        step.stages.pack_backward_add(
            dh[: end - start],
            layout,
            start,
            _utterances(row_splits, start, end),
            (grad_enc, grad_pred),
            (encoder_out, predictor_out),
            activation,
            step.dropout,
        )
        del dh
    rows = weight.size(0)  # without the padding rows
    grad_w = grad_wx[:rows, :J].to(weight.dtype).contiguous()
    grad_b = grad_wx[:rows, J].clone() if bias is not None else grad_wx.new_zeros(rows)  # outputs may not alias
    return grad_enc.to(encoder_out.dtype), grad_pred.to(predictor_out.dtype), grad_w, grad_b.to(weight.dtype)


def _setup_context(ctx, inputs, output):
    (
        encoder_out,
        predictor_out,
        weight,
        bias,
        targets,
        _,
        _,
        option_ints,
        option_floats,
        activation,
        dropout,
        seed,
        _,
        compute_dtype,
        max_rows,
        _,
    ) = inputs
    nll, *lattice = output
    ctx.mark_non_differentiable(*lattice)
    ctx.save_for_backward(encoder_out, predictor_out, weight, bias, targets, *lattice, seed)
    ctx.option_flat = (option_ints, option_floats)
    ctx.joiner = (activation, dropout, compute_dtype, max_rows)
    # the eager path's backward sizes its tiles with forward's host copy of row_splits (no transfer) and reuses its
    # tile path's projections (the path without forward's step: the inputs stay with the saved tensors and their
    # hooks); a traced backward must not bake one batch's row_splits into its graph
    ctx.row_splits, path = getattr(ctx, "eager_state", None) or (None, None)
    ctx.forward_path = path.for_step(None) if path is not None and any(ctx.needs_input_grad) else None


def _gradient(ctx, grad_nll, backward):
    *tensors, seed = saved_tensors(ctx)
    activation, dropout, compute_dtype, max_rows = ctx.joiner
    path, ctx.forward_path = getattr(ctx, "forward_path", None), None  # forward's, let go once used
    if path is not None:  # eager: backward reuses forward's projections
        grads = _backward(
            grad_nll,
            *tensors[:6],
            tensors[6:],
            ctx.option_flat,
            (activation, dropout, seed),
            compute_dtype,
            max_rows,
            ctx.row_splits,
            path,
        )
    else:
        grads = backward(
            grad_nll, *tensors, *ctx.option_flat, activation, dropout, seed, compute_dtype, max_rows, ctx.row_splits
        )
    grad_enc, grad_pred, grad_w, grad_b = grads
    bias = tensors[3]
    return {
        "encoder_out": grad_enc,
        "predictor_out": grad_pred,
        "weight": grad_w,
        "bias": None if bias is None else grad_b,
    }


fused = Op("fused_joiner_loss", _fused_forward, _fused_backward, _setup_context, _gradient, eager_forward=_forward)
fused_op, fused_backward_op = fused.op, fused.backward_op


@fused_op.register_fake
def _(
    encoder_out,
    predictor_out,
    weight,
    bias,
    targets,
    logit_lengths,
    target_lengths,
    option_ints,
    option_floats,
    activation,
    dropout,
    seed,
    check_inputs,
    compute_dtype,
    max_rows,
    static_shapes,
):
    rows = capacity(encoder_out, predictor_out) if static_shapes else torch.library.get_ctx().new_dynamic_size()
    return fake_outputs(
        encoder_out,
        accumulate_dtype(compute_dtype),
        logit_lengths.size(0),
        rows,
        LossOptions.from_flat(option_ints, option_floats),
    )


@fused_backward_op.register_fake
def _(grad_nll, encoder_out, predictor_out, weight, bias, *rest):
    return (
        torch.empty_like(encoder_out),
        torch.empty_like(predictor_out),
        torch.empty_like(weight),
        weight.new_empty(weight.size(0)),
    )
