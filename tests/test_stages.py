"""The stages (transducer.cpu.stages and transducer.cuda.stages: twins of one contract, transducer/backend.py's Stages):
the RNN-T and RNA stages of CUDA against the CPU twin, bit for bit where they must be; the TDT stages of every
device against the float64 reference; layout, pack and the tile arguments the fused loss uses, on both devices."""

import bisect
import inspect
import itertools
import math

import pytest
import torch
from _batches import DEVICES, cell_mask, compact, random_batch, random_targets, to_device

from transducer import pack, tdt_loss_reference
from transducer.backend import Stages, stages_for
from transducer.cpu import stages as cpu
from transducer.cuda import stages as cuda
from transducer.custom_ops import make_layout
from transducer.joiner import ACTIVATIONS, Dropout, dropout_mask
from transducer.lattices import Lattice
from transducer.layout import NUM_STATS, LabelCheck, Layout, Stats
from transducer.options import LossOptions


def test_both_backends_implement_the_stage_contract():
    """transducer.cpu.stages and transducer.cuda.stages each have every stage of backend.Stages, with its parameters, in its
    order, with its defaults."""
    stages = [name for name, f in vars(Stages).items() if inspect.isfunction(f) and not name.startswith("_")]
    assert "tdt_gradient" in stages and "pack_backward_add" in stages
    for name in stages:
        want = [(p.name, p.default) for p in inspect.signature(getattr(Stages, name)).parameters.values()][1:]
        for module in (cpu, cuda):
            got = [(p.name, p.default) for p in inspect.signature(getattr(module, name)).parameters.values()]
            assert got == want, f"{module.__name__}.{name}"


DEV = "cuda"


def poison_allocator(*shapes_dtypes, copies=4):
    """Hand blocks full of NaN back to torch's caching allocator, sized like the outputs a stage allocates,
    so that its torch.empty outputs most likely start as NaN (unwritten entries then show)."""
    blocks = [
        torch.full(shape, math.nan, dtype=dtype, device=DEV) for shape, dtype in shapes_dtypes for _ in range(copies)
    ]
    torch.cuda.synchronize()
    del blocks


def options(blank=0, from_log_softmax=False, rna=False, **more):
    return LossOptions(blank=blank, from_log_softmax=from_log_softmax, one_sym_per_frame=rna, **more)


def assert_no_nan(*tensors):
    for t in tensors:
        assert not torch.isnan(t).any(), "an entry was left unwritten (NaN poison) or computed as NaN"


# ---------------------------------------------------------------------------------------------------------
# RNN-T and RNA: CUDA against the CPU twin


STAGE_CASES = [
    (V, padded, rna, dtype)
    for V in (7, 500, 8192)
    for padded in (False, True)
    for rna in (False, True)
    for dtype in (torch.float32, torch.float64)
]


