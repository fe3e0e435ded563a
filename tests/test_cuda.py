"""The CUDA stages (transducer.cuda) against the CPU twin, torchaudio and the reference; graphs; > 2^31 elements.

Every test needs a GPU and CuPy (tests/conftest.py skips them otherwise).
"""

import math

import numpy as np
import pytest
import torch

import _batches
from _batches import compact
from _imports import require
from transducer import TransducerLoss, cpu, pack, transducer_loss, transducer_loss_reference
from transducer.layout import Lattice, Layout, LossOptions
from transducer.library import make_layout

pytestmark = pytest.mark.cuda

DEV = "cuda"


def cuda_stages():
    from transducer import cuda
    return cuda


def random_batch(*args, dtype=torch.float32, **kwargs):
    return _batches.random_batch(*args, dtype=dtype, **kwargs)


def layout_cell_rows(layout):
    """(N,) bool on the CPU: the rows that are cells (not padding)."""
    return cpu._cells(Layout(layout.table.cpu(), layout.padded, layout.max_u1))[3]


def poison_allocator(*shapes_dtypes, copies=4):
    """Hand blocks full of NaN back to torch's caching allocator, sized like the outputs a stage allocates,
    so that its torch.empty outputs most likely start as NaN (unwritten entries then show)."""
    blocks = [torch.full(shape, math.nan, dtype=dtype, device=DEV)
              for shape, dtype in shapes_dtypes for _ in range(copies)]
    torch.cuda.synchronize()
    del blocks


def options(blank=0, from_log_softmax=False, rna=False, **more):
    return LossOptions(blank=blank, from_log_softmax=from_log_softmax, one_sym_per_frame=rna, **more)


def assert_no_nan(*tensors):
    for t in tensors:
        assert not torch.isnan(t).any(), "an entry was left unwritten (NaN poison) or computed as NaN"


# ----------------------------------------------------------------------------------------------- stages


STAGE_CASES = [(V, padded, rna, dtype) for V in (7, 500, 8192) for padded in (False, True)
               for rna in (False, True) for dtype in (torch.float32, torch.float64)]


