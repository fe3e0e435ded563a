"""The fused joiner loss's output GEMM with the loss in its epilogue (Triton): the logits ``z = h W^T + b`` of a
tile of rows exist only in registers, tile by tile.

    logit_stats      forward: per row, the logsumexp of the token columns (an online logsumexp over the
                     column blocks, as flash attention's softmax), the blank's and the label's logits, and the
                     extra columns' logits (TDT's durations, multi-blank's big blanks): what the log-probs stage
                     computes from the logits, without the logits
    logit_gradient   backward: the gradient of the tile's logits from per-row coefficients (the
                     ``gradient_coefficients`` stage), written in the GEMMs' dtype for dW and dh; with a bias,
                     the column sums of each block of rows (the bias gradient, summed in a fixed order)

The gradient of a row, with the coefficients of ``gradient_coefficients`` (transducer/layout.py), is

    g(v) = exp(z_v + coef(v)) - [v == blank] sub_blank - [v == y] sub_label - [v in extras] sub_extra(v)
    grad(v) = scale * clamp(g(v))

``coef(v)`` is the token coefficient on the token columns and the extra coefficient on TDT's duration columns.
One program owns BM rows: the forward loops over the column blocks (no partial results leave the program),
the backward takes one (BM, BN) block. Rows are the compact layout's (every row a cell); a row's utterance is
a binary search over row_splits (as common.cuh's Grids does). The kernels run on 16-bit GEMM operands
(``h`` and ``W`` in the autocast dtype) with fp32 accumulation; the logits stay fp32.

Importing this module needs Triton (torch's CUDA wheels bring it); ``available()`` says whether it imports.
With ``TRITON_INTERPRET=1`` set before the import, the kernels run on CPU tensors (fp16 and fp32: the
interpreter mishandles bf16), which is how the CPU tests check them.
"""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton before 3.3
    TensorDescriptor = None

__all__ = ["available", "interpreted", "logit_stats", "logit_gradient", "GRADIENT_COEFFICIENTS"]

#: Columns of the per-row coefficients (gradient_coefficients): scale (0: the row gets no gradient), the token
#: coefficient, the blank's and the label's subtrahends, the extra columns' coefficient.
GRADIENT_COEFFICIENTS = 5


def available():
    """Whether Triton imports (the fused joiner loss then takes this path for 16-bit GEMMs on CUDA)."""
    return triton is not None


