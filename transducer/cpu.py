"""The CPU stages of the transducer loss, vectorised with torch (contract: layout.py).

Passes over the (N, V) logits go in row chunks of about 4M elements, so the only
full-size buffer is the gradient itself. alpha and beta walk a grid with a -inf
border, one anti-diagonal (RNN-T) or one frame (RNA) per step, all utterances
at once.
"""

import math

import torch

from ops import FastDivmod, accumulate_dtype, gather, reduce
from ops.numeric import exp_, logsumexp
from ragged import row_of

from .checks import check_durations
from .layout import CELLS_CAP, Layout

_CHUNK_ELEMENTS = 1 << 22


_INT64_MAX = 2**63 - 1


def layout(logit_lengths, target_lengths, max_u1, padded_t=0, targets=None, vocab_size=0, blank=0,
           with_stats=True):
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
    bad = 0
    if targets is not None and targets.size(1) > 0:
        in_label = torch.arange(targets.size(1))[None, :] < U[:, None]
        bad = int((in_label & ((targets < 0) | (targets >= vocab_size) | (targets == blank))).sum())
    # min and max of no utterances: the identities, as the CUDA kernel's reductions give them
    extremes = [T.min(), T.max(), U.min(), U.max()] if B else [_INT64_MAX, -_INT64_MAX - 1] * 2
    # the cell count saturates at CELLS_CAP as the CUDA kernel's does (products and sums never wrap)
    cells_exact = T.double() * (U.double() + 1)
    cells = CELLS_CAP if bool((cells_exact >= CELLS_CAP).any()) else min(int((T * (U + 1)).sum()), CELLS_CAP)
    stats = torch.tensor([int(x) for x in extremes] + [cells, bad])
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


def log_probs(logits2d, targets, layout, blank, from_log_softmax, delay_penalty=0.0, row_start=0, out=None):
    # logits2d holds the rows [row_start, row_start + num_rows) of the layout; given out = (lp, den) for every
    # row of the layout, those rows of it are written (the fused joiner loss's tiles); row_start > 0 needs out
    if row_start and out is None:
        raise ValueError("log_probs: row_start > 0 needs out (the arrays of every row)")
    num_rows, vocab_size = logits2d.shape
    acc = accumulate_dtype(logits2d.dtype)
    b, t, u, is_cell, has_label, picks = _picks(layout, targets, blank, row_start, row_start + num_rows)
    lp = torch.empty(num_rows, 2, dtype=acc)
    den = torch.zeros(num_rows, dtype=acc)
    for start, end in _chunks(num_rows, vocab_size):
        rows = logits2d[start:end]
        picked = gather(rows, picks[start:end], axis=1, batch_dims=1).to(acc)
        if not from_log_softmax:
            den[start:end] = reduce(rows, axis=-1, op="logsumexp")
            # a NaN or infinite logit makes the row's den, so its log-probs and the loss, NaN (as on CUDA)
            den[start:end].masked_fill_(_non_finite(rows, den[start:end]), math.nan)
        lp[start:end] = picked - den[start:end, None]
    if delay_penalty:  # k2's delay penalty on the label log-probs: delay_penalty * ((T_b - 1) / 2 - t)
        lp[:, 1] += delay_penalty * ((layout.logit_lengths[b] - 1).to(acc) * 0.5 - t)
    lp[:, 1].masked_fill_(~has_label, -math.inf)
    if out is None:
        return lp, den
    out[0][row_start:row_start + num_rows] = lp
    out[1][row_start:row_start + num_rows] = den
    return out


def _grid(values, is_cell, rows):
    """values (N,) -> (B, steps+1, maxU+3): cell (b, s, u) at [b, s, u+1], -inf elsewhere.

    The -inf border (first and last column, last row) makes every predecessor and
    successor index of the recursions valid."""
    B, steps, max_u1 = rows.shape
    grid = values.new_full((B, steps + 1, max_u1 + 2), -math.inf)
    grid[:, :steps, 1:-1] = torch.where(is_cell, values[rows], -math.inf)
    return grid


