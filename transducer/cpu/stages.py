"""The CPU stages of the transducer losses, vectorised with torch (the contract: transducer/backend.py).

Passes over the (N, V) logits go in row chunks of about 4M elements, so the only full-size buffer is the
gradient itself. alpha and beta walk a grid with a -inf border, one anti-diagonal (RNN-T, TDT) or one frame
(RNA) per step, all utterances at once.
"""

import math
from typing import NamedTuple

import torch

from ops import FastDivmod, accumulate_dtype, gather, reduce
from ops.numeric import exp_, logsumexp
from ragged import row_of

from ..joiner import ACTIVATIONS, dropout_mask
from ..lattices import Walks
from ..layout import CELLS_CAP, Layout

_CHUNK_ELEMENTS = 1 << 22
_INT64_MAX = 2**63 - 1


def layout(logit_lengths, target_lengths, max_u1, padded_t=0, labels=None, with_stats=True):
    T, U = logit_lengths.long(), target_lengths.long()
    B = T.numel()
    if padded_t:
        strides = torch.full_like(T, max_u1)
        cells = torch.full_like(T, padded_t * max_u1)
    else:
        strides = U + 1
        cells = T * strides
    row_splits = torch.zeros(B + 1, dtype=torch.int64)
    torch.cumsum(cells, 0, out=row_splits[1:])
    bad, first_bad = 0, _INT64_MAX
    if labels is not None and labels.targets.size(1) > 0:
        targets, vocab_size, blank, big_blanks = labels
        in_label = torch.arange(targets.size(1))[None, :] < U[:, None]
        is_blank = (targets >= blank - big_blanks) & (targets <= blank)
        wrong = (in_label & ((targets < 0) | (targets >= vocab_size) | is_blank)).flatten()
        bad = int(wrong.sum())
        if bad:
            first_bad = int(wrong.nonzero()[0, 0])
    # min and max of no utterances: the identities, as the CUDA kernel's reductions give them
    extremes = [T.min(), T.max(), U.min(), U.max()] if B else [_INT64_MAX, -_INT64_MAX - 1] * 2
    # the cell count saturates at CELLS_CAP as the CUDA kernel's does (products and sums never wrap): the sum in
    # float64 says whether it reaches the cap; below it, the int64 sum is exact
    cells_exact = T.double() * (U.double() + 1)
    cells = CELLS_CAP if float(cells_exact.sum()) >= CELLS_CAP else min(int((T * (U + 1)).sum()), CELLS_CAP)
    stats = torch.tensor([int(x) for x in extremes] + [cells, bad, first_bad])
    return Layout(torch.cat([T, U, strides, row_splits, stats]), padded_t > 0, int(max_u1), max(int(padded_t), 0))


def _coordinates(layout, start=0, end=None):
    """(b, t, u) of the rows [start, end) of the layout (end: all), as int64 tensors:
    row = row_splits[b] + t * row_strides[b] + u."""
    row_splits = layout.row_splits
    rows = torch.arange(start, int(row_splits[-1]) if end is None else end)
    b = row_of(row_splits, rows)  # only this range's rows: the fused loss's tiles call this once each
    local = rows - row_splits[b]
    t, u = FastDivmod(layout.row_strides[b]).divmod(local, check=False)
    return b, t, u


def _cells(layout, start=0, end=None):
    b, t, u = _coordinates(layout, start, end)
    is_cell = (t < layout.logit_lengths[b]) & (u <= layout.target_lengths[b])
    return b, t, u, is_cell


def _labels(targets, b, u, has_label, blank):
    """y_u of every row, and blank where the row has no label (u == U_b or padding)."""
    if targets.size(1) == 0:
        return torch.full_like(b, blank)
    y = targets.long()[b, u.clamp(max=targets.size(1) - 1)]
    return torch.where(has_label, y, blank)


def _picks(layout, targets, blank, start, end):
    """(b, t, u, is_cell, has_label, picks) of the rows [start, end): picks (N, 2) = [blank, y_{u+1}] are the
    columns a row's log-probs read (blank again where the row has no label)."""
    b, t, u, is_cell = _cells(layout, start, end)
    has_label = is_cell & (u < layout.target_lengths[b])
    picks = torch.stack([torch.full_like(b, blank), _labels(targets, b, u, has_label, blank)], dim=1)
    return b, t, u, is_cell, has_label, picks


def _non_finite(rows, den):
    """Rows holding a NaN or an infinite value, given their logsumexp ``den``: NaN or +inf make den
    non-finite, -inf (or NaN) makes the row's min so; cheaper than a pass of isfinite over the rows."""
    return ~(torch.isfinite(den) & torch.isfinite(rows.amin(dim=1)))


