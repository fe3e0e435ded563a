"""The CPU stages of the Token-and-Duration Transducer (TDT) loss (Xu et al. 2023, NeMo's semantics),
vectorised with torch like transducer/cpu.py (layouts and chunking: layout.py, cpu.py).

Each row of ``logits2d`` (N, V + D) holds V token scores (blank among them) then D duration scores;
``durations`` is a host list of D distinct ints >= 0, at least one >= 1:

    tok(t,u,v) = z(t,u,v) - logsumexp_{v'<V} z(t,u,v') - sigma
    dur(t,u,i) = z(t,u,V+i) - logsumexp_{j<D} z(t,u,V+j)

From cell (t, u) a label y_{u+1} with duration d_i goes to (t + d_i, u + 1) if t + d_i < T_b (d_i may be 0);
a blank with duration d_i >= 1 goes to (t + d_i, u) if t + d_i < T_b, or ends the alignment if u == U_b and
t + d_i == T_b. Every arc goes from anti-diagonal s = t + u to s + d_i (blank) or s + d_i + 1 (label), so
alpha and beta walk the anti-diagonals as for the RNN-T loss, reading up to max(d) + 1 of them back (ahead).

Stages (the CUDA twins have the same names, arguments and results):

``tdt_log_probs(logits2d, targets, layout, blank, vocab_size, sigma) -> (lp, lp_dur, den)``
``tdt_alpha_beta(lp, lp_dur, layout, durations) -> (alpha, beta, loss)``
``tdt_gradient(logits2d, targets, layout, lp, lp_dur, den, alpha, beta, loss, scale, blank, vocab_size,
               durations, out, fastemit_lambda=0.0, omega=0.0, rnnt=None) -> out``

(see each function). ``durations`` stay on the host: the stages only use them as loop bounds and index
offsets, so a CUDA kernel can take them by value (a small fixed-size array in a struct argument); no tensor
of them is needed.
"""

import math

import torch

from ops import accumulate_dtype, gather, reduce

from . import cpu
from .cpu import _cells, _chunks, _labels


def check_durations(durations, num_durations=None):
    """The durations as a tuple of Python ints; ValueError unless they are distinct ints >= 0, at least one
    >= 1 (and ``num_durations`` of them, when given)."""
    try:
        ds = tuple(int(d) for d in durations)
    except TypeError:
        raise ValueError(f"durations must be a sequence of ints, got {durations!r}") from None
    if any(int(d) != d for d in durations):
        raise ValueError(f"durations must be ints, got {list(durations)}")
    if not ds or min(ds) < 0 or max(ds) < 1 or len(set(ds)) != len(ds):
        raise ValueError(f"durations must be distinct ints >= 0 with at least one >= 1, got {list(ds)}")
    if num_durations is not None and len(ds) != num_durations:
        raise ValueError(f"{len(ds)} durations for {num_durations} duration columns")
    return ds