@pytest.mark.cuda
@pytest.mark.parametrize("V,padded,rna,dtype", STAGE_CASES)
def test_stages_match_cpu(V, padded, rna, dtype):
    gen = torch.Generator().manual_seed(V + 10 * padded + 100 * rna + (dtype == torch.float64))
    blank = (0, V // 2, V - 1)[V % 3]
    logits, targets, T, U = random_batch(gen, 4, 12, 6, V, blank, dtype=dtype, rna=rna, scale=2.0)
    if padded:  # padding may hold anything; the stages must not read it
        for b in range(len(T)):
            logits[b, T[b] :] = math.nan
            logits[b, :, U[b] + 1 :] = math.inf
    else:
        logits = compact(logits, T, U)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    tol = dict(rtol=1e-5, atol=1e-5) if acc == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    max_u1 = targets.size(1) + 1
    c_layout = make_layout(logits, targets, T, U)
    g_layout = make_layout(logits.to(DEV), targets.to(DEV), T.to(DEV), U.to(DEV))
    assert c_layout.max_u1 == g_layout.max_u1 == max_u1
    # the rows that are cells (not padding), from the lengths
    cell = cell_mask(logits, T, U).reshape(-1) if padded else torch.ones(logits.size(0), dtype=torch.bool)
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


@pytest.mark.cuda
@pytest.mark.parametrize("V", [7, 500])
def test_padded_rows_by_division_match_the_search(V):
    """In the padded layout the row kernels find a row's (b, t, u) by dividing by maxT * (maxU + 1) and maxU + 1
    (layout.cuh's PaddedGrid, from the host's maxT): a tile of rows from row_start > 0, and a Layout without
    maxT (which the kernels search), give bit for bit what the whole call gives; RNN-T and TDT log-probs, the
    RNN-T gradient."""
    gen = torch.Generator().manual_seed(31 + V)
    blank, D = 1, 3
    logits, targets, T, U = random_batch(gen, 5, 9, 4, V, blank, dtype=torch.float32, scale=2.0, extra=D)
    for b in range(len(T)):  # padding may hold anything: the kernels must not read it
        logits[b, T[b] :] = math.nan
        logits[b, :, U[b] + 1 :] = math.inf
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


ROW_GEOMETRY_CASES = [  # V, the rows' width, dtype, padded, big blanks
    (7, 7, torch.float32, True, 0),
    (64, 64, torch.float16, False, 0),  # aligned rows
    (500, 500, torch.bfloat16, False, 0),  # rows 1000 bytes apart: the unaligned pass's head and tail scalars
    (500, 512, torch.bfloat16, True, 0),  # the fused loss's tiles: 500 columns of 512-wide rows
    (37, 37, torch.float32, False, 3),
    (300, 300, torch.bfloat16, True, 15),  # 15 big blanks: log-probs' lanes 1 ... 15 of the row
    (64, 64, torch.float16, False, 8),  # aligned rows, 8 big blanks: log-probs needs 9 lanes (16), the gradient 8
    (64, 64, torch.float16, False, 9),  # and 9: the gradient needs 9 lanes (16)
]


@pytest.mark.cuda
@pytest.mark.parametrize("tpr", [8, 16, 32, cuda.THREADS])
@pytest.mark.parametrize("V, width, dtype, padded, big", ROW_GEOMETRY_CASES)
def test_row_kernels_match_cpu_in_every_row_geometry(monkeypatch, tpr, V, width, dtype, padded, big):
    """log_probs (multiblank_log_probs with big blanks) and gradient with each row geometry forced (row_pass.cuh's
    RowGeometry: 8, 16 or 32 lanes or a block a row; more where the pass needs them, stages._row_pass) give the CPU
    twin's values, every entry written: rows of several utterances share a warp, padding rows among them (NaN and
    inf, which must not be read) leave early while their warp's other rows merge."""
    monkeypatch.setattr(cuda, "threads_per_row", lambda rows, row_bytes, device, bytes_per_lane=0: tpr)
    gen = torch.Generator().manual_seed(V + tpr + big)
    durations = tuple(range(2, 2 + big))
    logits, targets, T, U = random_batch(gen, 5, 7, 4, V - big, V - big - 1, dtype=torch.float32, scale=2.0, extra=big)
    if padded:
        for b in range(len(T)):
            logits[b, T[b] :] = math.nan
            logits[b, :, U[b] + 1 :] = math.inf
        cell = cell_mask(logits, T, U).reshape(-1)
    else:
        logits = compact(logits, T, U)
        cell = torch.ones(logits.numel() // V, dtype=torch.bool)
    N = cell.numel()
    wide = torch.full((N, width), math.nan)
    wide[:, :V] = logits.reshape(N, V)
    x = wide.to(dtype)[:, :V]
    o = options(V - 1, big_blank_durations=durations) if big else options(V - 1)
    c_layout = make_layout(logits, targets, T, U)
    g_layout = make_layout(*(t.to(DEV) for t in (logits, targets, T, U)))
    log_probs = (lambda s: s.multiblank_log_probs) if big else (lambda s: s.log_probs)
    want = log_probs(cpu)(x, targets, c_layout, o)
    poison_allocator(((N, 2), torch.float32), ((N,), torch.float32), ((N, max(big, 1)), torch.float32))
    got = log_probs(cuda)(x.to(DEV), targets.to(DEV), g_layout, o)
    assert_no_nan(*got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu()[cell], w[cell], rtol=1e-5, atol=1e-5)
    walks = cpu.multiblank_alpha_beta(want[0], want[2], c_layout, o) if big else cpu.alpha_beta(want[0], c_layout, o)
    scale = torch.rand(len(T), generator=gen) + 0.5
    scale[2] = 0.0  # no gradient for this utterance
    lattice = Lattice(c_layout, want[0], want[1], *walks, lp_arcs=want[2] if big else None)
    expected = cpu.gradient(x, targets, lattice, scale, o, torch.empty_like(x))
    lattice_g = Lattice(g_layout, *(a.to(DEV) if a is not None else None for a in lattice[1:]))
    out = torch.full((N, width), math.nan, dtype=dtype, device=DEV)[:, :V]
    cuda.gradient(x.to(DEV), targets.to(DEV), lattice_g, scale.to(DEV), o, out)
    assert_no_nan(out)
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=ulp, atol=1e-6)
    assert expected.abs().max() > 0.01


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("V", [33, 512])
def test_stages_half_match_cpu(dtype, V):
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
    expected = cpu.gradient(
        logits, targets, Lattice(layout_c, lp_c, den_c, alpha, beta, loss), scale, options(), torch.empty_like(logits)
    )
    out = torch.full_like(logits.to(DEV), math.nan)
    lattice_g = Lattice(layout_g, *(a.to(DEV) for a in (lp_c, den_c, alpha, beta, loss)))
    cuda.gradient(logits.to(DEV), targets.to(DEV), lattice_g, scale.to(DEV), options(), out)
    assert out.dtype == dtype
    # both sides round float32 values to `dtype` once: they may land one ulp apart
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=ulp, atol=1e-6)


@pytest.mark.cuda
def test_stages_long_rows_and_int32_targets():
    """Row strides in the thousands (the in-kernel FastDivmod), int32 targets, one ragged batch.

    float64: with U = 3000 the log-likelihoods reach ~1e4, where float32 sums of alpha + loss + beta
    lose ~1e-3 relative, in a different order on each side."""
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
    want = cpu.gradient(
        logits, targets, Lattice(layout_c, lp_c, den_c, a, b, l), scale, options(), torch.empty_like(logits)
    )
    got = cuda.gradient(
        logits.to(DEV),
        targets.to(DEV),
        Lattice(layout_g, *(x.to(DEV) for x in (lp_c, den_c, a, b, l))),
        scale.to(DEV),
        options(),
        torch.full_like(logits.to(DEV), math.nan),
    )
    torch.testing.assert_close(got.cpu(), want, rtol=1e-8, atol=1e-12)