def alpha_beta(lp, layout, one_sym_per_frame):
    # Both topologies share one recursion over steps s: every arc goes from step s to s+1, a blank
    # keeping u and a label taking u to u+1. RNA steps are frames (s = t); RNN-T steps are the
    # anti-diagonals (s = t + u), whose cells are independent of each other.
    T, U = layout.logit_lengths[:, None, None], layout.target_lengths[:, None, None]
    max_t, max_u1 = int(T.max()), int(U.max()) + 1
    steps = max_t if one_sym_per_frame else max_t + max_u1 - 1
    s = torch.arange(steps)[None, :, None]
    u = torch.arange(max_u1)[None, None, :]
    t = s if one_sym_per_frame else s - u
    is_cell = (t >= 0) & (t < T) & (u <= U)
    rows = torch.where(is_cell, layout.cell_offsets[:, None, None] + t * layout.row_strides[:, None, None] + u, 0)
    blank = _grid(lp[:, 0], is_cell, rows)
    emit = _grid(lp[:, 1], is_cell, rows)
    final = _grid(lp[:, 0], is_cell & (t == T - 1) & (u == U), rows)  # the closing blank at (T-1, U)
    inside = torch.zeros(blank.shape, dtype=torch.bool)
    inside[:, :steps, 1:-1] = is_cell

    alpha = torch.full_like(blank, -math.inf)
    beta = torch.full_like(blank, -math.inf)
    alpha[:, 0, 1] = 0.0
    cells, right, left = slice(1, max_u1 + 1), slice(2, max_u1 + 2), slice(0, max_u1)
    for n in range(1, steps):
        alpha[:, n, cells] = torch.logaddexp(alpha[:, n - 1, cells] + blank[:, n - 1, cells],
                                             alpha[:, n - 1, left] + emit[:, n - 1, left])
    for n in range(steps - 1, -1, -1):
        value = torch.logaddexp(beta[:, n + 1, cells] + blank[:, n, cells], beta[:, n + 1, right] + emit[:, n, cells])
        value = torch.logaddexp(value, final[:, n, cells])
        beta[:, n, cells] = torch.where(inside[:, n, cells], value, -math.inf)

    # A NaN log-probability anywhere in a grid (a non-finite logit) makes the loss NaN, also off the RNA
    # band, where the recursion above does not always carry it to beta(0, 0) (nor does the CUDA twin's).
    nan_seen = (torch.isnan(lp[:, 0][rows]) & is_cell).flatten(1).any(dim=1)
    loss = torch.where(nan_seen, math.nan, -beta[:, 0, 1])

    alpha_rows = torch.full_like(lp[:, 0], -math.inf)
    beta_rows = torch.full_like(lp[:, 0], -math.inf)
    alpha_rows[rows[is_cell]] = alpha[:, :steps, cells][is_cell]
    beta_rows[rows[is_cell]] = beta[:, :steps, cells][is_cell]
    return alpha_rows, beta_rows, loss


def _gradient_coefficients(layout, lp, alpha, beta, loss, scale, one_sym_per_frame, start, end, cells=None):
    """For the rows [start, end): the cell's posterior and the posteriors of its blank and label arcs (zero
    off the utterances that get a gradient). lp, alpha and beta hold every row of the layout; ``cells``:
    _cells(layout, start, end) when the caller has them."""
    b, t, u, is_cell = _cells(layout, start, end) if cells is None else cells
    T, U, stride = layout.logit_lengths[b], layout.target_lengths[b], layout.row_strides[b]
    row = torch.arange(start, end)
    last = lp.size(0) - 1
    lp, alpha, beta = lp[start:end], alpha[start:end], beta
    # after a blank: (t+1, u), or the end of the alignment from (T-1, U)
    after_blank = torch.where(t + 1 < T, beta[(row + stride).clamp(max=last)],
                              torch.where(u == U, 0.0, -math.inf))
    if one_sym_per_frame:
        has_next = (u < U) & (t + 1 < T)
        after_label = beta[(row + stride + 1).clamp(max=last)]
    else:
        has_next = u < U
        after_label = beta[(row + 1).clamp(max=last)]
    after_label = torch.where(has_next, after_label, -math.inf)

    live = is_cell & (torch.isfinite(loss) & (scale != 0))[b]
    log_norm = torch.where(live, alpha + loss[b], -math.inf)
    occupancy = exp_(log_norm + beta[start:end])
    blank_arc = exp_(log_norm + lp[:, 0] + after_blank)
    label_arc = exp_(log_norm + lp[:, 1] + after_label)
    has_label = is_cell & (u < U)
    return occupancy, blank_arc, label_arc, b, u, has_label, live