def tdt_log_probs(logits2d, targets, layout, blank, vocab_size, sigma):
    """lp (N, 2) = [tok(blank), tok(y_{u+1})] (-inf for the label at u == U_b and on padding rows), lp_dur
    (N, D) = dur(., i), den (N, 2) = [logsumexp of the V token columns, logsumexp of the D duration columns];
    float32, or float64 for float64 logits. A NaN or infinite logit anywhere in a row (token or duration
    column) makes both den entries of the row, so its lp and lp_dur, NaN. Padding rows may hold anything."""
    num_rows, width = logits2d.shape
    V = int(vocab_size)
    if not 0 < V < width:
        raise ValueError(f"logits2d has {width} columns: need vocab_size ({V}) token columns and >= 1 duration")
    acc = accumulate_dtype(logits2d.dtype)
    b, t, u, is_cell = _cells(layout)
    has_label = is_cell & (u < layout.target_lengths[b])
    picks = torch.stack([torch.full_like(b, blank), _labels(targets, b, u, has_label, blank)], dim=1)
    lp = torch.empty(num_rows, 2, dtype=acc)
    lp_dur = torch.empty(num_rows, width - V, dtype=acc)
    den = torch.empty(num_rows, 2, dtype=acc)
    for start, end in _chunks(num_rows, width):
        rows = logits2d[start:end]
        tokens, durs = rows[:, :V], rows[:, V:]
        den[start:end, 0] = reduce(tokens, axis=-1, op="logsumexp")
        den[start:end, 1] = reduce(durs, axis=-1, op="logsumexp")
        den[start:end].masked_fill_(~torch.isfinite(rows).all(dim=1, keepdim=True), math.nan)
        picked = gather(tokens, picks[start:end], axis=1, batch_dims=1).to(acc)
        lp[start:end] = picked - den[start:end, 0:1] - sigma
        lp_dur[start:end] = durs.to(acc) - den[start:end, 1:2]
    lp[:, 1].masked_fill_(~has_label, -math.inf)
    return lp, lp_dur, den


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
    # arc weights per duration, (B, pad + steps + pad, D, max_u1 + 2): tok + dur, -inf off the grid
    blank_ok = (d >= 1).to(lp.dtype).log()  # 0, or -inf for a blank of duration 0 (not an arc)
    blank_w = _step_grid(lp[:, 0:1] + lp_dur + blank_ok, is_cell, rows, pad)
    label_w = _step_grid(lp[:, 1:2] + lp_dur, is_cell, rows, pad)
    # the closing blank from (t, U_b) of duration T_b - t (at most one, the durations being distinct)
    closes = is_cell & (u == U)
    frames_left = torch.where(closes, T - t, -1)  # (B, steps, max_u1)
    close_dur = torch.where(d == frames_left[..., None], lp_dur[rows], -math.inf).logsumexp(dim=-1)
    final = _step_grid(torch.zeros_like(lp[:, 0]), closes, rows, pad)  # -inf off the closing cells
    final[:, pad:pad + steps, 1:-1] += torch.where(closes, lp[:, 0][rows] + close_dur, -math.inf)
    inside = torch.zeros(final.shape, dtype=torch.bool)
    inside[:, pad:pad + steps, 1:-1] = is_cell

    alpha = torch.full_like(final, -math.inf)
    beta = torch.full_like(final, -math.inf)
    alpha[:, pad, 1] = 0.0
    cells, right, left = slice(1, max_u1 + 1), slice(2, max_u1 + 2), slice(0, max_u1)
    ar = torch.arange(D)
    for n in range(pad + 1, pad + steps):
        src = n - d  # a blank of duration d_i from step n - d_i, a label from step n - d_i - 1
        terms = torch.cat([alpha[:, src, cells] + blank_w[:, src, ar, cells],
                           alpha[:, src - 1, left] + label_w[:, src - 1, ar, left]], dim=1)
        alpha[:, n, cells] = torch.where(inside[:, n, cells], terms.logsumexp(dim=1), -math.inf)
    for n in range(pad + steps - 1, pad - 1, -1):
        dst = n + d
        terms = torch.cat([beta[:, dst, cells] + blank_w[:, n, :, cells],
                           beta[:, dst + 1, right] + label_w[:, n, :, cells],
                           final[:, n, None, cells]], dim=1)
        beta[:, n, cells] = torch.where(inside[:, n, cells], terms.logsumexp(dim=1), -math.inf)

    nan_seen = (torch.isnan(lp[rows]).any(dim=-1) | torch.isnan(lp_dur[rows]).any(dim=-1)) & is_cell
    loss = torch.where(nan_seen.flatten(1).any(dim=1), math.nan, -beta[:, pad, 1])

    alpha_rows[rows[is_cell]] = alpha[:, pad:pad + steps, cells][is_cell]
    beta_rows[rows[is_cell]] = beta[:, pad:pad + steps, cells][is_cell]
    return alpha_rows, beta_rows, loss


def _tdt_arc_occupancies(layout, lp, lp_dur, alpha, beta, loss, live, d, start, end):
    """For the rows [start, end): the cell posterior gamma (n,) and the posteriors of its blank and label arcs
    per duration (n, D), zero off ``live`` rows."""
    b, t, u, _ = _cells(layout, start, end)
    T, U, stride = layout.logit_lengths[b], layout.target_lengths[b], layout.row_strides[b]
    last = beta.size(0) - 1
    row = torch.arange(start, end)
    log_norm = torch.where(live, alpha[start:end] + loss[b], -math.inf)
    gamma = torch.exp(log_norm + beta[start:end])
    land = t[:, None] + d  # the frame an arc of each duration reaches
    inside = land < T[:, None]
    dst = (row[:, None] + d * stride[:, None]).clamp(max=last)
    ends = (land == T[:, None]) & (u == U)[:, None]
    after_blank = torch.where(inside, beta[dst], torch.where(ends, 0.0, -math.inf))
    after_blank = torch.where(d >= 1, after_blank, -math.inf)
    after_label = torch.where(inside & (u < U)[:, None], beta[(dst + 1).clamp(max=last)], -math.inf)
    base = log_norm[:, None] + lp_dur[start:end]
    blank_arc = torch.exp(base + lp[start:end, 0:1] + after_blank)
    label_arc = torch.exp(base + lp[start:end, 1:2] + after_label)
    return gamma, blank_arc, label_arc