@pytest.mark.parametrize("V,padded,rna,dtype", STAGE_CASES)
def test_stages_match_cpu(V, padded, rna, dtype):
    cuda = cuda_stages()
    gen = torch.Generator().manual_seed(V + 10 * padded + 100 * rna + (dtype == torch.float64))
    blank = (0, V // 2, V - 1)[V % 3]
    logits, targets, T, U = random_batch(gen, 4, 12, 6, V, blank, dtype=dtype, rna=rna, scale=2.0)
    if padded:  # padding may hold anything; the stages must not read it
        for b in range(len(T)):
            logits[b, T[b]:] = math.nan
            logits[b, :, U[b] + 1:] = math.inf
    else:
        logits = compact(logits, T, U)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    tol = dict(rtol=1e-5, atol=1e-5) if acc == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    max_u1 = targets.size(1) + 1
    c_layout = make_layout(logits, targets, T, U)
    g_layout = make_layout(logits.to(DEV), targets.to(DEV), T.to(DEV), U.to(DEV))
    assert c_layout.max_u1 == g_layout.max_u1 == max_u1
    cell = layout_cell_rows(c_layout)
    N = cell.numel()
    x2d = logits.view(N, V)
    g_targets = targets.to(DEV)

    for fls in (False, True):
        x = x2d.log_softmax(-1) if fls else x2d
        lp_c, den_c = cpu.log_probs(x, targets, c_layout, options(blank, fls))
        poison_allocator(((N, 2), acc), ((N,), acc))
        lp_g, den_g = cuda.log_probs(x.to(DEV), g_targets, g_layout, options(blank, fls))
        assert lp_g.dtype == acc and den_g.dtype == acc and lp_g.shape == (N, 2)
        assert_no_nan(lp_g, den_g)  # padding rows too: every entry is written
        torch.testing.assert_close(lp_g.cpu()[cell], lp_c[cell], **tol)
        torch.testing.assert_close(den_g.cpu()[cell], den_c[cell], **tol)

    x = x2d
    lp_c, den_c = cpu.log_probs(x, targets, c_layout, options(blank))
    alpha_c, beta_c, loss_c = cpu.alpha_beta(lp_c, c_layout, options(rna=rna))
    poison_allocator(((N,), acc), ((len(T),), acc))
    alpha_g, beta_g, loss_g = cuda.alpha_beta(lp_c.to(DEV), g_layout, options(rna=rna))
    assert_no_nan(alpha_g, beta_g, loss_g)
    alpha_g, beta_g = alpha_g.cpu(), beta_g.cpu()
    torch.testing.assert_close(loss_g.cpu(), loss_c, **tol)
    # equal on the cells an alignment passes through; RNA cells off the band (u > t or t - u > T-1-U)
    # are -inf here in both alpha and beta (the CPU twin leaves one of the two finite there)
    live = cell & torch.isfinite(beta_c) & torch.isfinite(alpha_c)
    torch.testing.assert_close(alpha_g[live], alpha_c[live], **tol)
    torch.testing.assert_close(beta_g[live], beta_c[live], **tol)
    if not rna:
        assert bool(live[cell].all())
    assert (alpha_g[cell & ~live] == -math.inf).all() and (beta_g[cell & ~live] == -math.inf).all()
    if padded:
        assert (alpha_g[~cell] == -math.inf).all() and (beta_g[~cell] == -math.inf).all()

    scale = torch.rand(len(T), generator=gen, dtype=acc) + 0.5
    scale[-1] = 0.0  # no gradient for this utterance
    loss_in = loss_c.clone()
    loss_in[1] = math.inf  # nor for this one
    for fls in (False, True):
        xin = x2d.log_softmax(-1) if fls else x2d
        lp_c, den_c = cpu.log_probs(xin, targets, c_layout, options(blank, fls))
        lattice_c = Lattice(c_layout, lp_c, den_c, alpha_c, beta_c, loss_in)
        o = options(blank, fls, rna)
        expected = cpu.gradient(xin, targets, lattice_c, scale, o, torch.empty_like(xin))
        lattice_g = Lattice(g_layout, *(a.to(DEV) for a in (lp_c, den_c, alpha_g, beta_g, loss_in)))
        xg = xin.to(DEV)
        out = torch.full_like(xg, math.nan)
        got = cuda.gradient(xg, g_targets, lattice_g, scale.to(DEV), o, out)
        assert got is out
        assert_no_nan(out)
        gtol = dict(rtol=1e-5, atol=3e-6) if acc == torch.float32 else dict(rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(out.cpu(), expected, **gtol)
        # in place: out is the logits themselves
        inplace = xg.clone()
        cuda.gradient(inplace, g_targets, lattice_g, scale.to(DEV), o, inplace)
        torch.testing.assert_close(inplace, out, rtol=0, atol=0)


@pytest.mark.parametrize("V", [7, 500])
def test_padded_rows_by_division_match_the_search(V):
    """In the padded layout the row kernels find a row's (b, t, u) by dividing by maxT * (maxU + 1) and maxU + 1
    (common.cuh's PaddedGrid, from the host's maxT): a tile of rows from row_start > 0, and a Layout without
    maxT (which the kernels search), give bit for bit what the whole call gives; RNN-T and TDT log-probs, the
    RNN-T gradient."""
    cuda = cuda_stages()
    gen = torch.Generator().manual_seed(31 + V)
    blank, D = 1, 3
    logits, targets, T, U = random_batch(gen, 5, 9, 4, V, blank, scale=2.0)
    logits = torch.cat([logits, torch.randn(logits.shape[:3] + (D,), generator=gen)], dim=-1)  # + D durations
    for b in range(len(T)):  # padding may hold anything: the kernels must not read it
        logits[b, T[b]:] = math.nan
        logits[b, :, U[b] + 1:] = math.inf
    logits, targets, T, U = (t.to(DEV) for t in (logits, targets, T, U))
    layout = make_layout(logits, targets, T, U, vocab_size=V)
    assert layout.padded and layout.padded_t == logits.size(1)
    N = logits.numel() // (V + D)
    rows = logits.view(N, V + D)
    x, tok, dur = rows[:, :V].contiguous(), rows[:, :V], rows[:, V:]
    o, o_tdt = options(blank), options(blank, sigma=0.05, durations=(0, 1, 2))
    lp, den = cuda.log_probs(x, targets, layout, o)
    alpha, beta, loss = cuda.alpha_beta(lp, layout, o)
    scale = torch.rand(len(T), generator=gen, dtype=torch.float64).to(DEV) + 0.5
    grad = cuda.gradient(x, targets, Lattice(layout, lp, den, alpha, beta, loss), scale, o, torch.empty_like(x))
    tdt = cuda.tdt_log_probs(tok, dur, targets, layout, o_tdt)
    assert torch.isfinite(loss).all() and grad.abs().sum() > 1.0
    searched = Layout(layout.table, True, layout.max_u1)  # maxT not given
    k = N // 3 + 1  # inside an utterance and a frame
    for lay, start in ((layout, k), (searched, 0), (searched, k)):
        out = (torch.full_like(lp, math.nan), torch.full_like(den, math.nan))
        cuda.log_probs(x[start:], targets, lay, o, row_start=start, out=out)
        assert torch.equal(out[0][start:], lp[start:]) and torch.equal(out[1][start:], den[start:])
        g = torch.full_like(x[start:], math.nan)
        cuda.gradient(x[start:], targets, Lattice(lay, lp, den, alpha, beta, loss), scale, o, g, row_start=start)
        assert torch.equal(g, grad[start:])
        out = tuple(torch.full_like(a, math.nan) for a in tdt)
        cuda.tdt_log_probs(tok[start:], dur[start:], targets, lay, o_tdt, row_start=start, out=out)
        for got, want in zip(out, tdt):
            assert torch.equal(got[start:], want[start:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("V", [33, 512])
def test_stages_half_match_cpu(dtype, V):
    cuda = cuda_stages()
    gen = torch.Generator().manual_seed(V)
    logits, targets, T, U = random_batch(gen, 3, 9, 5, V, 0, dtype=dtype)
    logits = compact(logits, T, U)
    layout_c = make_layout(logits, targets, T, U)
    layout_g = make_layout(logits.to(DEV), targets.to(DEV), T.to(DEV), U.to(DEV))
    lp_c, den_c = cpu.log_probs(logits, targets, layout_c, options())
    lp_g, den_g = cuda.log_probs(logits.to(DEV), targets.to(DEV), layout_g, options())
    assert lp_g.dtype == torch.float32
    torch.testing.assert_close(lp_g.cpu(), lp_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(den_g.cpu(), den_c, rtol=1e-5, atol=1e-5)
    alpha, beta, loss = cpu.alpha_beta(lp_c, layout_c, options())
    scale = torch.ones(len(T))
    expected = cpu.gradient(logits, targets, Lattice(layout_c, lp_c, den_c, alpha, beta, loss), scale, options(),
                            torch.empty_like(logits))
    out = torch.full_like(logits.to(DEV), math.nan)
    lattice_g = Lattice(layout_g, *(a.to(DEV) for a in (lp_c, den_c, alpha, beta, loss)))
    cuda.gradient(logits.to(DEV), targets.to(DEV), lattice_g, scale.to(DEV), options(), out)
    assert out.dtype == dtype
    # both sides round float32 values to `dtype` once: they may land one ulp apart
    ulp = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=ulp, atol=1e-6)


def test_stages_long_rows_and_int32_targets():
    """Row strides in the thousands (the in-kernel FastDivmod), int32 targets, one ragged batch.

    float64: with U = 3000 the log-likelihoods reach ~1e4, where float32 sums of alpha + loss + beta
    lose ~1e-3 relative, in a different order on each side."""
    cuda = cuda_stages()
    gen = torch.Generator().manual_seed(2)
    T, U, V = torch.tensor([3, 2, 5]), torch.tensor([3000, 1700, 4]), 12
    targets = torch.randint(1, V, (3, 3000), generator=gen, dtype=torch.int32)
    logits = torch.randn(int((T * (U + 1)).sum()), V, generator=gen, dtype=torch.float64)
    layout_c = make_layout(logits, targets, T, U)
    layout_g = make_layout(logits.to(DEV), targets.to(DEV), T.to(DEV), U.to(DEV))
    lp_c, den_c = cpu.log_probs(logits, targets, layout_c, options())
    lp_g, den_g = cuda.log_probs(logits.to(DEV), targets.to(DEV), layout_g, options())
    torch.testing.assert_close(lp_g.cpu(), lp_c, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(den_g.cpu(), den_c, rtol=1e-10, atol=1e-10)
    a, b, l = cpu.alpha_beta(lp_c, layout_c, options())
    a_g, b_g, l_g = cuda.alpha_beta(lp_c.to(DEV), layout_g, options())
    torch.testing.assert_close(l_g.cpu(), l, rtol=1e-10, atol=1e-10)
    scale = torch.rand(3, generator=gen, dtype=torch.float64) + 0.5
    want = cpu.gradient(logits, targets, Lattice(layout_c, lp_c, den_c, a, b, l), scale, options(),
                        torch.empty_like(logits))
    got = cuda.gradient(logits.to(DEV), targets.to(DEV), Lattice(layout_g, *(x.to(DEV) for x in (lp_c, den_c, a, b, l))),
                        scale.to(DEV), options(), torch.full_like(logits.to(DEV), math.nan))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-8, atol=1e-12)


def test_alpha_beta_long_targets_use_global_memory_path():
    """U + 1 above 1024 threads (loop over u) and above the shared-memory cap (previous step in global memory)."""
    cuda = cuda_stages()
    gen = torch.Generator().manual_seed(1)
    for rna, T, U in ((False, 3, 6200), (True, 3200, 3100), (False, 5, 1500)):
        N = T * (U + 1)
        lp = torch.randn(N, 2, generator=gen, dtype=torch.float64) * 0.1 - 2
        Tt, Ut = torch.tensor([T]), torch.tensor([U])
        layout_c = cpu.layout(Tt, Ut, U + 1)
        layout_g = cuda.layout(Tt.to(DEV), Ut.to(DEV), U + 1)
        cell = layout_cell_rows(layout_c)
        u = cpu._coordinates(layout_c)[2]
        lp[u == U, 1] = -math.inf
        a_c, b_c, l_c = cpu.alpha_beta(lp, layout_c, options(rna=rna))
        a_g, b_g, l_g = cuda.alpha_beta(lp.to(DEV), layout_g, options(rna=rna))
        torch.testing.assert_close(l_g.cpu(), l_c, rtol=1e-10, atol=1e-10)
        live = cell & torch.isfinite(b_c) & torch.isfinite(a_c)
        torch.testing.assert_close(b_g.cpu()[live], b_c[live], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(a_g.cpu()[live], a_c[live], rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------------- public API


# The oracle is the float64 reference. torchaudio 2.11's CUDA rnnt_loss returns 0 for an utterance with
# T_b == 1 or U_b == 0 inside a larger batch (its CPU path is right; README: "torchaudio's CUDA loss"), so it
# is only a second witness, on the other utterances. Every batch here has such utterances.
TA_CASES = [  # B, max_t, max_u, V, blank, reduction
    (4, 30, 10, 1024, 0, "none"),
    (8, 50, 20, 500, 0, "mean"),
    (3, 8, 4, 8192, 5, "sum"),
    (3, 2, 3, 17, 16, "none"),     # T <= 2
    (5, 12, 6, 4096, 4095, "mean"),
    (6, 20, 1, 2, 1, "none"),      # V = 2
    (3, 40, 15, 1000, 3, "sum"),   # V * 4 not a multiple of 16: narrower accesses
]


@pytest.mark.parametrize("case", range(len(TA_CASES)))
def test_matches_reference_and_torchaudio(case):
    B, max_t, max_u, V, blank, reduction = TA_CASES[case]
    gen = torch.Generator().manual_seed(200 + case)
    logits, targets, T, U = random_batch(gen, B, max_t, max_u, V, blank, scale=3.0)
    T[1], U[2] = 1, 0
    weights = torch.rand(B, generator=gen, dtype=torch.float64) + 0.5
    ref_in = logits.double().requires_grad_()
    ref = transducer_loss_reference(ref_in, targets, T, U, blank)
    (ref * weights).sum().backward()
    ref = ref.detach()

    logits, targets, T, U = logits.to(DEV), targets.to(DEV), T.to(DEV), U.to(DEV)
    for layout in ("compact", "padded"):
        x = (compact(logits, T, U) if layout == "compact" else logits).clone().requires_grad_()
        got = transducer_loss(x, targets, T, U, blank=blank, reduction="none")
        torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=1e-5)
        (got * weights.float().to(DEV)).sum().backward()
        want = ref_in.grad.float().to(DEV)
        # float32 sums alpha + beta + loss of magnitude |loss| in the exponent: absolute error ~ |loss| ulp
        atol = 1e-6 * max(1.0, float(ref.abs().max()))
        torch.testing.assert_close(x.grad, compact(want, T, U) if layout == "compact" else want, rtol=1e-4,
                                   atol=atol)
        reduced = transducer_loss(x.detach(), targets, T, U, blank=blank, reduction=reduction)
        want = {"none": ref, "sum": ref.sum(), "mean": ref.mean()}[reduction]
        torch.testing.assert_close(reduced.cpu().double(), want, rtol=1e-5, atol=1e-5)

    # the second witness, where it is right
    ta = require("torchaudio.functional", "test")
    ta_loss = ta.rnnt_loss(logits, targets[:, :int(U.max())].int().contiguous(), T.int(), U.int(), blank=blank,
                           reduction="none")
    right = ((T >= 2) & (U >= 1)).cpu()
    torch.testing.assert_close(ta_loss.cpu().double()[right], ref[right], rtol=1e-5, atol=1e-5)


def test_matches_torchaudio_without_fused_log_softmax():
    ta = require("torchaudio.functional", "test")
    gen = torch.Generator().manual_seed(5)
    logits, targets, T, U = random_batch(gen, 4, 10, 5, 300, blank=0, min_t=2, min_u=1)
    log_probs = logits.log_softmax(-1).to(DEV)
    targets, T, U = targets.to(DEV), T.to(DEV), U.to(DEV)
    ta_in = log_probs.clone().requires_grad_()
    expected = ta.rnnt_loss(ta_in, targets[:, :int(U.max())].int().contiguous(), T.int(), U.int(), blank=0,
                            reduction="sum", fused_log_softmax=False)
    expected.backward()
    ours = log_probs.clone().requires_grad_()
    got = transducer_loss(ours, targets, T, U, reduction="sum", from_log_softmax=True)
    got.backward()
    ref = transducer_loss_reference(log_probs.double().cpu(), targets.cpu(), T.cpu(), U.cpu(), from_log_softmax=True)
    torch.testing.assert_close(got.cpu().double(), ref.sum(), rtol=1e-5, atol=0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    for b in range(len(T)):
        torch.testing.assert_close(ours.grad[b, :T[b], :U[b] + 1], ta_in.grad[b, :T[b], :U[b] + 1],
                                   rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("V", [37, 8197, 16381])
def test_gradient_into_rows_of_another_stride(V):
    """The RNN-T and TDT gradient stages writing bf16 rows 16 bytes aligned from logits rows at every 2-byte
    offset: staged through shared memory (common.cuh's RowOut; a warp a row at V = 37, a block a row at
    8197, at the launcher's staging limit at 16381), the same values bit for bit as into rows laid out as
    the logits'."""
    cuda = cuda_stages()
    gen = torch.Generator().manual_seed(V)
    D, durations, blank = 4, [0, 1, 2, 3], V // 3  # V + D odd: the logits' rows start at every 2-byte offset
    logits, _, T, U = random_batch(gen, 3, 4, 2, V + D, blank, scale=2.0)
    T[1], U[2] = 1, 0
    targets = torch.randint(0, V - 1, (3, 2), generator=gen)
    targets += targets >= blank  # token labels other than blank
    x = compact(logits, T, U).to(torch.bfloat16).to(DEV)
    targets, T, U = targets.to(DEV), T.to(DEV), U.to(DEV)
    layout = make_layout(x, targets, T, U, blank, vocab_size=V)
    N, wide = x.size(0), -(-V // 8) * 8
    scale = (torch.rand(3, generator=gen) + 0.5).to(DEV)

    def outs():
        same = torch.full((N, V + D), math.nan, dtype=x.dtype, device=DEV)
        return same, torch.full((N, wide), math.nan, dtype=x.dtype, device=DEV)[:, :V]

    rows = x[:, :V]  # RNN-T over the first V columns (rows V + D apart)
    o = options(blank)
    lp, den = cuda.log_probs(rows, targets, layout, o)
    alpha, beta, loss = cuda.alpha_beta(lp, layout, o)
    same, staged = outs()
    wpr = cuda._warps_per_row(N, V * 2, x.device)
    assert cuda._row_access(2, V, rows, [staged], 8 // wpr) == (8, False, True)
    for out in (same[:, :V], staged):
        cuda.gradient(rows, targets, Lattice(layout, lp, den, alpha, beta, loss), scale, o, out)
    assert_no_nan(staged)
    assert bool((staged == same[:, :V]).all()) and staged.abs().max() > 0

    tokens, durs = x[:, :V], x[:, V:]
    o = options(blank, durations=tuple(durations))
    lp, lp_dur, den = cuda.tdt_log_probs(tokens, durs, targets, layout, o)
    alpha, beta, loss = cuda.tdt_alpha_beta(lp, lp_dur, layout, o)
    same, staged = outs()
    out_durs = torch.empty(N, D, dtype=x.dtype, device=DEV)
    for out in (same[:, :V], staged):
        cuda.tdt_gradient(tokens, durs, targets, Lattice(layout, lp, den, alpha, beta, loss, lp_dur), scale, o, out,
                          out_durs)
    assert_no_nan(staged)
    assert bool((staged == same[:, :V]).all()) and staged.abs().max() > 0


@pytest.mark.parametrize("from_log_softmax", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_off_a_16_byte_boundary(from_log_softmax, dtype):
    # contiguous logits one element past an aligned address: the gradient (a new, aligned tensor) lies
    # at another offset from a 16-byte boundary than the logits; with from_log_softmax the gradient
    # kernel reads no logits and lays its row pass on the gradient alone (transducer.cuda.gradient)
    gen = torch.Generator().manual_seed(71 + from_log_softmax)
    logits, targets, T, U = random_batch(gen, 4, 12, 5, 500, blank=3, scale=3.0)
    T[1], U[2] = 1, 0
    if from_log_softmax:
        logits = logits.log_softmax(-1)
    logits = logits.to(dtype)
    ref_in = logits.double().requires_grad_()
    ref = transducer_loss_reference(ref_in, targets, T, U, blank=3, from_log_softmax=from_log_softmax)
    ref.sum().backward()
    ref = ref.detach()
    logits = compact(logits, T, U)
    buf = torch.empty(logits.numel() + 1, dtype=dtype, device=DEV)
    x = buf[1:].view(logits.shape)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    x.copy_(logits.to(DEV)).requires_grad_()
    got = transducer_loss(x, *(a.to(DEV) for a in (targets, T, U)), blank=3, reduction="none",
                          from_log_softmax=from_log_softmax)
    got.sum().backward()
    # float32: absolute error ~ |loss| ulp (as above); bf16: the gradient is rounded to 8 bits
    atol = 1e-6 * max(1.0, float(ref.abs().max())) if dtype == torch.float32 else 1e-2
    rtol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(x.grad.cpu().double(), compact(ref_in.grad, T, U), rtol=rtol, atol=atol)


@pytest.mark.parametrize("layout", ["compact", "padded"])
@pytest.mark.parametrize("rna", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_gradcheck_float64(layout, rna, reduction):
    gen = torch.Generator().manual_seed(len(layout) + 10 * rna + len(reduction))
    logits, targets, T, U = random_batch(gen, 3, 5, 3, 4, blank=2, dtype=torch.float64, rna=rna)
    if layout == "compact":
        logits = compact(logits, T, U)
    logits = logits.to(DEV).requires_grad_()
    targets, T, U = targets.to(DEV), T.to(DEV), U.to(DEV)
    assert torch.autograd.gradcheck(
        lambda x: transducer_loss(x, targets, T, U, blank=2, reduction=reduction, one_sym_per_frame=rna),
        (logits,), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_matches_reference_float64(seed):
    """Loss and gradient against the autograd reference: RNN-T and RNA, compact and padded, ragged, U = 0, T = 1."""
    gen = torch.Generator().manual_seed(300 + seed)
    rna = seed % 2 == 1
    B, max_t, max_u, V = ((4, 7, 4, 9), (3, 8, 3, 6), (2, 1, 0, 5), (3, 6, 0, 11), (5, 4, 3, 7), (1, 1, 2, 4))[seed]
    blank = seed % V
    logits, targets, T, U = random_batch(gen, B, max_t, max_u, V, blank, dtype=torch.float64, rna=rna)
    reduction = ("none", "sum", "mean")[seed % 3]
    ref_in = logits.clone().requires_grad_()  # the reference runs on the CPU (it is device-agnostic)
    losses = transducer_loss_reference(ref_in, targets, T, U, blank, one_sym_per_frame=rna)
    weights = torch.arange(B, dtype=torch.float64) + 1.0
    (losses * weights).sum().backward()
    expected = losses if reduction == "none" else (losses.sum() if reduction == "sum" else losses.mean())
    logits, targets, T, U, weights = logits.to(DEV), targets.to(DEV), T.to(DEV), U.to(DEV), weights.to(DEV)
    for layout in ("padded", "compact"):
        x = (logits if layout == "padded" else compact(logits, T, U)).clone().requires_grad_()
        got = transducer_loss(x, targets, T, U, blank=blank, reduction="none", one_sym_per_frame=rna)
        torch.testing.assert_close(got.cpu(), losses.detach(), rtol=1e-10, atol=1e-10)
        (got * weights).sum().backward()
        want = ref_in.grad if layout == "padded" else compact(ref_in.grad, T.cpu(), U.cpu())
        torch.testing.assert_close(x.grad.cpu(), want, rtol=1e-9, atol=1e-10)
        red = transducer_loss(x.detach(), targets, T, U, blank=blank, reduction=reduction, one_sym_per_frame=rna)
        torch.testing.assert_close(red.cpu(), expected.detach(), rtol=1e-10, atol=1e-10)


def test_more_than_2_31_elements():
    """Compact fp16 logits of more than 2^31 elements (about 4.3 GB): the rows past element 2^31 are right."""
    V, T0, U0, B = 8192, 50, 20, 252
    rows_per = T0 * (U0 + 1)
    N = B * rows_per
    assert N * V > 2 ** 31
    straddle = (2 ** 31) // V // rows_per  # the utterance whose rows cross element 2^31
    assert straddle < B - 1
    torch.cuda.empty_cache()
    gen = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randn(N, V, generator=gen, device=DEV, dtype=torch.float16).requires_grad_()
    targets = torch.randint(1, V, (B, U0), generator=gen, device=DEV)
    T = torch.full((B,), T0, device=DEV)
    U = torch.full((B,), U0, device=DEV)
    weights = torch.rand(B, generator=gen, device=DEV) + 0.5
    losses = transducer_loss(logits, targets, T, U, reduction="none")
    (losses * weights).sum().backward()
    grad = logits.grad
    for b in (straddle - 1, straddle, B - 1):
        rows = logits.detach()[b * rows_per:(b + 1) * rows_per].cpu().double().requires_grad_()
        ref = transducer_loss(rows, targets[b:b + 1].cpu(), T[b:b + 1].cpu(), U[b:b + 1].cpu(), reduction="sum")
        (ref * weights[b].cpu().double()).backward()
        torch.testing.assert_close(losses[b].double().cpu(), ref.detach(), rtol=1e-5, atol=0)
        torch.testing.assert_close(grad[b * rows_per:(b + 1) * rows_per].float().cpu(), rows.grad.float(),
                                   rtol=2.0 ** -10, atol=1e-6)
    assert torch.isfinite(losses).all()
    del logits, grad
    torch.cuda.empty_cache()


def test_cuda_graph_training_step():
    gen = torch.Generator().manual_seed(21)
    B, max_t, max_u, V, D = 4, 20, 8, 64, 32
    T = torch.randint(1, max_t + 1, (B,), generator=gen)
    U = torch.randint(0, max_u + 1, (B,), generator=gen)
    N = int((T * (U + 1)).sum())
    x = torch.randn(N, D, generator=gen).to(DEV)
    W = torch.nn.Parameter(torch.randn(D, V, generator=gen).to(DEV) * 0.3)
    targets = torch.randint(1, V, (B, max_u), generator=gen).to(DEV)
    Tg, Ug = T.to(DEV), U.to(DEV)
    loss_fn = TransducerLoss(blank=0, reduction="mean", check_inputs=False)

    def step():
        loss = loss_fn(x @ W, targets, Tg, Ug)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compile and load every kernel outside the capture
        for _ in range(2):
            W.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    W.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    static_grad = W.grad

    for trial in range(3):
        perm = torch.randperm(B, generator=gen)  # same number of rows, different layout
        x.copy_(torch.randn(N, D, generator=gen).to(DEV))
        targets.copy_(torch.randint(1, V, (B, max_u), generator=gen).to(DEV))
        Tg.copy_(T[perm].to(DEV))
        Ug.copy_(U[perm].to(DEV))
        graph.replay()
        torch.cuda.synchronize()
        W2 = W.detach().clone().requires_grad_()
        eager = TransducerLoss(blank=0, reduction="mean")(x @ W2, targets, Tg, Ug)
        eager.backward()
        torch.testing.assert_close(static_loss, eager, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(static_grad, W2.grad, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------- pack


@pytest.mark.parametrize("dtype,D", [(torch.float32, 48), (torch.float32, 33), (torch.float16, 64),
                                     (torch.bfloat16, 40), (torch.float64, 20)])
def test_pack_matches_cpu(dtype, D):
    cuda = cuda_stages()
    gen = torch.Generator().manual_seed(D)
    B, max_t, max_u1 = 5, 9, 6
    T = torch.tensor([9, 1, 4, 7, 3])
    U = torch.tensor([5, 0, 2, 3, 5])
    enc = torch.randn(B, max_t, D, generator=gen, dtype=torch.float64).to(dtype)
    pred = torch.randn(B, max_u1, D, generator=gen, dtype=torch.float64).to(dtype)
    N = int((T * (U + 1)).sum())
    layout_c, layout_g = cpu.layout(T, U, max_u1), cuda.layout(T.to(DEV), U.to(DEV), max_u1)
    tol = dict(rtol=0, atol=0) if dtype in (torch.float32, torch.float64) else {}

    want = cpu.pack_forward(enc.double(), pred.double(), layout_c, N).to(dtype)
    poison_allocator(((N, D), dtype))
    got = cuda.pack_forward(enc.to(DEV), pred.to(DEV), layout_g, N)
    assert_no_nan(got)
    torch.testing.assert_close(got.cpu(), want, **tol)

    grad_out = torch.randn(N, D, generator=gen, dtype=torch.float64).to(dtype)
    want_e, want_p = cpu.pack_backward(grad_out.double(), layout_c, max_t, max_u1)
    poison_allocator(((B, max_t, D), dtype), ((B, max_u1, D), dtype))
    got_e, got_p = cuda.pack_backward(grad_out.to(DEV), layout_g, max_t, max_u1)
    assert_no_nan(got_e, got_p)
    gtol = dict(rtol=1e-6, atol=1e-6) if dtype in (torch.float32, torch.float64) else {}
    torch.testing.assert_close(got_e.cpu(), want_e.to(dtype), **gtol)
    torch.testing.assert_close(got_p.cpu(), want_p.to(dtype), **gtol)

    if dtype == torch.float64:  # the public op: values and gradients through autograd
        e, p = enc.to(DEV).requires_grad_(), pred.to(DEV).requires_grad_()
        assert torch.autograd.gradcheck(lambda a, b: pack(a, b, T.to(DEV), U.to(DEV)), (e, p))


@pytest.mark.parametrize("itype", [torch.int32, torch.int64])
def test_layout_matches_cpu(itype):
    """The layout kernel's table (lengths, strides, row_splits, stats) equals the CPU one, values out of
    range included, for batches of one utterance up to several per thread of the block."""
    cuda = cuda_stages()
    gen = torch.Generator().manual_seed(77)
    for B, S, V in [(1, 0, 5), (7, 9, 30), (300, 40, 500), (2500, 3, 50)]:
        T = torch.randint(-1, 50, (B,), generator=gen).to(itype)
        U = torch.randint(-1, S + 3, (B,), generator=gen).to(torch.int64 if itype == torch.int32 else torch.int32)
        targets = torch.randint(-2, V + 2, (B, S), generator=gen).to(itype)
        for padded_t in (0, 51):
            for stats in (True, False):
                want = cpu.layout(T, U, S + 3, padded_t, targets, V, 3, stats)
                got = cuda.layout(T.to(DEV), U.to(DEV), S + 3, padded_t, targets.to(DEV), V, 3, stats)
                assert (got.padded, got.max_u1, got.batch_size) == (want.padded, want.max_u1, B)
                n = got.table.numel() - (0 if stats else 6)
                assert got.table.cpu()[:n].tolist() == want.table[:n].tolist()
    empty = cuda.layout(torch.zeros(0, dtype=itype, device=DEV), torch.zeros(0, dtype=itype, device=DEV), 1)
    assert empty.table.tolist() == cpu.layout(torch.zeros(0, dtype=itype), torch.zeros(0, dtype=itype), 1).table.tolist()


def test_bad_values_raise_on_cuda():
    logits = torch.randn(2 * 3 + 4, 5, device=DEV)
    targets = torch.tensor([[1, 2], [3, 4]], device=DEV)
    T, U = torch.tensor([2, 4], device=DEV), torch.tensor([2, 0], device=DEV)
    with pytest.raises(ValueError, match="targets: 1 entries"):
        transducer_loss(logits, torch.tensor([[1, 0], [3, 4]], device=DEV), T, U)
    with pytest.raises(ValueError, match="logits: compact logits must have sum_b"):
        transducer_loss(logits[:-1], targets, T, U)
    with pytest.raises(ValueError, match="logit_lengths: every T_b must be >= 1"):
        transducer_loss(logits, targets, torch.tensor([0, 4], device=DEV), U)
    with pytest.raises(ValueError, match="targets: expected a tensor on cuda"):
        transducer_loss(logits, targets.cpu(), T, U)


def test_bad_values_leave_the_device_healthy():
    """The checks run while log_probs is already queued: wild lengths and labels must raise, with no
    out-of-bounds access (a fault would poison the context and show at the synchronisations below)."""
    gen = torch.Generator().manual_seed(5)
    logits, targets, T, U = random_batch(gen, 3, 6, 4, 9, 0)
    logits = compact(logits, T, U).to(DEV)
    targets, T, U = targets.to(DEV), T.to(DEV), U.to(DEV)
    wild = [
        ("logit_lengths", dict(T=torch.tensor([10**6, -5, 3], device=DEV))),
        ("target_lengths", dict(U=torch.tensor([10**6, 2, -7], device=DEV))),
        ("targets", dict(targets=targets.clone().fill_(10**9))),
        ("targets", dict(targets=targets.clone().fill_(-10**9))),
        ("logits", dict(T=T * 1000)),
    ]
    for name, change in wild:
        args = {**dict(logits=logits, targets=targets, T=T, U=U), **change}
        with pytest.raises(ValueError, match=name):
            transducer_loss(args["logits"], args["targets"], args["T"], args["U"])
        torch.cuda.synchronize()
    x = logits.clone().requires_grad_()
    transducer_loss(x, targets, T, U).backward()
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all()


# ----------------------------------------------------------------------------------------------- bf16 before sm_80


def test_bf16_software_rounding_before_sm80():
    """GPUs before sm_80 have no cvt.rn.bf16.f32: ops/numeric.cuh rounds in integer arithmetic there
    (tests/test_kernels_compile.py checks which PTX each architecture gets). Here the software rounding,
    forced on this GPU, against torch's."""
    import cupy as cp

    import ops
    code = """#define OPS_SOFTWARE_BF16
#include "ops/numeric.cuh"
extern "C" __global__ void to_bf16(const float* x, unsigned short* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = ops::from_acc<ops::bf16_t>(x[i]).bits;
}"""
    fn = cp.RawModule(code=code, options=("-std=c++17", f"-I{ops.cuda_include_dir()}")).get_function("to_bf16")
    gen = torch.Generator().manual_seed(46)
    x = torch.cat([torch.randn(1 << 16, generator=gen) * 10.0 ** torch.randint(-40, 39, (1 << 16,), generator=gen),
                   torch.randint(0, 2**31 - 1, (1 << 16,), generator=gen, dtype=torch.int32).view(torch.float32),
                   torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 3.3895e38, 1e-45])]).to(DEV)
    y = torch.empty(x.shape, dtype=torch.int16, device=DEV)
    torch.cuda.synchronize()
    fn(((x.numel() + 255) // 256,), (256,), (x.data_ptr(), y.data_ptr(), np.int32(x.numel())))
    torch.cuda.synchronize()
    got = y.view(torch.bfloat16).float()
    want = x.to(torch.bfloat16).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], want[~nan])