def _fold_scale(scale, clamp):
    """Whether the gradients may multiply the incoming scale into their per-row terms (one pass over the chunk
    fewer) instead of into the chunk: not with a clamp (it applies before the scale), nor with an infinite
    scale (inf - inf at the blank and label columns would give NaN where the CUDA twins give -inf)."""
    return clamp <= 0 and bool(torch.isfinite(scale).all())


def gradient(logits2d, targets, layout, lp, den, alpha, beta, loss, scale, blank,
             from_log_softmax, one_sym_per_frame, out, fastemit_lambda=0.0, clamp=0.0, row_start=0):
    # g = softmax * (occupancy + lambda * label_arc) - [blank] blank_arc - [label] (1 + lambda) label_arc,
    # clamped to [-clamp, clamp] (clamp > 0), times scale[b]: stages.cu's gradient_kernel says why.
    # logits2d and out hold the rows [row_start, row_start + num_rows) of the layout.
    num_rows, vocab_size = logits2d.shape
    occupancy, blank_arc, label_arc, b, u, has_label, live = _gradient_coefficients(
        layout, lp, alpha, beta, loss, scale, one_sym_per_frame, row_start, row_start + num_rows)
    den = den[row_start:row_start + num_rows]
    labels = _labels(targets, b, u, has_label, blank)
    softmax_factor = occupancy + fastemit_lambda * label_arc if fastemit_lambda else occupancy
    label_arc = label_arc * (1 + fastemit_lambda)
    row_scale = scale[b]
    fold = _fold_scale(scale, clamp)
    if fold:
        softmax_factor, blank_arc, label_arc = (x * row_scale for x in (softmax_factor, blank_arc, label_arc))
    dead = ~live
    for start, end in _chunks(num_rows, vocab_size):
        rows = logits2d[start:end]
        index = torch.arange(end - start)
        # formed in the output rows when they have the arithmetic's dtype (out may be the logits themselves):
        # no allocation of the chunk's size, whose fresh pages cost more than the arithmetic
        dst = out[start:end]
        g = dst if dst.dtype == lp.dtype else torch.empty(dst.shape, dtype=lp.dtype)
        if from_log_softmax:
            g.zero_()
        else:
            exp_(torch.sub(rows.to(lp.dtype), den[start:end, None], out=g)).mul_(softmax_factor[start:end, None])
        g[index, blank] -= blank_arc[start:end]
        g[index, labels[start:end]] -= label_arc[start:end]
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