def tdt_gradient(logits2d, targets, layout, lp, lp_dur, den, alpha, beta, loss, scale, blank, vocab_size,
                 durations, out, fastemit_lambda=0.0, omega=0.0, rnnt=None):
    """Writes into ``out`` (N, V + D), logits' dtype, the gradient of sum_b scale[b] * L_b w.r.t. logits2d, with
    L_b = (1 - omega) * tdt_b + omega * rnnt_b. ``rnnt`` = (alpha_r, beta_r, loss_r) of the plain RNN-T loss
    of the token columns without sigma (``cpu.alpha_beta(lp + sigma, layout, False)``), needed when omega > 0.

    With gamma the cell posterior, B_i / L_i the posteriors of the blank / label arcs of duration d_i leaving
    the cell, p the softmax of the token columns, q that of the duration columns, lam = fastemit_lambda:

        token v:    (1 - omega) * [p_v (gamma + lam sum_i L_i) - [v == blank] sum_i B_i - [v == y] (1 + lam) sum_i L_i]
                    + omega * (the same for the RNN-T loss: p_v (gamma_r + lam L_r) - [blank] B_r - [y] (1 + lam) L_r)
        duration j: (1 - omega) * [q_j gamma - B_j - L_j]

    all times scale[b]. FastEmit scales the gradient of every label token log-prob, so both terms get it
    (as NeMo's sampled RNN-T branch does). Zeros on padding rows and for utterances whose TDT loss (or, with
    omega > 0, RNN-T loss) is not finite or whose scale is 0. ``out`` may be ``logits2d`` itself."""
    num_rows, width = logits2d.shape
    V = int(vocab_size)
    ds = check_durations(durations, width - V)
    d = torch.tensor(ds)
    if omega and rnnt is None:
        raise ValueError("omega > 0 needs the RNN-T alpha, beta and loss (rnnt)")
    ok = torch.isfinite(loss) & (scale != 0)
    if omega:
        alpha_r, beta_r, loss_r = rnnt
        ok &= torch.isfinite(loss_r)
        lp_r = torch.empty_like(lp)  # the RNN-T log-probs (token log_softmax, no sigma) of the rows seen so far
    lam = float(fastemit_lambda)
    for start, end in _chunks(num_rows, width):
        b, t, u, is_cell = _cells(layout, start, end)
        live = is_cell & ok[b]
        gamma, blank_arc, label_arc = _tdt_arc_occupancies(layout, lp, lp_dur, alpha, beta, loss, live, d,
                                                           start, end)
        has_label = is_cell & (u < layout.target_lengths[b])
        labels = _labels(targets, b, u, has_label, blank)
        index = torch.arange(end - start)
        rows = logits2d[start:end]
        tokens = rows[:, :V].to(lp.dtype)
        p = (tokens - den[start:end, 0:1]).exp_()
        q = (rows[:, V:].to(lp.dtype) - den[start:end, 1:2]).exp_()
        blank_total, label_total = blank_arc.sum(dim=1), label_arc.sum(dim=1)
        g_tok = p * (gamma + lam * label_total)[:, None]
        g_tok[index, blank] -= blank_total
        g_tok[index, labels] -= (1 + lam) * label_total
        g_dur = q.mul_(gamma[:, None]).sub_(blank_arc).sub_(label_arc)
        g = torch.cat([g_tok, g_dur], dim=1).mul_((1 - omega) * scale[b][:, None])
        if omega:
            picked = tokens[index[:, None], torch.stack([torch.full_like(labels, blank), labels], dim=1)]
            lp_r[start:end] = picked - den[start:end, 0:1]
            lp_r[start:end, 1].masked_fill_(~has_label, -math.inf)
            gamma_r, blank_r, label_r, *_ = cpu._gradient_coefficients(layout, lp_r, alpha_r, beta_r, loss_r, scale,
                                                                       False, start, end)
            g_r = p.mul_((gamma_r + lam * label_r)[:, None])
            g_r[index, blank] -= blank_r
            g_r[index, labels] -= (1 + lam) * label_r
            g[:, :V] += g_r.mul_(omega * scale[b][:, None])
        # padding rows and the rows of dead utterances may hold anything, even inf or NaN
        out[start:end] = torch.where(live[:, None], g, 0.0)
    return out