def interpreted():
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1: CPU tensors)."""
    return triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if triton is not None:

    @triton.jit
    def _row_labels_kernel(table, B, targets, ld_targets, num_rows, sigma, delay_penalty, labels, shifts,
                           LOG_B: tl.constexpr, BLOCK: tl.constexpr):
        """labels[r] = y_{u+1} of row r (-1 at u == U_b) and shifts[r] = what the label's log-prob adds to z_y -
        den: -sigma plus k2's delay penalty delay_penalty * ((T_b - 1) / 2 - t), -inf at u == U_b."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < num_rows
        b, t, u, T, U, _ = _row_cells(tl.minimum(rows, num_rows - 1).to(tl.int64), table, B, LOG_B)
        has_label = u < U
        y = tl.load(targets + b * ld_targets + tl.where(has_label, u, 0), mask=has_label, other=-1)
        shift = delay_penalty * (0.5 * (T - 1).to(tl.float32) - t.to(tl.float32)) - sigma
        tl.store(labels + rows, tl.where(has_label, y.to(tl.int32), -1), mask=ok)
        tl.store(shifts + rows, tl.where(has_label, shift, float("-inf")), mask=ok)

    @triton.jit
    def _row_cells(rows, table, B, LOG_B: tl.constexpr):
        """(b, t, u, T_b, U_b, stride) of rows of the compact layout (int64): b is the last utterance with
        row_splits[b] <= row (row_splits = table[3B : 4B + 1]), by LOG_B >= log2(B) halvings of [0, B), as
        common.cuh's Grids finds it."""
        lo = tl.zeros_like(rows)
        hi = lo + B
        for _ in tl.static_range(LOG_B):
            mid = (lo + hi) // 2
            go = tl.load(table + 3 * B + mid) <= rows
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        b = lo
        stride = tl.maximum(tl.load(table + 2 * B + b), 1)
        local = rows - tl.load(table + 3 * B + b)
        t = local // stride
        return b, t, local - t * stride, tl.load(table + b), tl.load(table + B + b), stride

    @triton.jit
    def _beta_at(beta, r, ok):
        """beta[r] where ok, else -inf."""
        return tl.load(beta + tl.where(ok, r, 0), mask=ok, other=float("-inf"))

    @triton.jit
    def _gradient_coefficients_kernel(table, B, lp, den, alpha, beta, nll, scale, lp_extra, durations,
                                      alpha_r, beta_r, nll_r, coefs, subs, num_rows, fastemit_lambda, sigma, omega,
                                      E, RNA: tl.constexpr, TDT: tl.constexpr, BIG: tl.constexpr,
                                      OMEGA: tl.constexpr, LOG_B: tl.constexpr, BLOCK: tl.constexpr):
        """The rows' terms of the gradient (transducer/layout.py's gradient and tdt_gradient formulas; cpu.py
        computes them alike): coefs (N, 5) = [scale[b] (0: the row gets no gradient), log of the token softmax's
        factor less its den, the blank's subtrahend, the label's, log of the extra columns' softmax factor less
        their den (TDT's durations; else the token one)], subs (N, E) the extra columns' subtrahends in column
        order (TDT: duration i in column i; multi-blank: big blank i, column blank - 1 - i, in E - 1 - i)."""
        NINF = float("-inf")
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < num_rows
        r = tl.minimum(rows, num_rows - 1).to(tl.int64)
        b, t, u, T, U, st = _row_cells(r, table, B, LOG_B)
        loss = tl.load(nll + b)
        sc = tl.load(scale + b)
        live = (tl.abs(loss) < float("inf")) & (sc != 0.0)
        if RNA:
            live &= (u <= t) & (t - u <= T - 1 - U)
        if OMEGA:
            loss_r = tl.load(nll_r + b)
            live &= tl.abs(loss_r) < float("inf")
        lognorm = tl.where(live, tl.load(alpha + r) + loss, NINF)
        lp_blank = tl.load(lp + 2 * r)
        lp_label = tl.load(lp + 2 * r + 1)
        lam = fastemit_lambda
        if TDT:
            keep = 1.0 - omega
            gamma = tl.exp(lognorm + tl.load(beta + r))
            sum_blank = tl.zeros_like(gamma)
            sum_label = tl.zeros_like(gamma)
            for i in range(E):
                d = tl.load(durations + i)
                s = t + d
                w = lognorm + tl.load(lp_extra + r * E + i)
                after = tl.where(s == T, tl.where(u == U, 0.0, NINF), _beta_at(beta, r + d * st, s < T))
                arc_blank = tl.where(d >= 1, tl.exp(w + lp_blank + after), 0.0)
                arc_label = tl.exp(w + lp_label + _beta_at(beta, r + d * st + 1, (s < T) & (u < U)))
                sum_blank += arc_blank
                sum_label += arc_label
                tl.store(subs + r * E + i, keep * (arc_blank + arc_label), mask=ok)
            factor = keep * (gamma + lam * sum_label)
            sub_blank = keep * sum_blank
            sub_label = keep * sum_label
            if OMEGA:
                lognorm_r = tl.where(live, tl.load(alpha_r + r) + loss_r, NINF)
                after = tl.where(t + 1 < T, _beta_at(beta_r, r + st, t + 1 < T), tl.where(u == U, 0.0, NINF))
                blank_r = tl.exp(lognorm_r + lp_blank + sigma + after)
                label_r = tl.exp(lognorm_r + lp_label + sigma + _beta_at(beta_r, r + 1, u < U))
                factor += omega * (tl.exp(lognorm_r + tl.load(beta_r + r)) + lam * label_r)
                sub_blank += omega * blank_r
                sub_label += omega * label_r
            coef = tl.log(factor) - tl.load(den + 2 * r)
            coef_extra = tl.log(keep * gamma) - tl.load(den + 2 * r + 1)
        else:
            after = tl.where(t + 1 < T, _beta_at(beta, r + st, t + 1 < T), tl.where(u == U, 0.0, NINF))
            sub_blank = tl.exp(lognorm + lp_blank + after)
            if RNA:
                after = _beta_at(beta, r + st + 1, (u < U) & (t + 1 < T))
            else:
                after = _beta_at(beta, r + 1, u < U)
            occ_label = tl.exp(lognorm + lp_label + after)
            coef = tl.log(tl.exp(lognorm + tl.load(beta + r)) + lam * occ_label) - tl.load(den + r)
            coef_extra = coef
            sub_label = (1.0 + lam) * occ_label
            if BIG:
                for i in range(E):
                    d = tl.load(durations + i)
                    s = t + d
                    after = tl.where(s == T, tl.where(u == U, 0.0, NINF), _beta_at(beta, r + d * st, s < T))
                    arc = tl.exp(lognorm + tl.load(lp_extra + r * E + i) + after)
                    tl.store(subs + r * E + (E - 1 - i), arc, mask=ok)
        c = coefs + r * 5
        tl.store(c, tl.where(live, sc, 0.0), mask=ok)
        tl.store(c + 1, coef, mask=ok)
        tl.store(c + 2, sub_blank, mask=ok)
        tl.store(c + 3, sub_label, mask=ok)
        tl.store(c + 4, coef_extra, mask=ok)

    @triton.jit
    def _load_operands(h, ld_h, w, ld_w, local, m0, n, ki, K, W_ROWS, BN: tl.constexpr, BK: tl.constexpr,
                       EVEN_K: tl.constexpr, TMA: tl.constexpr):
        """The (BM, BK) block ki of the program's rows of h (local: their indices, clamped into range; m0 the
        first) and the (BK, BN) block (ki, n) of w^T. TMA: h and w are tensor descriptors, which read zeros
        past the ends; else pointers, the columns clamped into range, masks on K alone."""
        if TMA:
            x = h.load([m0, ki * BK])
            y = w.load([n * BN, ki * BK]).T
        else:
            ks = ki * BK + tl.arange(0, BK)
            cols = tl.minimum(n * BN + tl.arange(0, BN), W_ROWS - 1)
            a = h + local.to(tl.int64)[:, None] * ld_h + ks[None, :]
            b = w + cols.to(tl.int64)[None, :] * ld_w + ks[:, None]
            if EVEN_K:
                x = tl.load(a)
                y = tl.load(b)
            else:
                x = tl.load(a, mask=(ks < K)[None, :], other=0.0)
                y = tl.load(b, mask=(ks < K)[:, None], other=0.0)
        return x, y

    @triton.jit
    def _logit_stats_kernel(h, ld_h, w, ld_w, bias, labels, shifts, lp, den, ld_den, extra,
                            row_start, num_rows, K, W_ROWS, V, blank, x0, sigma,
                            E: tl.constexpr, DUR: tl.constexpr, REVERSE_EXTRA: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr):
        m0 = tl.program_id(0) * BM
        local = m0 + tl.arange(0, BM)
        row_ok = local < num_rows
        local = tl.minimum(local, num_rows - 1)
        rows64 = (row_start + local).to(tl.int64)
        y = tl.load(labels + rows64)
        shift = tl.load(shifts + rows64)
        NINF = float("-inf")
        m = tl.full((BM,), NINF, tl.float32)  # the token columns' running max and sum (online logsumexp)
        s = tl.zeros((BM,), tl.float32)
        md = tl.full((BM,), NINF, tl.float32)  # DUR: the duration columns' (V ... V + E - 1)
        sd = tl.zeros((BM,), tl.float32)
        low = tl.full((BM,), float("inf"), tl.float32)  # the row's least logit: -inf makes den NaN
        z_blank = tl.zeros((BM,), tl.float32)
        z_label = tl.zeros((BM,), tl.float32)
        end = V + E if DUR else V
        KT = tl.cdiv(K, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        # one loop over the column blocks and the K blocks of each, so that the loads stay pipelined across
        # the column blocks; the epilogue of a column block runs after its last K block
        for i in range(tl.cdiv(end, BN) * KT):
            n = i // KT
            ki = i - n * KT
            a, b = _load_operands(h, ld_h, w, ld_w, local, m0, n, ki, K, W_ROWS, BN, BK, EVEN_K, TMA)
            acc = tl.dot(a, b, acc)
            if ki == KT - 1:
                cols = n * BN + tl.arange(0, BN)
                z = acc
                if HAS_BIAS:
                    z += tl.load(bias + cols, mask=cols < end, other=0.0).to(tl.float32)[None, :]
                # +inf and NaN make a sum NaN (inf - inf, exp(NaN)), -inf the least logit: den NaN either way
                low = tl.minimum(low, tl.min(tl.where((cols < end)[None, :], z, float("inf")), axis=1))
                x = tl.where((cols < V)[None, :], z, NINF)
                m_new = tl.maximum(m, tl.max(x, axis=1))
                m_safe = tl.where(m_new == NINF, 0.0, m_new)
                s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
                m = m_new
                if DUR and n * BN + BN > V:
                    xd = tl.where((cols >= V)[None, :] & (cols < end)[None, :], z, NINF)
                    md_new = tl.maximum(md, tl.max(xd, axis=1))
                    md_safe = tl.where(md_new == NINF, 0.0, md_new)
                    sd = sd * tl.exp(md - md_safe) + tl.sum(tl.exp(xd - md_safe[:, None]), axis=1)
                    md = md_new
                if (n * BN <= blank) & (blank < n * BN + BN):
                    z_blank += tl.sum(tl.where(cols[None, :] == blank, z, 0.0), axis=1)
                z_label += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
                if E > 0:
                    if (n * BN < x0 + E) & (n * BN + BN > x0):
                        j = cols - x0
                        is_extra = (j >= 0) & (j < E)
                        if REVERSE_EXTRA:
                            j = E - 1 - j
                        dst = extra + rows64[:, None] * E + tl.where(is_extra, j, 0)[None, :]
                        tl.store(dst, z, mask=row_ok[:, None] & is_extra[None, :])
                acc = tl.zeros((BM, BN), dtype=tl.float32)
        bad = tl.where((low == NINF) | (s != s) | (sd != sd), float("nan"), 0.0)
        d = m + tl.log(s + bad)
        tl.store(den + rows64 * ld_den, d, mask=row_ok)
        if DUR:
            tl.store(den + rows64 * ld_den + 1, md + tl.log(sd + bad), mask=row_ok)
        tl.store(lp + 2 * rows64, z_blank - d - sigma, mask=row_ok)
        tl.store(lp + 2 * rows64 + 1, z_label - d + shift, mask=row_ok)

    @triton.jit
    def _logit_gradient_kernel(h, ld_h, w, ld_w, bias, labels, coefs, subs, out, ld_out, row_start, num_rows, K,
                               W_ROWS, V, blank, x0, out_cols, clamp, E: tl.constexpr, DUR: tl.constexpr,
                               CLAMP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_N: tl.constexpr, BM: tl.constexpr,
                               BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                               TMA_STORE: tl.constexpr):
        # SPLIT_N: a program per (row block, column block), the column blocks of a row block one after another
        # (h stays in cache); else a program per row block, looping over the column blocks as logit_stats does.
        # TMA_STORE: out is a tensor descriptor.
        blocks_n = tl.cdiv(out_cols, BN)
        pid = tl.program_id(0)
        if SPLIT_N:
            pid_m = pid // blocks_n
            n_first = pid - pid_m * blocks_n
            n_count = 1
        else:
            pid_m = pid
            n_first = 0
            n_count = blocks_n
        m0 = pid_m * BM
        local = m0 + tl.arange(0, BM)
        row_ok = local < num_rows
        local = tl.minimum(local, num_rows - 1)
        rows64 = (row_start + local).to(tl.int64)
        y = tl.load(labels + rows64)
        c = coefs + rows64 * 5
        scale = tl.load(c)
        coef_tok = tl.load(c + 1)
        sub_blank = tl.load(c + 2)
        sub_label = tl.load(c + 3)
        coef_extra = tl.load(c + 4)
        end = V + E if DUR else V
        KT = tl.cdiv(K, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i in range(n_count * KT):
            n = n_first + i // KT
            ki = i % KT
            a, b = _load_operands(h, ld_h, w, ld_w, local, m0, n, ki, K, W_ROWS, BN, BK, EVEN_K, TMA)
            acc = tl.dot(a, b, acc)
            if ki == KT - 1:
                cols = n * BN + tl.arange(0, BN)
                z = acc
                if HAS_BIAS:
                    z += tl.load(bias + cols, mask=cols < end, other=0.0).to(tl.float32)[None, :]
                if DUR:
                    coef = tl.where((cols < V)[None, :], coef_tok[:, None], coef_extra[:, None])
                else:
                    coef = coef_tok[:, None]
                g = tl.exp(z + coef)
                if (n * BN <= blank) & (blank < n * BN + BN):
                    g -= tl.where(cols[None, :] == blank, sub_blank[:, None], 0.0)
                g -= tl.where(cols[None, :] == y[:, None], sub_label[:, None], 0.0)
                if E > 0:
                    if (n * BN < x0 + E) & (n * BN + BN > x0):
                        j = cols - x0
                        is_extra = (j >= 0) & (j < E)
                        g -= tl.load(subs + rows64[:, None] * E + tl.where(is_extra, j, 0)[None, :],
                                     mask=is_extra[None, :], other=0.0)
                if CLAMP:
                    g = tl.minimum(tl.maximum(g, -clamp), clamp)
                live = (scale != 0.0)[:, None] & (cols < end)[None, :]
                if TMA_STORE:
                    out.store([m0, n * BN], tl.where(live, g * scale[:, None], 0.0).to(out.dtype))
                else:
                    g = tl.where(live, g * scale[:, None], 0.0).to(out.dtype.element_ty)
                    tl.store(out + local.to(tl.int64)[:, None] * ld_out + cols[None, :], g,
                             mask=row_ok[:, None] & (cols < out_cols)[None, :])
                acc = tl.zeros((BM, BN), dtype=tl.float32)


def _log_b(B):
    return max(1, (B - 1).bit_length())


#: (BM, BN, BK, num_warps, num_stages, SPLIT_N, TMA loads, TMA stores) of the kernels on CUDA
#: (benchmarks/RESULTS.md: the epilogue GEMMs' blocks); the interpreter takes small blocks (a few programs'
#: worth of numpy work).
CONFIG = {"stats": (64, 128, 64, 4, 4, False, True, False), "gradient": (128, 128, 64, 4, 3, True, True, False)}
_INTERPRETED = (16, 16, 16, 1, 1, False, True, True)


def _config(kernel, device_type, K):
    bm, bn, bk, warps, stages, split, tma, tma_store = CONFIG[kernel] if device_type == "cuda" else _INTERPRETED
    while bk > 16 and bk > K:
        bk //= 2
    return bm, bn, bk, warps, stages, split, tma, tma_store


def _operands(tensors, blocks, tma):
    """(the tensors, TMA): tensor descriptors of the 2-D ``tensors``' ``blocks`` where TMA is asked for and every
    tensor allows it (16-byte aligned base and row stride, unit column stride), else the tensors themselves."""
    if tma and TensorDescriptor is not None and all(
            x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0 and x.stride(1) == 1 for x in tensors):
        return [TensorDescriptor(x, list(x.shape), [x.stride(0), 1], list(block))
                for x, block in zip(tensors, blocks)], True
    return list(tensors), False


def _kind(options, V):
    """(E, DUR, x0, REVERSE_EXTRA) of the loss: the extra columns [x0, x0 + E) beside blank and label."""
    if options.durations:
        return len(options.durations), True, V, False
    big = len(options.big_blank_durations)
    if big:
        return big, False, options.blank - big, True
    return 0, False, 0, False


def row_labels(layout, targets, options, num_rows):
    """(labels, shifts) of the rows of the compact ``layout``: int32 y_{u+1} (-1 at u == U_b) and the fp32 term
    that the label's log-prob adds to z_y - den (-sigma, the delay penalty; -inf at u == U_b)."""
    device = layout.table.device
    labels = torch.empty(num_rows, dtype=torch.int32, device=device)
    shifts = torch.empty(num_rows, dtype=torch.float32, device=device)
    if num_rows:
        block = 1024 if device.type == "cuda" else 64
        B = layout.batch_size
        _row_labels_kernel[(triton.cdiv(num_rows, block),)](
            layout.table, B, targets, targets.stride(0), num_rows, float(options.sigma),
            float(options.delay_penalty), labels, shifts, LOG_B=_log_b(B), BLOCK=block)
    return labels, shifts


def gradient_coefficients(lattice, scale, options):
    """(coefs (N, GRADIENT_COEFFICIENTS), subs (N, E)): the terms of each row's gradient that logit_gradient
    takes, for the rows of ``lattice`` (a compact layout) and the incoming gradient ``scale`` (B,), options as
    the gradient stages read them (transducer/layout.py)."""
    lp = lattice.lp
    num_rows, device = lp.size(0), lp.device
    D, K = len(options.durations), len(options.big_blank_durations)
    coefs = torch.empty(num_rows, GRADIENT_COEFFICIENTS, dtype=lp.dtype, device=device)
    subs = torch.empty(num_rows, D or K, dtype=lp.dtype, device=device)
    if num_rows == 0:
        return coefs, subs
    omega = bool(options.omega)
    if omega and lattice.rnnt is None:
        raise ValueError("gradient_coefficients: omega > 0 needs the RNN-T walks (lattice.rnnt)")
    rnnt = lattice.rnnt if omega else (lattice.alpha, lattice.beta, lattice.nll)
    durations = torch.tensor(options.durations or options.big_blank_durations or [0], dtype=torch.int64,
                             device=device)
    block = 256 if device.type == "cuda" else 64
    B = lattice.layout.batch_size
    _gradient_coefficients_kernel[(triton.cdiv(num_rows, block),)](
        lattice.layout.table, B, lp, lattice.den, lattice.alpha, lattice.beta, lattice.nll, scale.to(lp.dtype),
        lattice.lp_dur if lattice.lp_dur is not None else lp, durations, *rnnt, coefs, subs, num_rows,
        float(options.fastemit_lambda), float(options.sigma), float(options.omega), D or K,
        RNA=bool(options.one_sym_per_frame), TDT=D > 0, BIG=K > 0, OMEGA=omega, LOG_B=_log_b(B), BLOCK=block)
    return coefs, subs


def logit_stats(h, weight, bias, rows, options, V, row_start, lp, den, extra):
    """For the rows [row_start, row_start + len(h)) of a compact layout, with z = h @ weight^T + bias (weight
    (W_ROWS, K): V token rows, then with ``options.durations`` D duration rows, then zero rows of padding; bias
    (V [+ D],) or None) and ``rows`` = row_labels(...) of every row: den[r] = logsumexp of the token columns
    (TDT: den[r, 1] that of the duration columns), lp[r] = [z_blank - den - sigma, z_y - den + shift], and
    ``extra`` (N, E) the raw logits of TDT's duration columns (in order) or of the big blanks (big blank i,
    column blank - 1 - i, in column i). A non-finite logit in a row makes its den entries NaN. ``lp``, ``den``
    and ``extra`` hold every row of the layout."""
    num_rows, K = h.shape
    if num_rows == 0:
        return
    E, dur, x0, reverse = _kind(options, V)
    bm, bn, bk, warps, stages, _, tma, _ = _config("stats", h.device.type, K)
    labels, shifts = rows
    (a, b), tma = _operands((h, weight), ((bm, bk), (bn, bk)), tma)
    _logit_stats_kernel[(triton.cdiv(num_rows, bm),)](
        a, h.stride(0), b, weight.stride(0), bias if bias is not None else h, labels, shifts, lp, den,
        den.stride(0) if den.dim() == 2 else 1, extra if E else lp, row_start, num_rows, K, weight.size(0), V,
        options.blank, x0, float(options.sigma), E=E, DUR=dur, REVERSE_EXTRA=reverse, HAS_BIAS=bias is not None,
        BM=bm, BN=bn, BK=bk, EVEN_K=K % bk == 0, TMA=tma, num_warps=warps, num_stages=stages)


def logit_gradient(h, weight, bias, labels, options, V, row_start, coefs, subs, out):
    """``out`` (len(h), C) = the gradient of the rows [row_start, row_start + len(h)) of z = h @ weight^T + bias
    (as logit_stats) from their coefficients: ``coefs`` (N, GRADIENT_COEFFICIENTS) and ``subs`` (N, E) (the
    extra columns' subtrahends, in column order) of every row, ``labels`` row_labels' first; the columns past
    the loss's (V [+ D] <= C) get zeros."""
    num_rows, K = h.shape
    if num_rows == 0:
        return
    E, dur, x0, _ = _kind(options, V)
    cols = out.size(1)
    bm, bn, bk, warps, stages, split, tma, tma_store = _config("gradient", h.device.type, K)
    grid = (triton.cdiv(num_rows, bm) * (triton.cdiv(cols, bn) if split else 1),)
    (a, b), tma = _operands((h, weight), ((bm, bk), (bn, bk)), tma)
    (o,), tma_store = _operands((out,), ((bm, bn),), tma and tma_store)
    _logit_gradient_kernel[grid](
        a, h.stride(0), b, weight.stride(0), bias if bias is not None else h, labels, coefs, subs if E else coefs,
        o, out.stride(0), row_start, num_rows, K, weight.size(0), V, options.blank, x0, cols,
        float(max(options.clamp, 0.0)), E=E, DUR=dur, CLAMP=options.clamp > 0, HAS_BIAS=bias is not None,
        SPLIT_N=split, BM=bm, BN=bn, BK=bk, EVEN_K=K % bk == 0, TMA=tma, TMA_STORE=tma_store, num_warps=warps,
        num_stages=stages)