def pack_forward(encoder_out, predictor_out, layout, num_rows, row_start=0, activation="identity", out=None):
    D = encoder_out.size(2)
    b, t, u = _coordinates(layout, row_start, row_start + num_rows)
    rows = encoder_out.reshape(-1, D).index_select(0, b * encoder_out.size(1) + t)
    rows += predictor_out.reshape(-1, D).index_select(0, b * predictor_out.size(1) + u)
    rows = rows.tanh_() if activation == "tanh" else rows.relu_() if activation == "relu" else rows
    if out is None:
        return rows
    if out.shape != rows.shape or out.dtype != rows.dtype:
        raise ValueError(f"pack_forward: out must be a {tuple(rows.shape)} {rows.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    return out.copy_(rows)


def pack_backward(grad_out, layout, max_t, max_u1):
    B, D = layout.batch_size, grad_out.size(1)
    grad_enc, grad_pred = grad_out.new_zeros(B, max_t, D), grad_out.new_zeros(B, max_u1, D)
    return pack_backward_add(grad_out, layout, 0, (0, B), grad_enc, grad_pred)


def pack_backward_add(grad_rows, layout, row_start, utterances, grad_enc, grad_pred, inputs=None,
                      activation="identity"):
    """Adds the rows [row_start, row_start + n) of the joiner input's gradient, grad_rows (n, J), times the
    activation's derivative at h = act(enc[b, t] + pred[b, u]) (recomputed from ``inputs`` = (encoder_out,
    predictor_out) as pack_forward computes it), into grad_enc (B, maxT, J) and grad_pred (B, maxU+1, J):
    the fused loss's tiles. ``utterances`` = (first, last + 1), the utterances the rows meet (the CUDA twin
    launches over them)."""
    B, max_t, D = grad_enc.shape
    b, t, u = _coordinates(layout, row_start, row_start + grad_rows.size(0))
    if activation != "identity":
        if inputs is None:
            raise ValueError("pack_backward_add: inputs must be (encoder_out, predictor_out) with an activation")
        hidden = pack_forward(*inputs, layout, grad_rows.size(0), row_start, activation)  # a fresh tensor
        slope = hidden.mul_(hidden).neg_().add_(1) if activation == "tanh" else hidden.gt_(0)  # in place
        grad_rows = slope.mul_(grad_rows)
    grad_enc.view(-1, D).index_add_(0, b * max_t + t, grad_rows.to(grad_enc.dtype))
    grad_pred.view(-1, D).index_add_(0, b * grad_pred.size(1) + u, grad_rows.to(grad_pred.dtype))
    return grad_enc, grad_pred


# ---------------------------------------------------------------------------- TDT
# The CPU stages of the Token-and-Duration Transducer (TDT) loss (Xu et al. 2023, NeMo's semantics),
# vectorised with torch like the RNN-T stages above.
#
# Row r of ``tokens2d`` (N, V) holds the V token scores of row r of the layout (blank among them), row r of
# ``durations2d`` (N, D) its D duration scores (two views of NeMo's (N, V + D) joint, or two heads);
# ``durations`` is a host list of D distinct ints >= 0, at least one >= 1:
#
#     tok(t,u,v) = z(t,u,v) - logsumexp_{v'<V} z(t,u,v') - sigma
#     dur(t,u,i) = z(t,u,V+i) - logsumexp_{j<D} z(t,u,V+j)
#
# From cell (t, u) a label y_{u+1} with duration d_i goes to (t + d_i, u + 1) if t + d_i < T_b (d_i may be 0);
# a blank with duration d_i >= 1 goes to (t + d_i, u) if t + d_i < T_b, or ends the alignment if u == U_b and
# t + d_i == T_b. Every arc goes from anti-diagonal s = t + u to s + d_i (blank) or s + d_i + 1 (label), so
# alpha and beta walk the anti-diagonals as for the RNN-T loss, reading up to max(d) + 1 of them back (ahead).
#
# Stages (the CUDA twins have the same names, arguments and results):
#
# ``tdt_log_probs(tokens2d, durations2d, targets, layout, blank, sigma) -> (lp, lp_dur, den)``
# ``tdt_alpha_beta(lp, lp_dur, layout, durations) -> (alpha, beta, loss)``
# ``tdt_gradient(tokens2d, durations2d, targets, layout, lp, lp_dur, den, alpha, beta, loss, scale, blank,
#                durations, out_tokens, out_durations, fastemit_lambda=0.0, omega=0.0, rnnt=None, sigma=0.0,
#                clamp=0.0)``
#
# (see each function). ``durations`` stay on the host: the stages only use them as loop bounds and index
# offsets, so a CUDA kernel can take them by value (a small fixed-size array in a struct argument); no tensor
# of them is needed.


def tdt_log_probs(tokens2d, durations2d, targets, layout, blank, sigma, row_start=0, out=None):
    """lp (N, 2) = [tok(blank), tok(y_{u+1})] (-inf for the label at u == U_b and on padding rows), lp_dur
    (N, D) = dur(., i), den (N, 2) = [logsumexp of the V token columns, logsumexp of the D duration columns];
    float32, or float64 for float64 logits. A NaN or infinite logit anywhere in a row (token or duration
    column) makes both den entries of the row, so its lp and lp_dur, NaN. Padding rows may hold anything.
    The scores are the rows [row_start, row_start + N) of the layout; given ``out`` = (lp, lp_dur, den) for
    every row of the layout, those rows of it are written (the fused joiner loss's tiles); row_start > 0
    needs out."""
    if row_start and out is None:
        raise ValueError("tdt_log_probs: row_start > 0 needs out (the arrays of every row)")
    num_rows, V = tokens2d.shape
    acc = accumulate_dtype(tokens2d.dtype)
    b, t, u, is_cell, has_label, picks = _picks(layout, targets, blank, row_start, row_start + num_rows)
    lp = torch.empty(num_rows, 2, dtype=acc)
    lp_dur = torch.empty(num_rows, durations2d.size(1), dtype=acc)
    den = torch.empty(num_rows, 2, dtype=acc)
    for start, end in _chunks(num_rows, V + durations2d.size(1)):
        tokens, durs = tokens2d[start:end], durations2d[start:end]
        den[start:end, 0] = reduce(tokens, axis=-1, op="logsumexp")
        den[start:end, 1] = reduce(durs, axis=-1, op="logsumexp")
        bad = _non_finite(tokens, den[start:end, 0]) | _non_finite(durs, den[start:end, 1])
        den[start:end].masked_fill_(bad[:, None], math.nan)
        picked = gather(tokens, picks[start:end], axis=1, batch_dims=1).to(acc)
        lp[start:end] = picked - den[start:end, 0:1] - sigma
        lp_dur[start:end] = durs.to(acc) - den[start:end, 1:2]
    lp[:, 1].masked_fill_(~has_label, -math.inf)
    if out is None:
        return lp, lp_dur, den
    for whole, part in zip(out, (lp, lp_dur, den)):
        whole[row_start:row_start + num_rows] = part
    return out


def _step_grid(values, is_cell, rows, pad):
    """values (N, ...) -> (B, pad + steps + pad, ..., max_u1 + 2): cell (b, s, u) at [b, pad + s, ..., u + 1],
    -inf elsewhere (the border makes every predecessor and successor index valid)."""
    B, steps, max_u1 = rows.shape
    extra = values.shape[1:]
    grid = values.new_full((B, steps + 2 * pad, *extra, max_u1 + 2), -math.inf)
    picked = values[rows]  # (B, steps, max_u1, *extra)
    mask = is_cell.view(B, steps, max_u1, *([1] * len(extra)))
    picked = torch.where(mask, picked, -math.inf)
    grid[:, pad:pad + steps, ..., 1:-1] = picked.movedim(2, -1)
    return grid


def tdt_alpha_beta(lp, lp_dur, layout, durations):
    """alpha, beta (N,) in lp's dtype, -inf at unreachable cells and on padding rows; loss (B,) = -beta(b, 0, 0),
    +inf where no alignment exists, NaN where any lp or lp_dur entry of a cell of the utterance is NaN (a
    non-finite logit: the scan does not rely on the recursion carrying the NaN to beta(0, 0))."""
    ds = check_durations(durations, lp_dur.size(1))
    num_rows = lp.size(0)
    B = layout.batch_size
    alpha_rows = torch.full((num_rows,), -math.inf, dtype=lp.dtype)
    beta_rows = torch.full((num_rows,), -math.inf, dtype=lp.dtype)
    if B == 0:
        return alpha_rows, beta_rows, lp.new_empty(0)
    T, U = layout.logit_lengths[:, None, None], layout.target_lengths[:, None, None]
    max_t, max_u1 = int(T.max()), int(U.max()) + 1
    steps = max(max_t + max_u1 - 1, 0)
    if num_rows == 0 or steps == 0 or max_t <= 0:
        return alpha_rows, beta_rows, lp.new_full((B,), math.inf)

    s = torch.arange(steps)[None, :, None]
    u = torch.arange(max_u1)[None, None, :]
    t = s - u
    is_cell = (t >= 0) & (t < T) & (u <= U)
    rows = torch.where(is_cell, layout.cell_offsets[:, None, None] + t * layout.row_strides[:, None, None] + u, 0)

    D = len(ds)
    d = torch.tensor(ds)
    pad = max(ds) + 1
    # arc weights per duration, (B, pad + steps + pad, D, max_u1 + 2): tok + dur, -inf off the grid; a blank of
    # duration 0 is not an arc (the walks below leave its weights out)
    blank_w = _step_grid(lp[:, 0:1] + lp_dur, is_cell, rows, pad)
    label_w = _step_grid(lp[:, 1:2] + lp_dur, is_cell, rows, pad)
    # the closing blanks: from (T_b - d_i, U_b) with duration d_i >= 1, one cell per duration (distinct), at
    # step T_b - d_i + U_b; -inf elsewhere
    S, W = blank_w.size(1), max_u1 + 2
    final = lp.new_full((B, S, W), -math.inf)
    T_b, U_b = layout.logit_lengths, layout.target_lengths
    for i, di in enumerate(ds):
        t_close = T_b - di
        ok = (di >= 1) & (t_close >= 0)
        if ok.any():
            bs = ok.nonzero().squeeze(1)
            r = layout.cell_offsets[bs] + t_close[bs] * layout.row_strides[bs] + U_b[bs]
            final[bs, pad + t_close[bs] + U_b[bs], U_b[bs] + 1] = lp[r, 0] + lp_dur[r, i]

    # Both walks in one loop over steps, one gather, one add and one logsumexp a step for the two: step k computes
    # alpha at step pad + k and beta at step pad + steps - 1 - k, each from the K terms of its cells, read from
    # the flat (2, B, S * W + 1) grids by index tensors built once (a blank arc per duration >= 1, a label arc per
    # duration, and one more: for alpha the start, the constant 0 with weight 0 at (0, 0) only; for beta the
    # closing blank), their weights sliced once before (step-major, so that a step's weights are contiguous).
    # No mask per step: every weight of a cell off the grid is -inf, so an off-grid cell passes nothing on (alpha) and receives nothing (beta: its own arcs'
    # weights); only cells are read out below. The loop's cost is torch's per-op overhead (a few us an op):
    # one loop for both walks halves it.
    flat = torch.full((2, B, S * W + 1), -math.inf, dtype=lp.dtype)  # alpha, beta; [-1]: a constant 0
    flat[:, :, -1] = 0.0
    L = S * W + 1
    alpha, beta = (x[:, :-1].view(B, S, W) for x in flat)
    cells, left = slice(1, max_u1 + 1), slice(0, max_u1)
    blanks = [i for i, di in enumerate(ds) if di >= 1]  # the durations a blank may take
    Db = len(blanks)
    K = Db + D + 1
    col = torch.arange(1, max_u1 + 1)
    k_all = torch.arange(steps)[:, None, None]
    n_a, n_b = pad + k_all, pad + steps - 1 - k_all  # the steps of alpha and beta at loop step k, (steps, 1, 1)
    db, d3 = d[blanks][None, :, None], d[None, :, None]
    const = torch.full((steps, 1, max_u1), S * W)
    index = torch.stack([
        torch.cat([(n_a - db) * W + col, (n_a - d3 - 1) * W + col - 1, const], dim=1),  # alpha: from the arcs' sources
        torch.cat([(n_b + db) * W + col, (n_b + d3 + 1) * W + col + 1, const], dim=1),  # beta: to their targets
    ], dim=1).view(steps, 2, 1, K * max_u1)
    w = lp.new_empty(steps, 2, B, K, max_u1)
    for j, i in enumerate(blanks):
        w[:, 0, :, j] = blank_w[:, pad - ds[i]:pad + steps - ds[i], i, cells].transpose(0, 1)
    for i, di in enumerate(ds):
        w[:, 0, :, Db + i] = label_w[:, pad - di - 1:pad + steps - di - 1, i, left].transpose(0, 1)
    w[:, 0, :, K - 1] = -math.inf
    w[0, 0, :, K - 1, 0] = 0.0  # alpha(0, 0) = 0: the constant, at step 0 only
    w[:, 1, :, :Db] = blank_w[:, pad:pad + steps, blanks, cells].flip(1).transpose(0, 1)  # beta: steps downwards
    w[:, 1, :, Db:Db + D] = label_w[:, pad:pad + steps, :, cells].flip(1).transpose(0, 1)
    w[:, 1, :, K - 1] = final[:, pad:pad + steps, cells].flip(1).transpose(0, 1)
    for k in range(steps):
        terms = torch.gather(flat, 2, index[k].expand(2, B, K * max_u1)).view(2, B, K, max_u1).add_(w[k])
        # alpha[:, pad + k, cells] and beta[:, pad + steps - 1 - k, cells] as one (2, B, max_u1) view of flat
        out = flat.as_strided((2, B, max_u1), (B * L + (steps - 1 - 2 * k) * W, L, 1), (pad + k) * W + 1)
        logsumexp(terms, 2, out=out)

    loss = -beta[:, pad, 1]
    nan_rows = torch.isnan(lp).any(dim=1) | torch.isnan(lp_dur).any(dim=1)
    if nan_rows.any():  # rare: which utterances have a NaN in a cell (padding rows may hold anything)
        nan_seen = nan_rows[rows] & is_cell
        loss = torch.where(nan_seen.flatten(1).any(dim=1), math.nan, loss)

    picked = is_cell.flatten().nonzero().squeeze(1)
    dst = rows.flatten()[picked]
    alpha_rows[dst] = alpha[:, pad:pad + steps, cells].flatten()[picked]
    beta_rows[dst] = beta[:, pad:pad + steps, cells].flatten()[picked]
    return alpha_rows, beta_rows, loss


def _tdt_arc_occupancies(layout, lp, lp_dur, alpha, beta, loss, live, d, start, end, cells):
    """For the rows [start, end) (``cells`` = _cells(layout, start, end)): the cell posterior gamma (n,) and
    the posteriors of its blank and label arcs per duration (n, D), zero off ``live`` rows."""
    b, t, u, _ = cells
    T, U, stride = layout.logit_lengths[b], layout.target_lengths[b], layout.row_strides[b]
    last = beta.size(0) - 1
    row = torch.arange(start, end)
    log_norm = torch.where(live, alpha[start:end] + loss[b], -math.inf)
    gamma = exp_(log_norm + beta[start:end])
    land = t[:, None] + d  # the frame an arc of each duration reaches
    inside = land < T[:, None]
    dst = (row[:, None] + d * stride[:, None]).clamp(max=last)
    ends = (land == T[:, None]) & (u == U)[:, None]
    after_blank = torch.where(inside, beta[dst], torch.where(ends, 0.0, -math.inf))
    after_blank = torch.where(d >= 1, after_blank, -math.inf)
    after_label = torch.where(inside & (u < U)[:, None], beta[(dst + 1).clamp(max=last)], -math.inf)
    base = log_norm[:, None] + lp_dur[start:end]
    blank_arc = exp_(base + lp[start:end, 0:1] + after_blank)
    label_arc = exp_(base + lp[start:end, 1:2] + after_label)
    return gamma, blank_arc, label_arc


def tdt_gradient(tokens2d, durations2d, targets, layout, lp, lp_dur, den, alpha, beta, loss, scale, blank,
                 durations, out_tokens, out_durations, fastemit_lambda=0.0, omega=0.0, rnnt=None, sigma=0.0,
                 clamp=0.0, row_start=0):
    """Writes into ``out_tokens`` (N, V) and ``out_durations`` (N, D), the logits' dtype, the gradient of
    sum_b scale[b] * L_b w.r.t. tokens2d and durations2d, with L_b = (1 - omega) * tdt_b + omega * rnnt_b.
    ``rnnt`` = (alpha_r, beta_r, loss_r) of the plain RNN-T loss of the token columns without sigma
    (``cpu.alpha_beta(lp + sigma, layout, False)``), needed when omega > 0.

    With gamma the cell posterior, B_i / L_i the posteriors of the blank / label arcs of duration d_i leaving
    the cell, p the softmax of the token columns, q that of the duration columns, lam = fastemit_lambda:

        token v:    (1 - omega) * [p_v (gamma + lam sum_i L_i) - [v == blank] sum_i B_i - [v == y] (1 + lam) sum_i L_i]
                    + omega * (the same for the RNN-T loss: p_v (gamma_r + lam L_r) - [blank] B_r - [y] (1 + lam) L_r)
        duration j: (1 - omega) * [q_j gamma - B_j - L_j]

    clamped to [-clamp, clamp] when clamp > 0 (for a unit incoming gradient), then times scale[b]. FastEmit
    scales the gradient of every label token log-prob, so both terms get it (as NeMo's sampled RNN-T branch
    does). Zeros on padding rows and for utterances whose TDT loss (or, with omega > 0, RNN-T loss) is not
    finite or whose scale is 0. The outputs may be the inputs themselves (in place). The scores (and outputs)
    are the rows [row_start, row_start + N) of the layout; lp, lp_dur, den, alpha and beta hold every row."""
    num_rows, V = tokens2d.shape
    ds = check_durations(durations, durations2d.size(1))
    d = torch.tensor(ds)
    if omega and rnnt is None:
        raise ValueError("omega > 0 needs the RNN-T alpha, beta and loss (rnnt)")
    ok = torch.isfinite(loss) & (scale != 0)
    if omega:
        alpha_r, beta_r, loss_r = rnnt
        ok &= torch.isfinite(loss_r)
        lp_r = lp + sigma  # the RNN-T log-probs: token log_softmax, no sigma
    lam = float(fastemit_lambda)
    fold = _fold_scale(scale, clamp)
    for local, local_end in _chunks(num_rows, V + len(ds)):
        start, end = row_start + local, row_start + local_end  # rows of the layout
        cells = _cells(layout, start, end)
        b, t, u, is_cell = cells
        live = is_cell & ok[b]
        gamma, blank_arc, label_arc = _tdt_arc_occupancies(layout, lp, lp_dur, alpha, beta, loss, live, d,
                                                           start, end, cells)
        has_label = is_cell & (u < layout.target_lengths[b])
        labels = _labels(targets, b, u, has_label, blank)
        index = torch.arange(end - start)
        blank_total, label_total = blank_arc.sum(dim=1), label_arc.sum(dim=1)
        factor = (1 - omega) * (gamma + lam * label_total)  # of the softmax, per row
        sub_blank = (1 - omega) * blank_total
        sub_label = (1 - omega) * (1 + lam) * label_total
        if omega:
            gamma_r, blank_r, label_r, *_ = _gradient_coefficients(layout, lp_r, alpha_r, beta_r, loss_r, scale,
                                                                       False, start, end, cells)
            factor += omega * (gamma_r + lam * label_r)
            sub_blank += omega * blank_r
            sub_label += omega * (1 + lam) * label_r
        row_scale = scale[b]
        if fold:
            factor, sub_blank, sub_label = (x * row_scale for x in (factor, sub_blank, sub_label))
        # the token gradient is formed in its output rows when they have the arithmetic's dtype (no
        # allocation of the chunk's size: fresh pages cost more than the arithmetic here)
        dst = out_tokens[local:local_end]
        g_tok = dst if dst.dtype == lp.dtype else torch.empty(dst.shape, dtype=lp.dtype)
        exp_(torch.sub(tokens2d[local:local_end].to(lp.dtype), den[start:end, 0:1], out=g_tok))
        g_tok.mul_(factor[:, None])
        g_tok[index, blank] -= sub_blank
        g_tok[index, labels] -= sub_label
        q = exp_(durations2d[local:local_end].to(lp.dtype) - den[start:end, 1:2])
        g_dur = q.mul_(gamma[:, None]).sub_(blank_arc).sub_(label_arc).mul_(1 - omega)
        if not fold:
            if clamp > 0:
                g_tok.clamp_(-clamp, clamp)
            g_tok.mul_(row_scale[:, None])
        if clamp > 0:
            g_dur.clamp_(-clamp, clamp)
        g_dur.mul_(row_scale[:, None])
        dead = ~live
        if dead.any():  # padding rows and dead utterances' rows may hold anything, even NaN
            for g in (g_tok, g_dur):
                g.masked_fill_(dead[:, None], 0.0)
        if g_tok is not dst:
            dst.copy_(g_tok)
        out_durations[local:local_end] = g_dur