@pytest.mark.cuda
def test_alpha_beta_long_targets_use_global_memory_path():
    """U + 1 above 1024 threads (a loop over u), the previous step in shared memory while the batch's longest fits
    (U = 1500) and else in global memory (U = 6200 and 3100 in fp64), alone and beside utterances of U + 1 <= 1024
    (a block's buffers of 1024 u's: U = 1023 fills them, U = 1024 is the first past them), T_b = 1 and U_b = 0 among
    them."""
    gen = torch.Generator().manual_seed(1)
    cases = (
        (False, [3], [6200]),
        (True, [3200], [3100]),
        (False, [5], [1500]),
        (False, [3, 3, 1, 7, 2], [6200, 1023, 0, 200, 1024]),
        (True, [3200, 30, 6, 1], [3100, 20, 5, 0]),
    )
    for rna, T, U in cases:
        u = torch.cat([torch.arange(t * (v + 1)) % (v + 1) for t, v in zip(T, U)])
        last = torch.cat([torch.full((t * (v + 1),), v) for t, v in zip(T, U)])
        lp = torch.randn(len(u), 2, generator=gen, dtype=torch.float64) * 0.1 - 2
        lp[u == last, 1] = -math.inf
        Tt, Ut = torch.tensor(T), torch.tensor(U)
        layout_c = cpu.layout(Tt, Ut, max(U) + 1)
        layout_g = cuda.layout(Tt.to(DEV), Ut.to(DEV), max(U) + 1)
        a_c, b_c, l_c = cpu.alpha_beta(lp, layout_c, options(rna=rna))
        a_g, b_g, l_g = cuda.alpha_beta(lp.to(DEV), layout_g, options(rna=rna))
        torch.testing.assert_close(l_g.cpu(), l_c, rtol=1e-10, atol=1e-10)
        assert torch.isfinite(l_c).all()
        live = torch.isfinite(b_c) & torch.isfinite(a_c)  # compact: every row is a cell
        torch.testing.assert_close(b_g.cpu()[live], b_c[live], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(a_g.cpu()[live], a_c[live], rtol=1e-10, atol=1e-10)


@pytest.mark.cuda
@pytest.mark.parametrize("V", [37, 8197, 16381])
def test_gradient_into_rows_of_another_stride(V):
    """The RNN-T and TDT gradient stages writing bf16 rows 16 bytes aligned from logits rows at every 2-byte
    offset: staged through shared memory (row_pass.cuh's RowOut; a warp a row at V = 37, a block a row at
    8197, at the launcher's staging limit at 16381), the same values bit for bit as into rows laid out as
    the logits'."""
    gen = torch.Generator().manual_seed(V)
    D, durations, blank = 4, [0, 1, 2, 3], V // 3  # V + D odd: the logits' rows start at every 2-byte offset
    logits, targets, T, U = random_batch(gen, 3, 4, 2, V, blank, dtype=torch.float32, scale=2.0, edges=True, extra=D)
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
    # which path the launcher takes: staged through shared memory (private helpers of transducer.cuda.stages)
    assert cuda._row_pass(N, V, 2, rows, cuda.GRADIENT_LANE_BYTES, [staged], staging=True)[1:] == (8, False, True)
    for out in (same[:, :V], staged):
        cuda.gradient(rows, targets, Lattice(layout, lp, den, alpha, beta, loss), scale, o, out)
    assert_no_nan(staged)
    assert bool((staged == same[:, :V]).all()) and staged.abs().max() > 0

    tokens, durs = x[:, :V], x[:, V:]
    o = options(blank, durations=tuple(durations))
    lp, den, lp_arcs, den_arcs = cuda.tdt_log_probs(tokens, durs, targets, layout, o)
    alpha, beta, loss = cuda.tdt_alpha_beta(lp, lp_arcs, layout, o)
    same, staged = outs()
    out_durs = torch.empty(N, D, dtype=x.dtype, device=DEV)
    for out in (same[:, :V], staged):
        cuda.tdt_gradient(
            tokens,
            durs,
            targets,
            Lattice(layout, lp, den, alpha, beta, loss, lp_arcs, den_arcs),
            scale,
            o,
            (out, out_durs),
        )
    assert_no_nan(staged)
    assert bool((staged == same[:, :V]).all()) and staged.abs().max() > 0


@pytest.mark.cuda
@pytest.mark.parametrize("itype", [torch.int32, torch.int64])
def test_layout_matches_cpu(itype):
    """The layout kernel's table (lengths, strides, row_splits, stats) equals the CPU one, values out of
    range included, for batches of one utterance up to several per thread of the block."""
    gen = torch.Generator().manual_seed(77)
    for B, S, V in [(1, 0, 5), (7, 9, 30), (300, 40, 500), (2500, 3, 50)]:
        T = torch.randint(-1, 50, (B,), generator=gen).to(itype)
        U = torch.randint(-1, S + 3, (B,), generator=gen).to(torch.int64 if itype == torch.int32 else torch.int32)
        targets = torch.randint(-2, V + 2, (B, S), generator=gen).to(itype)
        for padded_t in (0, 51):
            for stats in (True, False):
                want = cpu.layout(T, U, S + 3, padded_t, LabelCheck(targets, V, 3), stats)
                got = cuda.layout(T.to(DEV), U.to(DEV), S + 3, padded_t, LabelCheck(targets.to(DEV), V, 3), stats)
                assert (got.padded, got.max_u1, got.batch_size) == (want.padded, want.max_u1, B)
                n = got.table.numel() - (0 if stats else NUM_STATS)
                assert got.table.cpu()[:n].tolist() == want.table[:n].tolist()
    empty = cuda.layout(torch.zeros(0, dtype=itype, device=DEV), torch.zeros(0, dtype=itype, device=DEV), 1)
    assert (
        empty.table.tolist() == cpu.layout(torch.zeros(0, dtype=itype), torch.zeros(0, dtype=itype), 1).table.tolist()
    )


@pytest.mark.cuda
@pytest.mark.parametrize(
    "dtype,D",
    [(torch.float32, 48), (torch.float32, 33), (torch.float16, 64), (torch.bfloat16, 40), (torch.float64, 20)],
)
def test_pack_matches_cpu(dtype, D):
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


# ---------------------------------------------------------------------------------------------------------
# TDT: every device against the reference


def tdt_stages(
    logits,
    targets,
    T,
    U,
    durations,
    blank,
    V,
    sigma=0.0,
    omega=0.0,
    lam=0.0,
    scale=None,
    padded=True,
    alias=False,
    device="cpu",
):
    """The loss (B,) and the gradient of sum_b scale[b] * loss[b] (padded like logits, zeros on padding) from
    the stages of ``device`` (transducer.cpu.stages or transducer.cuda.stages, twins): tdt_log_probs, tdt_alpha_beta,
    (alpha_beta for omega), tdt_gradient; returned on the CPU."""
    stages = stages_for(torch.device(device))
    B, max_t, max_u1, W = logits.shape
    mask = cell_mask(logits, T, U)
    if padded:
        logits2d = logits.masked_fill(~mask[..., None], math.nan).reshape(-1, W)  # padding must not be read
    else:
        logits2d = logits[mask]  # cells in (b, t, u) order: the compact layout
    logits2d, targets, T, U = (x.to(device) for x in (logits2d, targets, T, U))
    if padded:
        layout = stages.layout(T, U, max_u1, padded_t=max_t, labels=LabelCheck(targets, V, blank))
    else:
        layout = stages.layout(T, U, targets.size(1) + 1, labels=LabelCheck(targets, V, blank))
    assert Stats(*layout.stats.tolist()).bad_labels == 0
    options = LossOptions(blank=blank, durations=tuple(durations), sigma=sigma, omega=omega, fastemit_lambda=lam)
    lp, den, lp_arcs, den_arcs = stages.tdt_log_probs(logits2d[:, :V], logits2d[:, V:], targets, layout, options)
    alpha, beta, loss = stages.tdt_alpha_beta(lp, lp_arcs, layout, options)
    rnnt, total = None, loss
    if omega:
        rnnt = stages.alpha_beta(lp + sigma, layout, options)
        total = (1 - omega) * loss + omega * rnnt.nll
    scale = torch.ones(B, dtype=lp.dtype) if scale is None else scale
    out = logits2d if alias else torch.empty_like(logits2d)
    lattice = Lattice(layout, lp, den, alpha, beta, loss, lp_arcs, den_arcs, rnnt)
    stages.tdt_gradient(
        logits2d[:, :V], logits2d[:, V:], targets, lattice, scale.to(device), options, (out[:, :V], out[:, V:])
    )
    out, total = out.cpu(), total.cpu()
    if padded:
        grad = out.view(logits.shape)
        assert not grad[~mask].any()  # zeros on padding rows
    else:
        grad = torch.zeros(logits.shape, dtype=out.dtype)
        grad[mask] = out
    return total, grad


def tdt_reference(logits, targets, T, U, durations, blank, sigma=0.0, omega=0.0, lam=0.0, scale=None):
    """The float64 reference loss and its autograd gradient of sum_b scale[b] * loss[b] over the utterances with a
    finite loss (zeros for the others, as the stages give)."""
    x = logits.detach().double().requires_grad_()
    loss = tdt_loss_reference(x, targets, T, U, durations, blank, sigma, omega, lam)
    scale = torch.ones(len(T), dtype=torch.float64) if scale is None else scale.double()
    finite = torch.isfinite(loss.detach())
    if finite.any():
        (grad,) = torch.autograd.grad((loss[finite] * scale[finite]).sum(), x)
    else:
        grad = torch.zeros_like(x)
    grad = grad.masked_fill(~finite[:, None, None, None], 0.0)
    return loss.detach(), grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("column", ["token", "duration"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_tdt_non_finite_logits_give_nan(column, value, device):
    gen = torch.Generator().manual_seed(7)
    V, durations, blank = 4, [0, 1, 2], 1
    logits, targets, T, U = random_batch(gen, 3, 4, 2, V, blank, scale=1.5, edges=True, extra=len(durations))
    T[1], U[1] = 3, 1
    col = 2 if column == "token" else V + 1
    logits[1, T[1] - 1, U[1], col] = value  # a valid cell of utterance 1 (its last: not on any band)
    logits[2, -1, -1, 0] = math.nan  # padding of utterance 2 (T_2 < maxT): ignored
    assert T[2] < logits.size(1)
    loss = tdt_loss_reference(logits, targets, T, U, durations, blank)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()
    for padded in (True, False):
        got, grad = tdt_stages(logits, targets, T, U, durations, blank, V, padded=padded, device=device)
        assert torch.isnan(got[1]) and torch.isfinite(got[[0, 2]]).all()
        assert not grad[1].any()
        torch.testing.assert_close(got[[0, 2]], loss[[0, 2]], rtol=1e-12, atol=1e-12)


def test_tdt_log_probs_contract():
    gen = torch.Generator().manual_seed(11)
    V, durations, blank, sigma = 5, [0, 1, 3], 2, 0.2
    logits, targets, T, U = random_batch(gen, 4, 5, 3, V, blank, scale=1.5, edges=True, extra=len(durations))
    W = V + len(durations)
    mask = cell_mask(logits, T, U)
    logits[0, 1, 1, V + 2] = math.inf  # a non-finite duration logit makes the whole row's den NaN
    layout = cpu.layout(T, U, logits.size(2), padded_t=logits.size(1), labels=LabelCheck(targets, V, blank))
    rows = logits.masked_fill(~mask[..., None], math.nan).reshape(-1, W)
    options = LossOptions(blank=blank, sigma=sigma)
    lp, den, lp_arcs, den_arcs = cpu.tdt_log_probs(rows[:, :V], rows[:, V:], targets, layout, options)
    N = logits[..., 0].numel()
    assert lp.shape == (N, 2) and lp_arcs.shape == (N, 3) and den.shape == den_arcs.shape == (N,)
    assert lp.dtype == lp_arcs.dtype == den.dtype == den_arcs.dtype == torch.float64
    lp, lp_arcs = lp.view(*mask.shape, 2), lp_arcs.view(*mask.shape, 3)
    den, den_arcs = den.view(mask.shape), den_arcs.view(mask.shape)
    assert torch.isnan(den[0, 1, 1]) and torch.isnan(den_arcs[0, 1, 1])
    assert torch.isnan(lp[0, 1, 1]).all() and torch.isnan(lp_arcs[0, 1, 1]).all()
    mask[0, 1, 1] = False
    tok = logits[..., :V].log_softmax(-1) - sigma
    dur = logits[..., V:].log_softmax(-1)
    torch.testing.assert_close(lp[..., 0][mask], tok[..., blank][mask], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(lp_arcs[mask], dur[mask], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(den[mask], logits[..., :V].logsumexp(-1)[mask], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(den_arcs[mask], logits[..., V:].logsumexp(-1)[mask], rtol=1e-14, atol=1e-14)
    for b in range(len(T)):
        for t, u in itertools.product(range(logits.size(1)), range(logits.size(2))):
            if (b, t, u) == (0, 1, 1):
                continue
            if t < T[b] and u < U[b]:
                assert abs(float(lp[b, t, u, 1] - tok[b, t, u, targets[b, u]])) < 1e-14
            else:  # the label at u == U_b and on padding
                assert lp[b, t, u, 1] == -math.inf


CONFIGS = [  # durations, sigma, omega, fastemit_lambda
    ([0, 1, 2, 3, 4], 0.0, 0.0, 0.0),
    ([1, 2], 0.05, 0.0, 0.0),
    ([1, 3, 4], 0.0, 0.3, 0.0),
    ([0, 2, 3], 0.1, 0.0, 0.5),  # infeasible utterances arise (odd and even frames)
    ([2, 0, 1], 0.02, 0.4, 0.25),
    ([3], 0.0, 0.0, 0.1),  # one duration: many infeasible utterances
]


# cuda's tdt_alpha_beta has two kernels: the read-ahead walk (U + 1 <= 512, D <= 8, rings within the GPU's
# shared memory) and the general one; "cuda-general" forces the second.
WALKS = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("cuda-general", marks=pytest.mark.cuda)]


def walk_device(device, monkeypatch):
    if device == "cuda-general":
        monkeypatch.setattr(cuda, "WALK_MAX_THREADS", 0)
        return "cuda"
    return device


@pytest.mark.parametrize("device", WALKS)
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "compact"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_tdt_stages_match_reference(config, dtype, padded, device, monkeypatch):
    device = walk_device(device, monkeypatch)
    durations, sigma, omega, lam = CONFIGS[config]
    gen = torch.Generator().manual_seed(100 + config)
    V = 5
    blank = int(torch.randint(0, V, (1,), generator=gen))
    B, max_t, max_u = 6, 7, 3
    logits, targets, T, U = random_batch(
        gen, B, max_t, max_u, V, blank, dtype=dtype, scale=1.5, edges=True, extra=len(durations)
    )
    if durations == [3]:  # feasible only for T_b = 3 (U_b + 1)
        U = U.clamp(max=1)
        T = 3 * (U + 1)
        T[3] = 4
    elif 0 not in durations:  # feasible for U_b + 1 <= T_b
        U = torch.minimum(U, T - 1)
    if 0 not in durations:  # an utterance without an alignment
        T[3], U[3] = min(int(T[3]), 2), 2
    logits[4, 0, 0, V] = math.inf  # utterance 4 has a non-finite logit
    scale = torch.rand(B, generator=gen, dtype=torch.float64) + 0.5
    scale[5] = 0.0  # no gradient for a zero scale
    ref, ref_grad = tdt_reference(logits, targets, T, U, durations, blank, sigma, omega, lam, scale)
    assert torch.isnan(ref[4])
    if 0 not in durations:
        assert ref[3] == math.inf
    assert torch.isfinite(ref).sum() >= 3
    ref_grad[5] = 0.0
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    loss, grad = tdt_stages(
        logits, targets, T, U, durations, blank, V, sigma, omega, lam, scale.to(acc), padded, device=device
    )
    assert loss.dtype == acc and grad.dtype == dtype
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=tol)
    assert ref_grad.abs().sum() > 1.0  # a real gradient was compared


@pytest.mark.parametrize("device", WALKS)
@pytest.mark.parametrize(
    "durations, max_t, max_u",
    [
        ([0, 1, 2, 3, 4], 12, 5),
        (list(range(10)), 9, 4),
        ([0, 1, 3], 9, 70),
        ([0, 2, 3, 4, 5], 12, 199),
        ([0, 1, 2], 4, 300),
        ([0, 1, 2], 3, 600),
    ],
    ids=["D5", "D10", "U70", "U200", "U300", "U600"],
)
def test_tdt_stages_wide_batches(durations, max_t, max_u, device, monkeypatch):
    """More durations than the read-ahead walk keeps (D = 10 > 8) and more labels than its block has threads
    (U + 1 > 512): the CUDA stages fall back to the general walk; the walk's cells in several warps (U70) and
    its rings over 48 KiB (U200: 155 KiB in float64, U300: 70 KiB); every device against the reference. On CUDA
    the walk that ran is the one named above."""
    general = device == "cuda-general"
    device = walk_device(device, monkeypatch)
    kernels = []
    if device == "cuda":
        launch = cuda.launch

        def spy(path, name, *args, **kwargs):
            kernels.append(name)
            return launch(path, name, *args, **kwargs)

        monkeypatch.setattr(cuda, "launch", spy)
    gen = torch.Generator().manual_seed(18 + max_u)
    V, blank = 6, 2
    logits, targets, T, U = random_batch(gen, 4, max_t, max_u, V, blank, scale=1.5, edges=True, extra=len(durations))
    scale = torch.rand(4, generator=gen, dtype=torch.float64) + 0.5
    ref, ref_grad = tdt_reference(logits, targets, T, U, durations, blank, 0.05, 0.2, 0.3, scale)
    assert torch.isfinite(ref).sum() >= 2 and ref_grad.abs().sum() > 1.0
    for padded in (True, False):
        loss, grad = tdt_stages(
            logits, targets, T, U, durations, blank, V, 0.05, 0.2, 0.3, scale, padded, device=device
        )
        torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)
    if device == "cuda":
        walks = {k.split("<")[0] for k in kernels if k.startswith(("tdt_walk_kernel", "tdt_alpha_beta_kernel"))}
        read_ahead = not general and len(durations) <= 8 and max_u + 1 <= 512
        assert walks == {"tdt_walk_kernel" if read_ahead else "tdt_alpha_beta_kernel"}, kernels


@pytest.mark.parametrize("device", DEVICES)
def test_tdt_stages_larger_ragged_batch(device):
    gen = torch.Generator().manual_seed(17)
    V, durations, blank = 6, [0, 1, 2, 3, 4], 5
    logits, targets, T, U = random_batch(gen, 5, 12, 5, V, blank, scale=1.5, edges=True, extra=len(durations))
    scale = torch.rand(5, generator=gen, dtype=torch.float64) + 0.5
    ref, ref_grad = tdt_reference(logits, targets, T, U, durations, blank, 0.05, 0.2, 0.3, scale)
    for padded in (True, False):
        loss, grad = tdt_stages(
            logits, targets, T, U, durations, blank, V, 0.05, 0.2, 0.3, scale, padded, device=device
        )
        torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)


def test_tdt_gradient_may_overwrite_the_logits():
    gen = torch.Generator().manual_seed(19)
    V, durations, blank = 4, [0, 1, 2], 0
    logits, targets, T, U = random_batch(gen, 4, 5, 3, V, blank, scale=1.5, edges=True, extra=len(durations))
    for padded in (True, False):
        _, expected = tdt_stages(logits, targets, T, U, durations, blank, V, 0.1, 0.3, 0.2, padded=padded)
        _, got = tdt_stages(logits, targets, T, U, durations, blank, V, 0.1, 0.3, 0.2, padded=padded, alias=True)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_tdt_gradient_rows_sum_to_zero():
    # each softmax block's gradient sums to zero over its columns (tokens; durations) for omega = lambda = 0
    gen = torch.Generator().manual_seed(23)
    V, durations, blank = 5, [0, 1, 2, 3], 1
    logits, targets, T, U = random_batch(gen, 3, 6, 3, V, blank, scale=1.5, edges=True, extra=len(durations))
    _, grad = tdt_stages(logits, targets, T, U, durations, blank, V, 0.3)
    torch.testing.assert_close(grad[..., :V].sum(-1), torch.zeros(grad.shape[:3], dtype=grad.dtype), atol=1e-12, rtol=0)
    torch.testing.assert_close(grad[..., V:].sum(-1), torch.zeros(grad.shape[:3], dtype=grad.dtype), atol=1e-12, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("column", [0, 4], ids=["token", "duration"])
def test_tdt_non_finite_logit_off_every_alignment_gives_nan(column, device):
    # durations [0, 2]: frames 1 and 3 are never visited, yet a NaN there, in a token or a duration score,
    # makes the loss NaN (the stage scans the cells; the recursion alone would not carry it to beta(0, 0))
    gen = torch.Generator().manual_seed(31)
    V, durations = 3, [0, 2]
    logits = torch.randn(2, 4, 2, V + 2, generator=gen, dtype=torch.float64)
    targets = torch.tensor([[1], [2]])
    T, U = torch.tensor([4, 4]), torch.tensor([1, 1])
    logits[0, 1, 0, column] = math.nan
    loss = tdt_loss_reference(logits, targets, T, U, durations, 0)
    assert torch.isnan(loss[0]) and torch.isfinite(loss[1])
    clean = logits.clone()
    clean[0, 1, 0, column] = 0.5
    assert torch.isfinite(tdt_loss_reference(clean, targets, T, U, durations, 0)).all()
    for padded in (True, False):
        got, grad = tdt_stages(logits, targets, T, U, durations, 0, V, padded=padded, device=device)
        assert torch.isnan(got[0]) and not grad[0].any()
        torch.testing.assert_close(got[1], loss[1], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# The stages' arguments: tiles of rows, pack into a wider matrix, pack's backward over a tile, a bad out


@pytest.mark.parametrize("device", DEVICES)
def test_stages_need_out_for_a_tile(device):
    """A tile's log-probs (row_start > 0) are written into the arrays of every row: without them, an error
    on both devices (the kernels index those arrays by layout row)."""
    stages = stages_for(torch.device(device))
    T, U = torch.tensor([3, 2], device=device), torch.tensor([1, 2], device=device)
    targets = torch.tensor([[1, 0], [2, 1]], device=device)
    layout = stages.layout(T, U, 3, 0, LabelCheck(targets, 5, 0), False)
    x = torch.randn(4, 5 + 2, device=device)
    with pytest.raises(ValueError, match="row_start > 0 needs out"):
        stages.log_probs(x[:, :5].contiguous(), targets, layout, LossOptions(), 2)
    with pytest.raises(ValueError, match="row_start > 0 needs out"):
        stages.tdt_log_probs(x[:, :5], x[:, 5:], targets, layout, LossOptions(durations=(0, 1)), 2)


def pack_batch(device, seed, width=12):
    """Encoder and predictor outputs (of ``width``) of 5 utterances with T_b = 1 and U_b = 0 among them, their
    stages, layout and row count."""
    gen = torch.Generator().manual_seed(seed)
    _, T, U = random_targets(gen, 5, 8, 4, 17, 0, edges=True)
    enc, pred = (torch.randn(5, n, width, generator=gen, dtype=torch.float64) for n in (8, 5))  # maxT, maxU + 1
    enc, pred, T, U = to_device(device, enc, pred, T, U)
    stages = stages_for(enc.device)
    return enc, pred, T, U, stages, stages.layout(T, U, pred.size(1)), int((T * (U + 1)).sum())


@pytest.mark.parametrize("device", DEVICES)
def test_pack_forward_into_a_wider_matrix(device):
    """The stages' pack_forward(out=): into a column view of a wider matrix (a row stride past its width), the
    rest of the matrix untouched; an out smaller than (rows, J), of an integer dtype, is a ValueError."""
    enc, pred, T, U, stages, layout, rows = pack_batch(device, 590)
    want = torch.tanh(pack(enc, pred, T, U))
    wide = torch.full((rows, enc.size(2) + 5), 7.0, dtype=enc.dtype, device=enc.device)
    got = stages.pack_forward(enc, pred, layout, rows, 0, "tanh", wide[:, : enc.size(2)])
    assert got.data_ptr() == wide.data_ptr()
    torch.testing.assert_close(wide[:, : enc.size(2)], want)
    assert (wide[:, enc.size(2) :] == 7.0).all()
    for bad in (wide[:-1, : enc.size(2)], wide[:, : enc.size(2) - 1], wide[:, : enc.size(2)].long()):
        with pytest.raises(ValueError, match="pack_forward: out must be"):
            stages.pack_forward(enc, pred, layout, rows, 0, "tanh", bad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("activation", ["identity", "tanh"])
@pytest.mark.parametrize("pad_rows, ones", [(0, 1), (1, 3), (7, 8), (13, 0), (7, 40)])
@pytest.mark.parametrize("variant", ["plain", "dropout", "fp32 inputs"])
@pytest.mark.parametrize("J", [12, 328])
def test_pack_forward_writes_the_gemm_operand(device, dtype, activation, pad_rows, ones, variant, J):
    """pack_forward into an out taller and wider than the tile (the fused loss's GEMM operand): the tile's rows
    [start, start + count) in its first J columns, ones in the columns past J, zeros in every column of the rows
    past count, whatever out held before (NaN here); count not a multiple of the rows a warp of the kernel writes
    (PACK_ROWS), nor out's rows but for pad_rows 1 and 13, so that a warp's rows end among the tile's and among
    out's. At J = 328 and with 40 ones columns a lane's loops over the vectors and the ones take several trips (41
    vectors of 8 beside 8 ones, 164 of 2 in fp64, 328 of 1 where the row stride allows no wider vector). With the
    joiner's dropout, and with fp32 inputs into an out of ``dtype`` (autocast's operand)."""
    enc, pred, T, U, stages, layout, rows = pack_batch(device, 591, J)
    inputs = torch.float32 if variant == "fp32 inputs" else dtype
    enc, pred = enc.to(inputs), pred.to(inputs)
    start, count = 3, rows - 6
    assert count % cuda.PACK_ROWS  # a warp's rows: the tile's last ones, then padding
    dropout = Dropout(0.3, 8765) if variant == "dropout" else None
    act = torch.tanh if activation == "tanh" else (lambda x: x)
    want = act(pack(enc.double(), pred.double(), T, U))[start : start + count]
    if dropout:
        want = want * dropout_mask(dropout, count, J, start, want.dtype, want.device)
    out = torch.full((count + pad_rows, J + ones), float("nan"), dtype=dtype, device=enc.device)
    got = stages.pack_forward(enc, pred, layout, count, start, activation, out, dropout)
    assert got.data_ptr() == out.data_ptr()
    eps = 1e-12 if dtype == inputs == torch.float64 else 1e-6 if dtype == torch.float64 else 1e-2
    tol = dict(rtol=eps, atol=eps)
    torch.testing.assert_close(out[:count, :J].double(), want, **tol)
    assert (out[:count, J:] == 1).all()
    assert (out[count:] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("start, past", [(0, 1), (0, 37), (5, 11)])
def test_pack_forward_past_the_layouts_rows_writes_zeros(device, dtype, start, past):
    """pack_forward over rows [start, start + count) that reach ``past`` rows beyond the layout's last (the fused loss
    packs its first tile before it knows the row count): the layout's rows packed, ones in their columns past J,
    every column of the rows past the layout's zeros, out's padding rows too (NaN before)."""
    enc, pred, T, U, stages, layout, rows = pack_batch(device, 592, 24)
    enc, pred = enc.to(dtype), pred.to(dtype)
    count, J = rows - start + past, enc.size(2)
    want = torch.tanh(pack(enc.double(), pred.double(), T, U))[start:]
    out = torch.full((count + 3, J + 2), float("nan"), dtype=dtype, device=enc.device)
    stages.pack_forward(enc, pred, layout, count, start, "tanh", out)
    eps = 1e-12 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(out[: rows - start, :J].double(), want, rtol=eps, atol=eps)
    assert (out[: rows - start, J:] == 1).all()
    assert (out[rows - start :] == 0).all()
    assert torch.equal(
        stages.pack_forward(enc, pred, layout, count, start, "tanh")[rows - start :].cpu(),
        out[rows - start : count, :J].cpu(),
    )


def pack_backward_over_tiles(device, T, U, max_t, max_u1, D, activation, p, dtype, bounds, seed):
    """(grad_enc, grad_pred) of the stages' pack_backward_add over the tiles between ``bounds`` (sums in ``dtype``'s
    accumulation type), and autograd's gradients of sum(dropout(act(pack(...))) * grad_rows) in float64, for random
    inputs and rows of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    enc, pred = (torch.randn(len(T), n, D, generator=gen, dtype=torch.float64).to(dtype) for n in (max_t, max_u1))
    N = int((T * (U + 1)).sum())
    grad_rows = torch.randn(N, D, generator=gen, dtype=torch.float64).to(dtype)
    dropout = Dropout(p, seed + 12345) if p else None
    e, q = enc.double().requires_grad_(), pred.double().requires_grad_()
    h = ACTIVATIONS[activation].forward(pack(e, q, T, U))
    if dropout:
        h = h * dropout_mask(dropout, N, D, 0, h.dtype)
    (h * grad_rows.double()).sum().backward()
    enc, pred, T, U, grad_rows = to_device(device, enc, pred, T, U, grad_rows)
    stages = stages_for(enc.device)
    layout = stages.layout(T, U, pred.size(1))
    row_splits = [0] + torch.cumsum(T * (U + 1), 0).tolist()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    grad_enc, grad_pred = torch.zeros_like(enc, dtype=acc), torch.zeros_like(pred, dtype=acc)
    for start, end in zip(bounds, bounds[1:] + [N]):
        utterances = (bisect.bisect_right(row_splits, start) - 1, bisect.bisect_left(row_splits, end, lo=1))
        stages.pack_backward_add(
            grad_rows[start:end], layout, start, utterances, (grad_enc, grad_pred), (enc, pred), activation, dropout
        )
    return (grad_enc.cpu().double(), grad_pred.cpu().double()), (e.grad, q.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "D, activation, p, dtype",
    [
        (40, "tanh", 0.0, torch.float64),
        (136, "gelu", 0.3, torch.float64),
        (20, "identity", 0.0, torch.float64),
        (24, "identity", 0.5, torch.float64),
        (64, "tanh", 0.0, torch.bfloat16),
        (72, "relu", 0.2, torch.float32),
    ],
)
def test_pack_backward_add_over_tiles_of_long_utterances(device, D, activation, p, dtype):
    """The stages' pack_backward_add over tiles that cut utterances of up to 70 frames and 13 labels (the CUDA
    kernel's frame blocks of 8 frames and its vectors of a row, cut by the tiles' ends), added up, equal autograd's
    gradient of sum(dropout(act(pack(...))) * grad_rows) in float64 (inputs and rows of ``dtype``, sums in its
    accumulation type); T_b = 1 and U_b = 0 among the lengths."""
    T, U = torch.tensor([70, 1, 33, 64, 5, 40]), torch.tensor([12, 0, 3, 0, 7, 9])
    got, want = pack_backward_over_tiles(
        device, T, U, 72, 14, D, activation, p, dtype, [0, 5, 333, 334, 900, 1003], seed=D
    )  # cuts frames, blocks, utterances
    # bf16: h rounded to bf16 before act' (the pack passes' h): sums of up to 70 rows, errors of a few 1e-2
    tol = (
        dict(rtol=1e-12, atol=1e-12)
        if dtype == torch.float64
        else dict(rtol=1e-5, atol=1e-4)
        if dtype == torch.float32
        else dict(rtol=3e-2, atol=0.15)
    )
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "u_chunk, activation, p, dtype",
    [
        (32, "tanh", 0.0, torch.float64),
        (32, "gelu", 0.3, torch.float64),
        (4, "relu", 0.2, torch.float64),
        (32, "tanh", 0.0, torch.bfloat16),
    ],
)
def test_pack_backward_add_over_chunks_of_u(monkeypatch, device, u_chunk, activation, p, dtype):
    """pack_backward_add over tiles of utterances of many labels, whose u the CUDA kernel splits into chunks of
    u_chunk values (cuda_stages.PACK_U_CHUNK; the chunks' sums over u added in order by pack_grad_enc_kernel), equals
    autograd's gradient in float64: U_b + 1 = 96 (3 chunks of 32), 71, 34 (a chunk of 2), 32 (one chunk) and 1;
    tiles cutting frames, frame blocks and utterances."""
    monkeypatch.setattr(cuda, "PACK_U_CHUNK", u_chunk)
    launched = []
    launch_each = cuda.launch_each
    monkeypatch.setattr(
        cuda,
        "launch_each",
        lambda path, kernels, *args: launched.extend(k[0] for k in kernels) or launch_each(path, kernels, *args),
    )
    T, U = torch.tensor([20, 11, 9, 3, 13, 17]), torch.tensor([95, 70, 33, 31, 0, 95])
    got, want = pack_backward_over_tiles(
        device,
        T,
        U,
        21,
        96,
        40 if dtype == torch.float64 else 64,
        activation,
        p,
        dtype,
        [0, 50, 1000, 1921, 2500, 3333],
        seed=u_chunk,
    )
    if device == "cuda":  # the chunks ran
        assert any(name.startswith("pack_grad_enc_kernel") for name in launched)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=3e-2, atol=0.3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_pack_backward_add_recomputes_the_activation(device, activation):
    """The stages' pack_backward_add over a tile that splits utterances: the sums of grad_rows * act'(h), h
    recomputed from inputs = (encoder_out, predictor_out), equal autograd's through act(pack(...)); with an
    activation and no inputs, a ValueError."""
    enc, pred, T, U, stages, layout, rows = pack_batch(device, 595)
    start, end = 3, rows - 2
    grad_rows = torch.randn(end - start, enc.size(2), dtype=enc.dtype, generator=torch.Generator().manual_seed(5))
    grad_rows = grad_rows.to(device)
    e, p = enc.detach().requires_grad_(), pred.detach().requires_grad_()
    act = torch.tanh if activation == "tanh" else torch.relu
    (act(pack(e, p, T, U))[start:end] * grad_rows).sum().backward()
    grad_enc, grad_pred = torch.zeros_like(enc), torch.zeros_like(pred)
    row_splits = [0] + torch.cumsum(T * (U + 1), 0).tolist()
    utterances = (
        max(b for b in range(len(T)) if row_splits[b] <= start),
        min(b for b in range(1, len(T) + 1) if row_splits[b] >= end),
    )
    stages.pack_backward_add(grad_rows, layout, start, utterances, (grad_enc, grad_pred), (enc, pred), activation)
    assert grad_enc.abs().sum() > 0 and grad_pred.abs().sum() > 0
    torch.testing.assert_close(grad_enc, e.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_pred, p.grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="pack_backward_add: inputs must be"):
        stages.pack_backward_add(grad_rows, layout, start, utterances, (grad_enc, grad_pred), None, activation)
    if device == "cuda":  # inputs on another device than the rows: named, not read through a host pointer
        with pytest.raises(ValueError, match="pack_backward_add: inputs must be .* device"):
            stages.pack_backward_add(
                grad_rows, layout, start, utterances, (grad_enc, grad_pred), (enc.cpu(), pred.cpu()), activation
            )


def test_cuda_gradient_names_a_bad_out():
    # transducer.cuda.stages.gradient writes into `out` of the logits' shape and dtype, at any row stride (the
    # loss's padded gradient rows) but unit column stride; anything else is a ValueError naming `out`, raised
    # before any launch (so it is checked here on CPU tensors, without a GPU)
    logits = torch.randn(6, 5)
    args = (None,) * 4  # targets, lattice, scale, options: not reached
    for bad in (torch.empty(6, 5, dtype=torch.float64), torch.empty(6, 4), torch.empty(5, 6).t()):
        with pytest.raises(ValueError, match="out must"):
            cuda.gradient(logits, *args, bad)