def _chunks(num_rows, vocab_size):
    step = max(1, _CHUNK_ELEMENTS // max(vocab_size, 1))
    for start in range(0, num_rows, step):
        yield start, min(start + step, num_rows)


def log_probs(logits2d, targets, layout, options, row_start=0, out=None):
    if row_start and out is None:
        raise ValueError("log_probs: row_start > 0 needs out (the arrays of every row)")
    lp, den, _ = _log_probs(logits2d, targets, layout, options, row_start, 0)
    return _written(out, (lp, den), row_start)


def multiblank_log_probs(logits2d, targets, layout, options, row_start=0, out=None):
    if row_start and out is None:
        raise ValueError("multiblank_log_probs: row_start > 0 needs out (the arrays of every row)")
    return _written(
        out, _log_probs(logits2d, targets, layout, options, row_start, len(options.big_blank_durations)), row_start
    )


def _written(out, parts, row_start):
    """``parts`` (arrays of the rows from row_start), or, given ``out`` (the arrays of every row), written there."""
    if out is None:
        return parts
    for whole, part in zip(out, parts):
        whole[row_start : row_start + part.size(0)] = part
    return out


def _log_probs(logits2d, targets, layout, options, row_start, big_blanks):
    """(lp, den, lp_arcs) of the rows [row_start, row_start + N): lp_arcs (N, big_blanks) the log-probs of the
    columns blank - 1 - i; every log-prob less options.sigma."""
    num_rows, vocab_size = logits2d.shape
    acc = accumulate_dtype(logits2d.dtype)
    blank = options.blank
    b, t, u, is_cell, has_label, picks = _picks(layout, targets, blank, row_start, row_start + num_rows)
    if big_blanks:
        picks = torch.cat([picks, torch.arange(blank - 1, blank - 1 - big_blanks, -1).expand(num_rows, -1)], 1)
    lp = torch.empty(num_rows, picks.size(1), dtype=acc)
    den = torch.zeros(num_rows, dtype=acc)
    for start, end in _chunks(num_rows, vocab_size):
        rows = logits2d[start:end]
        picked = gather(rows, picks[start:end], axis=1, batch_dims=1).to(acc)
        if not options.from_log_softmax:
            den[start:end] = reduce(rows, axis=-1, op="logsumexp")
            # a NaN or infinite logit makes the row's den, so its log-probs and the loss, NaN (as on CUDA)
            den[start:end].masked_fill_(_non_finite(rows, den[start:end]), math.nan)
        lp[start:end] = picked - den[start:end, None]
    if options.sigma:
        lp -= options.sigma
    _delay_penalty(lp, layout, b, t, options)
    lp[:, 1].masked_fill_(~has_label, -math.inf)
    lp_arcs = lp[:, 2:].masked_fill_(~is_cell[:, None], -math.inf)
    return lp[:, :2].contiguous() if big_blanks else lp, den, lp_arcs.contiguous()


def _delay_penalty(lp, layout, b, t, options):
    """k2's delay penalty on the label log-probs lp[:, 1] of rows (b, t): delay_penalty * ((T_b - 1) / 2 - t)."""
    if options.delay_penalty:
        lp[:, 1] += options.delay_penalty * ((layout.logit_lengths[b] - 1).to(lp.dtype) * 0.5 - t)


class _StepGrid(NamedTuple):
    """The cells of every utterance by walk step: cell (b, s, u) is (t, u) with t = s - u (anti-diagonals) or
    t = s (RNA's frames); ``rows`` (B, steps, max_u1) its row of the layout (0 off the grid)."""

    steps: int
    max_u1: int
    is_cell: torch.Tensor
    rows: torch.Tensor


def _step_grid(layout, frames):
    """The _StepGrid of the layout; ``frames``: a step is a frame (RNA), else an anti-diagonal."""
    T, U = layout.logit_lengths[:, None, None], layout.target_lengths[:, None, None]
    max_t, max_u1 = int(T.max()), int(U.max()) + 1
    steps = max_t if frames else max_t + max_u1 - 1
    s = torch.arange(steps)[None, :, None]
    u = torch.arange(max_u1)[None, None, :]
    t = s if frames else s - u
    is_cell = (t >= 0) & (t < T) & (u <= U)
    rows = torch.where(is_cell, layout.cell_offsets[:, None, None] + t * layout.row_strides[:, None, None] + u, 0)
    return _StepGrid(steps, max_u1, is_cell, rows)


def _on_grid(values, grid, pad=0):
    """Per-row values (N,) or (N, K) on the step grid: (B, pad + steps + pad, [K,] max_u1 + 2), cell (b, s, u)
    at [b, pad + s, ..., u + 1], -inf elsewhere. The -inf border (the first and last columns, the padding
    steps) makes every predecessor and successor index of the recursions valid."""
    B, steps, max_u1 = grid.rows.shape
    extra = values.shape[1:]
    out = values.new_full((B, steps + 2 * pad, *extra, max_u1 + 2), -math.inf)
    picked = values[grid.rows]  # (B, steps, max_u1, *extra)
    picked = torch.where(grid.is_cell.view(B, steps, max_u1, *([1] * len(extra))), picked, -math.inf)
    out[:, pad : pad + steps, ..., 1:-1] = picked.movedim(2, -1)
    return out


def _grid_to_rows(values, grid, num_rows, pad=0):
    """The inverse of _on_grid for one array: (N,) with the cells' values, -inf on the other rows."""
    out = values.new_full((num_rows,), -math.inf)
    out[grid.rows[grid.is_cell]] = values[:, pad : pad + grid.steps, 1 : grid.max_u1 + 1][grid.is_cell]
    return out


def _nan_in_cells(row_has_nan, grid):
    """(B,) whether an utterance has a row with a NaN among its cells (padding rows may hold anything)."""
    return (row_has_nan[grid.rows] & grid.is_cell).flatten(1).any(dim=1)


def alpha_beta(lp, layout, options):
    # Both topologies share one recursion over steps s: every arc goes from step s to s+1, a blank
    # keeping u and a label taking u to u+1. RNA steps are frames (s = t); RNN-T steps are the
    # anti-diagonals (s = t + u), whose cells are independent of each other.
    rna = options.one_sym_per_frame
    grid = _step_grid(layout, frames=rna)
    steps, max_u1 = grid.steps, grid.max_u1
    T, U = layout.logit_lengths[:, None, None], layout.target_lengths[:, None, None]
    s = torch.arange(steps)[None, :, None]
    u = torch.arange(max_u1)[None, None, :]
    t = s if rna else s - u
    blank = _on_grid(lp[:, 0], grid)
    emit = _on_grid(lp[:, 1], grid)
    final = _on_grid(lp[:, 0], grid._replace(is_cell=grid.is_cell & (t == T - 1) & (u == U)))  # the closing blank
    inside = torch.zeros(blank.shape, dtype=torch.bool)
    inside[:, :steps, 1:-1] = grid.is_cell

    alpha = torch.full_like(blank, -math.inf)
    beta = blank.new_full((blank.size(0), steps + 1, blank.size(2)), -math.inf)  # beta(steps) = -inf: nothing
    alpha[:, 0, 1] = 0.0
    cells, right, left = slice(1, max_u1 + 1), slice(2, max_u1 + 2), slice(0, max_u1)
    for n in range(1, steps):
        alpha[:, n, cells] = torch.logaddexp(
            alpha[:, n - 1, cells] + blank[:, n - 1, cells], alpha[:, n - 1, left] + emit[:, n - 1, left]
        )
    for n in range(steps - 1, -1, -1):
        value = torch.logaddexp(beta[:, n + 1, cells] + blank[:, n, cells], beta[:, n + 1, right] + emit[:, n, cells])
        value = torch.logaddexp(value, final[:, n, cells])
        beta[:, n, cells] = torch.where(inside[:, n, cells], value, -math.inf)

    # A NaN log-probability anywhere in a grid (a non-finite logit) makes the loss NaN, also off the RNA
    # band, where the recursion above does not always carry it to beta(0, 0) (nor does the CUDA twin's).
    nll = torch.where(_nan_in_cells(torch.isnan(lp[:, 0]), grid), math.nan, -beta[:, 0, 1])
    return Walks(_grid_to_rows(alpha, grid, lp.size(0)), _grid_to_rows(beta, grid, lp.size(0)), nll)


def _posterior(log_posterior):
    """A posterior (of a cell or an arc) from its log, alpha + [arc] + beta - log Z (a new tensor, in place),
    capped at 1: its rounding, |log Z| ulps, can exceed 0 where |log Z| * eps > 1 (fp32 logits of about 1e10),
    and exp of it would be inf and give the gradient inf - inf or 0 * inf; the cap keeps the gradient finite
    (stages.cu and the Hopper epilogue cap it too: arcs.cuh's rnnt_arcs)."""
    return exp_(log_posterior.clamp_(max=0.0))


def _gradient_coefficients(layout, lp, walks, scale, one_sym_per_frame, start, end, cells=None):
    """For the rows [start, end): the cell's posterior and the posteriors of its blank and label arcs (zero
    off the utterances that get a gradient). lp and the walks hold every row of the layout; ``cells``:
    _cells(layout, start, end) when the caller has them."""
    b, t, u, is_cell = _cells(layout, start, end) if cells is None else cells
    T, U, stride = layout.logit_lengths[b], layout.target_lengths[b], layout.row_strides[b]
    alpha, beta, loss = walks
    row = torch.arange(start, end)
    last = lp.size(0) - 1
    lp, alpha = lp[start:end], alpha[start:end]
    # after a blank: (t+1, u), or the end of the alignment from (T-1, U)
    after_blank = torch.where(t + 1 < T, beta[(row + stride).clamp(max=last)], torch.where(u == U, 0.0, -math.inf))
    if one_sym_per_frame:
        has_next = (u < U) & (t + 1 < T)
        after_label = beta[(row + stride + 1).clamp(max=last)]
    else:
        has_next = u < U
        after_label = beta[(row + 1).clamp(max=last)]
    after_label = torch.where(has_next, after_label, -math.inf)

    live = is_cell & (torch.isfinite(loss) & (scale != 0))[b]
    log_norm = torch.where(live, alpha + loss[b], -math.inf)
    occupancy = _posterior(log_norm + beta[start:end])
    blank_arc = _posterior(log_norm + lp[:, 0] + after_blank)
    label_arc = _posterior(log_norm + lp[:, 1] + after_label)
    has_label = is_cell & (u < U)
    return occupancy, blank_arc, label_arc, b, u, has_label, live


def _fold_scale(scale, clamp):
    """Whether the gradients may multiply the incoming scale into their per-row terms (one pass over the chunk
    fewer) instead of into the chunk: not with a clamp (it applies before the scale), nor with an infinite
    scale (inf - inf at the blank and label columns would give NaN where the CUDA twins give -inf)."""
    return clamp <= 0 and bool(torch.isfinite(scale).all())


def gradient(logits2d, targets, lattice, scale, options, out, row_start=0):
    # g = softmax * (occupancy + lambda * label_arc) - [blank] blank_arc - [label] (1 + lambda) label_arc,
    # clamped to [-clamp, clamp] (clamp > 0), times scale[b]: stages.cu's gradient_kernel says why.
    # logits2d and out hold the rows [row_start, row_start + num_rows) of the layout.
    num_rows, vocab_size = logits2d.shape
    lam, clamp, blank = options.fastemit_lambda, options.clamp, options.blank
    walks = Walks(lattice.alpha, lattice.beta, lattice.nll)
    end = row_start + num_rows
    cells = _cells(lattice.layout, row_start, end)
    occupancy, blank_arc, label_arc, b, u, has_label, live = _gradient_coefficients(
        lattice.layout, lattice.lp, walks, scale, options.one_sym_per_frame, row_start, end, cells
    )
    big = options.big_blank_durations
    if big:  # the big blanks' arcs, on their columns blank - 1 - i
        big_arc = _big_blank_occupancies(lattice.layout, lattice, big, live, row_start, end, cells)
        big_columns = torch.arange(blank - 1, blank - 1 - len(big), -1)
    den = lattice.den[row_start : row_start + num_rows]
    labels = _labels(targets, b, u, has_label, blank)
    softmax_factor = occupancy + lam * label_arc if lam else occupancy
    label_arc = label_arc * (1 + lam)
    row_scale = scale[b]
    fold = _fold_scale(scale, clamp)
    if fold:
        softmax_factor, blank_arc, label_arc = (x * row_scale for x in (softmax_factor, blank_arc, label_arc))
        if big:
            big_arc = big_arc * row_scale[:, None]
    dead = ~live
    acc = lattice.lp.dtype
    for start, end in _chunks(num_rows, vocab_size):
        rows = logits2d[start:end]
        index = torch.arange(end - start)
        # formed in the output rows when they have the arithmetic's dtype (out may be the logits themselves):
        # no allocation of the chunk's size, whose fresh pages cost more than the arithmetic
        dst = out[start:end]
        g = dst if dst.dtype == acc else torch.empty(dst.shape, dtype=acc)
        if options.from_log_softmax:
            g.zero_()
        else:
            exp_(torch.sub(rows.to(acc), den[start:end, None], out=g)).mul_(softmax_factor[start:end, None])
        g[index, blank] -= blank_arc[start:end]
        g[index, labels[start:end]] -= label_arc[start:end]
        if big:
            g[:, big_columns] -= big_arc[start:end]
        if not fold:
            if clamp > 0:
                g.clamp_(-clamp, clamp)
            g.mul_(row_scale[start:end, None])
        # padding rows and the rows of dead utterances may hold anything, even inf or NaN
        if dead[start:end].any():
            g.masked_fill_(dead[start:end, None], 0.0)
        if g is not dst:
            dst.copy_(g)
    return out


def gradient_row_width(V, itemsize):
    """V: the CPU stages write rows of any stride alike, and no GEMM after them reads padded rows faster."""
    return V


def pack_forward(
    encoder_out, predictor_out, layout, num_rows, row_start=0, activation="identity", out=None, dropout=None
):
    D = encoder_out.size(2)
    if out is not None and (out.dim() != 2 or out.size(0) < num_rows or out.size(1) < D or not out.is_floating_point()):
        raise ValueError(
            f"pack_forward: out must be a floating-point tensor of at least ({num_rows}, {D}), "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    layout_rows = max(0, min(num_rows, int(layout.row_splits[-1]) - row_start))  # the rows the layout has
    rows = _hidden(encoder_out, predictor_out, layout, layout_rows, row_start, activation, dropout)[1]
    if out is None:
        return rows if layout_rows == num_rows else torch.cat([rows, rows.new_zeros(num_rows - layout_rows, D)])
    out[:layout_rows, :D] = rows
    out[:layout_rows, D:] = 1
    out[layout_rows:] = 0
    return out


def _hidden(encoder_out, predictor_out, layout, num_rows, row_start, activation, dropout):
    """(a, h) of the rows [row_start, row_start + num_rows): a = encoder_out[b, t] + predictor_out[b, u] and h =
    dropout(act(a)), in the inputs' promoted dtype (as ``enc + pred`` computes the sum)."""
    D = encoder_out.size(2)
    dtype = torch.promote_types(encoder_out.dtype, predictor_out.dtype)
    b, t, u = _coordinates(layout, row_start, row_start + num_rows)
    a = encoder_out.reshape(-1, D).index_select(0, b * encoder_out.size(1) + t).to(dtype)
    a += predictor_out.reshape(-1, D).index_select(0, b * predictor_out.size(1) + u)
    h = ACTIVATIONS[activation].forward(a)
    if dropout is not None and dropout.p:
        h = h * dropout_mask(dropout, num_rows, D, row_start, dtype)
    return a, h


def pack_backward(grad_rows, layout, max_t, max_u1):
    B, D = layout.batch_size, grad_rows.size(1)
    grad_enc, grad_pred = grad_rows.new_zeros(B, max_t, D), grad_rows.new_zeros(B, max_u1, D)
    return pack_backward_add(grad_rows, layout, 0, (0, B), (grad_enc, grad_pred))


def pack_backward_add(
    grad_rows, layout, row_start, utterances, grads, inputs=None, activation="identity", dropout=None
):
    # ``utterances``: the CUDA twin launches over them; here every row finds its own
    grad_enc, grad_pred = grads
    B, max_t, D = grad_enc.shape
    num_rows = grad_rows.size(0)
    b, t, u = _coordinates(layout, row_start, row_start + num_rows)
    dropped = dropout is not None and dropout.p
    if activation != "identity" or dropped:
        if inputs is None:
            raise ValueError("pack_backward_add: inputs must be (encoder_out, predictor_out) with an activation")
        a, h = _hidden(*inputs, layout, num_rows, row_start, activation, None)
        slope = ACTIVATIONS[activation].slope(a, h)
        if dropped:
            slope = slope * dropout_mask(dropout, num_rows, D, row_start, slope.dtype)
        grad_rows = slope * grad_rows  # in the inputs' promoted dtype, as autograd computes act's backward
    grad_enc.view(-1, D).index_add_(0, b * max_t + t, grad_rows.to(grad_enc.dtype))
    grad_pred.view(-1, D).index_add_(0, b * grad_pred.size(1) + u, grad_rows.to(grad_pred.dtype))
    return grad_enc, grad_pred


# ---------------------------------------------------------------------------- TDT (the math: backend.py)


def tdt_log_probs(tokens2d, duration_scores, targets, layout, options, row_start=0, out=None):
    if row_start and out is None:
        raise ValueError("tdt_log_probs: row_start > 0 needs out (the arrays of every row)")
    num_rows, V = tokens2d.shape
    acc = accumulate_dtype(tokens2d.dtype)
    b, t, u, is_cell, has_label, picks = _picks(layout, targets, options.blank, row_start, row_start + num_rows)
    lp = torch.empty(num_rows, 2, dtype=acc)
    den = torch.empty(num_rows, dtype=acc)
    lp_arcs = torch.empty(num_rows, duration_scores.size(1), dtype=acc)
    den_arcs = torch.empty(num_rows, dtype=acc)
    for start, end in _chunks(num_rows, V + duration_scores.size(1)):
        tokens, durs = tokens2d[start:end], duration_scores[start:end]
        den[start:end] = reduce(tokens, axis=-1, op="logsumexp")
        den_arcs[start:end] = reduce(durs, axis=-1, op="logsumexp")
        bad = _non_finite(tokens, den[start:end]) | _non_finite(durs, den_arcs[start:end])
        den[start:end].masked_fill_(bad, math.nan)
        den_arcs[start:end].masked_fill_(bad, math.nan)
        picked = gather(tokens, picks[start:end], axis=1, batch_dims=1).to(acc)
        lp[start:end] = picked - den[start:end, None] - options.sigma
        lp_arcs[start:end] = durs.to(acc) - den_arcs[start:end, None]
    _delay_penalty(lp, layout, b, t, options)
    lp[:, 1].masked_fill_(~has_label, -math.inf)
    return _written(out, (lp, den, lp_arcs, den_arcs), row_start)


class _Arcs(NamedTuple):
    """The arcs of a lattice whose arcs may span several frames (TDT, multi-blank), per row of the layout:
    a blank arc of each of ``blank_durations`` (>= 1) goes from (t, u) to (t + d, u), a label arc of each of
    ``label_durations`` (>= 0) to (t + d, u + 1); ``blank`` (N, len(blank_durations)) and ``label`` (N,
    len(label_durations)) hold their log-weights."""

    blank_durations: list
    blank: torch.Tensor
    label_durations: list
    label: torch.Tensor


def _tdt_arcs(lp, lp_arcs, options):
    """TDT: a blank and a label arc per duration, weighing the token log-prob plus the duration's (a blank of
    duration 0 is not an arc)."""
    durations = options.durations
    if lp_arcs.size(1) != len(durations):
        raise ValueError(f"tdt_alpha_beta: {len(durations)} durations for {lp_arcs.size(1)} duration columns")
    blanks = [i for i, d in enumerate(durations) if d >= 1]
    return _Arcs([durations[i] for i in blanks], lp[:, 0:1] + lp_arcs[:, blanks], list(durations), lp[:, 1:2] + lp_arcs)


def _multiblank_arcs(lp, lp_arcs, options):
    """Multi-blank: the blank (duration 1) and the big blanks, the label of duration 0."""
    big = options.big_blank_durations
    if lp_arcs.size(1) != len(big):
        raise ValueError(f"multiblank_alpha_beta: {len(big)} big blanks for {lp_arcs.size(1)} log-prob columns")
    return _Arcs([1, *big], torch.cat([lp[:, 0:1], lp_arcs], 1), [0], lp[:, 1:2])


def tdt_alpha_beta(lp, lp_arcs, layout, options):
    return _duration_walks(_tdt_arcs(lp, lp_arcs, options), lp, lp_arcs, layout)


def multiblank_alpha_beta(lp, lp_arcs, layout, options):
    return _duration_walks(_multiblank_arcs(lp, lp_arcs, options), lp, lp_arcs, layout)


class _GridArcs(NamedTuple):
    """_Arcs on the step grid (_on_grid with ``pad`` = the longest arc, at most steps + 1, plus 1 empty steps on each
    side): ``blank`` (B, steps + 2 pad, Db, max_u1 + 2) and ``label`` (..., Dl, ...) the weights of the arcs leaving
    each cell, ``closing`` (B, steps + 2 pad, max_u1 + 2) the weight of the blank arc that ends the alignment at the
    cell it leaves from, -inf elsewhere."""

    pad: int
    blank_durations: list
    blank: torch.Tensor
    label_durations: list
    label: torch.Tensor
    closing: torch.Tensor


def _on_step_grid(arcs, layout, grid):
    # an arc longer than the grid's steps joins no two cells and closes no alignment (d > T_b): one of steps + 1
    # does the same, and bounds the padding by the grid rather than by the durations
    blank_durations = [min(d, grid.steps + 1) for d in arcs.blank_durations]
    label_durations = [min(d, grid.steps + 1) for d in arcs.label_durations]
    pad = max(blank_durations + label_durations) + 1
    blank = _on_grid(arcs.blank, grid, pad)
    label = _on_grid(arcs.label, grid, pad)
    # the closing blanks: from (T_b - d, U_b) with duration d, at step T_b - d + U_b; the blank durations that close
    # an alignment (d <= T_b) are distinct, so a cell has at most one
    closing = arcs.blank.new_full(blank.shape[:2] + blank.shape[3:], -math.inf)
    T, U = layout.logit_lengths, layout.target_lengths
    for j, d in enumerate(blank_durations):
        t_close = T - d
        ok = t_close >= 0
        if ok.any():
            bs = ok.nonzero().squeeze(1)
            r = layout.cell_offsets[bs] + t_close[bs] * layout.row_strides[bs] + U[bs]
            closing[bs, pad + t_close[bs] + U[bs], U[bs] + 1] = arcs.blank[r, j]
    return _GridArcs(pad, blank_durations, blank, label_durations, label, closing)


def _duration_walks(arcs, lp, lp_arcs, layout):
    """The Walks of a lattice of _Arcs; NaN where a cell of the utterance has a NaN in lp or lp_arcs."""
    num_rows, B = lp.size(0), layout.batch_size
    grid = _step_grid(layout, frames=False) if B and num_rows else None
    if grid is None or grid.steps == 0:
        empty = torch.full((num_rows,), -math.inf, dtype=lp.dtype)
        return Walks(empty, empty.clone(), lp.new_full((B,), math.inf))
    on_grid = _on_step_grid(arcs, layout, grid)
    alpha, beta = _walk_both(on_grid, grid)
    nll = -beta[:, on_grid.pad, 1]
    row_has_nan = torch.isnan(lp).any(dim=1) | torch.isnan(lp_arcs).any(dim=1)
    if row_has_nan.any():  # rare: which utterances have a NaN in a cell
        nll = torch.where(_nan_in_cells(row_has_nan, grid), math.nan, nll)
    pad = on_grid.pad
    return Walks(_grid_to_rows(alpha, grid, num_rows, pad), _grid_to_rows(beta, grid, num_rows, pad), nll)


def _walk_both(arcs, grid):
    """alpha and beta on the step grid (B, steps + 2 pad, max_u1 + 2), both in one loop over the steps: loop
    step k computes alpha at grid step pad + k and beta at pad + steps - 1 - k, each cell a logsumexp of its
    terms. alpha's terms: every blank and label arc from its source, and the start (alpha(0, 0) = 0); beta's:
    the same arcs to their targets, and the closing blank. One gather, one add and one logsumexp a step for
    both walks (the loop's cost is torch's overhead per op). No mask per step: every weight of a cell off
    the grid is -inf, so it passes nothing on (alpha) and receives nothing (beta); only cells are read out."""
    B, span, width = arcs.closing.shape
    pad, steps, max_u1 = arcs.pad, grid.steps, grid.max_u1
    terms = len(arcs.blank_durations) + len(arcs.label_durations) + 1
    # alpha and beta flattened, one extra entry holding the constant 0 (the start's source)
    size = span * width + 1
    walks = torch.full((2, B, size), -math.inf, dtype=arcs.blank.dtype)
    walks[:, :, -1] = 0.0
    index = _term_index(arcs, steps, width, max_u1, size - 1)
    weights = _term_weights(arcs, steps, max_u1)
    for k in range(steps):
        values = torch.gather(walks, 2, index[k].expand(2, B, terms * max_u1)).view(2, B, terms, max_u1)
        values.add_(weights[k])
        # alpha's cells at grid step pad + k and beta's at pad + steps - 1 - k, as one (2, B, max_u1) view
        out = walks.as_strided((2, B, max_u1), (B * size + (steps - 1 - 2 * k) * width, size, 1), (pad + k) * width + 1)
        logsumexp(values, 2, out=out)
    alpha, beta = (w[:, :-1].view(B, span, width) for w in walks)
    return alpha, beta


def _term_index(arcs, steps, width, max_u1, start):
    """(steps, 2, 1, terms * max_u1): where loop step k's terms read alpha (the arcs' sources) and beta (their
    targets) in the flattened walks; the last term reads ``start``, the constant 0. An arc of duration d moves
    d anti-diagonals (blank) or d + 1 (label, one column to the right)."""
    column = torch.arange(1, max_u1 + 1)
    k = torch.arange(steps)[:, None, None]
    alpha_step, beta_step = arcs.pad + k, arcs.pad + steps - 1 - k
    d_blank = torch.tensor(arcs.blank_durations)[None, :, None]
    d_label = torch.tensor(arcs.label_durations)[None, :, None]
    constant = torch.full((steps, 1, max_u1), start)
    index = torch.stack(
        [
            torch.cat(
                [(alpha_step - d_blank) * width + column, (alpha_step - d_label - 1) * width + column - 1, constant],
                dim=1,
            ),
            torch.cat(
                [(beta_step + d_blank) * width + column, (beta_step + d_label + 1) * width + column + 1, constant],
                dim=1,
            ),
        ],
        dim=1,
    )
    return index.view(steps, 2, 1, -1)


def _term_weights(arcs, steps, max_u1):
    """(steps, 2, B, terms, max_u1): the weights loop step k adds to its terms, in _term_index's order,
    step-major so that a step's weights are contiguous."""
    B, pad = arcs.blank.size(0), arcs.pad
    num_blank = len(arcs.blank_durations)
    terms = num_blank + len(arcs.label_durations) + 1
    cells, left = slice(1, max_u1 + 1), slice(0, max_u1)
    w = arcs.blank.new_empty(steps, 2, B, terms, max_u1)
    # alpha: the arc from its source step, d (blank) or d + 1 (label) steps back
    for j, d in enumerate(arcs.blank_durations):
        w[:, 0, :, j] = arcs.blank[:, pad - d : pad + steps - d, j, cells].transpose(0, 1)
    for j, d in enumerate(arcs.label_durations):
        w[:, 0, :, num_blank + j] = arcs.label[:, pad - d - 1 : pad + steps - d - 1, j, left].transpose(0, 1)
    w[:, 0, :, -1] = -math.inf
    w[0, 0, :, -1, 0] = 0.0  # alpha(0, 0) = 0: the constant, at step 0 only
    # beta: the cell's own arcs, steps downwards
    w[:, 1, :, :num_blank] = arcs.blank[:, pad : pad + steps, :, cells].flip(1).transpose(0, 1)
    w[:, 1, :, num_blank:-1] = arcs.label[:, pad : pad + steps, :, cells].flip(1).transpose(0, 1)
    w[:, 1, :, -1] = arcs.closing[:, pad : pad + steps, cells].flip(1).transpose(0, 1)
    return w


def _after_arcs(layout, beta, cells, start, d):
    """For the rows [start, start + n) (``cells`` = _cells(layout, ...)) and arcs of durations d (k,): log beta
    where a blank arc of each duration lands, (t + d, u), 0 where it ends the alignment (t + d == T_b with
    u == U_b), -inf where it leaves the grid; and where a label arc lands, (t + d, u + 1), or -inf. (n, k)
    each."""
    b, t, u, _ = cells
    T, U, stride = layout.logit_lengths[b], layout.target_lengths[b], layout.row_strides[b]
    last = beta.size(0) - 1
    row = torch.arange(start, start + b.numel())
    land = t[:, None] + d  # the frame an arc of each duration reaches
    inside = land < T[:, None]
    dst = (row[:, None] + d * stride[:, None]).clamp(max=last)
    ends = (land == T[:, None]) & (u == U)[:, None]
    after_blank = torch.where(inside, beta[dst], torch.where(ends, 0.0, -math.inf))
    after_label = torch.where(inside & (u < U)[:, None], beta[(dst + 1).clamp(max=last)], -math.inf)
    return after_blank, after_label


def _tdt_arc_occupancies(layout, lattice, live, d, start, end, cells):
    """For the rows [start, end) (``cells`` = _cells(layout, start, end)): the cell posterior gamma (n,) and
    the posteriors of its blank and label arcs per duration (n, D), zero off ``live`` rows."""
    b = cells[0]
    log_norm = torch.where(live, lattice.alpha[start:end] + lattice.nll[b], -math.inf)
    gamma = _posterior(log_norm + lattice.beta[start:end])
    after_blank, after_label = _after_arcs(layout, lattice.beta, cells, start, d)
    after_blank = torch.where(d >= 1, after_blank, -math.inf)  # a blank of duration 0 is not an arc
    base = log_norm[:, None] + lattice.lp_arcs[start:end]
    blank_arc = _posterior(base + lattice.lp[start:end, 0:1] + after_blank)
    label_arc = _posterior(base + lattice.lp[start:end, 1:2] + after_label)
    return gamma, blank_arc, label_arc


def _big_blank_occupancies(layout, lattice, big_blank_durations, live, start, end, cells):
    """The posteriors (n, K) of the big blanks' arcs leaving the rows [start, end), zero off ``live`` rows."""
    log_norm = torch.where(live, lattice.alpha[start:end] + lattice.nll[cells[0]], -math.inf)
    after, _ = _after_arcs(layout, lattice.beta, cells, start, torch.tensor(big_blank_durations))
    return _posterior(log_norm[:, None] + lattice.lp_arcs[start:end] + after)


def tdt_gradient(tokens2d, duration_scores, targets, lattice, scale, options, out, row_start=0):
    out_tokens, out_duration_scores = out
    num_rows, V = tokens2d.shape
    durations, omega, lam, clamp, blank = (
        options.durations,
        options.omega,
        float(options.fastemit_lambda),
        options.clamp,
        options.blank,
    )
    if duration_scores.size(1) != len(durations):
        raise ValueError(f"tdt_gradient: {len(durations)} durations for {duration_scores.size(1)} duration columns")
    if omega and lattice.rnnt is None:
        raise ValueError("tdt_gradient: omega > 0 needs the RNN-T walks (lattice.rnnt)")
    layout = lattice.layout
    d = torch.tensor(durations)
    ok = torch.isfinite(lattice.nll) & (scale != 0)
    if omega:
        ok &= torch.isfinite(lattice.rnnt.nll)
        lp_rnnt = lattice.lp + options.sigma  # the RNN-T log-probs: token log_softmax, no sigma
    fold = _fold_scale(scale, clamp)
    for local, local_end in _chunks(num_rows, V + len(durations)):
        start, end = row_start + local, row_start + local_end  # rows of the layout
        cells = _cells(layout, start, end)
        b, t, u, is_cell = cells
        live = is_cell & ok[b]
        gamma, blank_arc, label_arc = _tdt_arc_occupancies(layout, lattice, live, d, start, end, cells)
        has_label = is_cell & (u < layout.target_lengths[b])
        labels = _labels(targets, b, u, has_label, blank)
        index = torch.arange(end - start)
        blank_total, label_total = blank_arc.sum(dim=1), label_arc.sum(dim=1)
        factor = (1 - omega) * (gamma + lam * label_total)  # of the softmax, per row
        sub_blank = (1 - omega) * blank_total
        sub_label = (1 - omega) * (1 + lam) * label_total
        if omega:
            gamma_r, blank_r, label_r, *_ = _gradient_coefficients(
                layout, lp_rnnt, lattice.rnnt, scale, False, start, end, cells
            )
            factor += omega * (gamma_r + lam * label_r)
            sub_blank += omega * blank_r
            sub_label += omega * (1 + lam) * label_r
        row_scale = scale[b]
        if fold:
            factor, sub_blank, sub_label = (x * row_scale for x in (factor, sub_blank, sub_label))
        # the token gradient is formed in its output rows when they have the arithmetic's dtype (no
        # allocation of the chunk's size: fresh pages cost more than the arithmetic here)
        acc = lattice.lp.dtype
        dst = out_tokens[local:local_end]
        g_tok = dst if dst.dtype == acc else torch.empty(dst.shape, dtype=acc)
        exp_(torch.sub(tokens2d[local:local_end].to(acc), lattice.den[start:end, None], out=g_tok))
        g_tok.mul_(factor[:, None])
        g_tok[index, blank] -= sub_blank
        g_tok[index, labels] -= sub_label
        q = exp_(duration_scores[local:local_end].to(acc) - lattice.den_arcs[start:end, None])
        g_dur = q.mul_(gamma[:, None]).sub_(blank_arc).sub_(label_arc).mul_(1 - omega)
        if not fold:
            if clamp > 0:
                g_tok.clamp_(-clamp, clamp)
            g_tok.mul_(row_scale[:, None])
        g_dur.mul_(row_scale[:, None])  # not clamped: clamp bounds the token scores' gradient (NeMo's)
        dead = ~live
        if dead.any():  # padding rows and dead utterances' rows may hold anything, even NaN
            for g in (g_tok, g_dur):
                g.masked_fill_(dead[:, None], 0.0)
        if g_tok is not dst:
            dst.copy_(g_tok)
        out_duration_scores[local:local_end] = g_dur
