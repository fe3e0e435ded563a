"""The multi-blank RNN-T loss: its float64 reference (against a brute-force sum over alignments, gradcheck), the
loss on every device against the reference (compact and padded, sigma, FastEmit, clamp, T_b = 1, U_b = 0, T_b
shorter than a big blank), 16-bit logits, the fused joiner loss with big blanks, the registered op, bad input,
and both CUDA walks."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from _batches import DEVICES, compact, random_batch

from transducer import (
    FusedJoinerLoss,
    MultiblankLoss,
    fused_joiner_loss,
    multiblank_loss,
    multiblank_loss_reference,
    pack,
)
from transducer.options import LossOptions

V, BLANK, BIG = 9, 8, [2, 4]  # NeMo's layout: the blank last, big blanks 7 (duration 2) and 6 (duration 4)


def batch(seed, B=5, max_t=7, max_u=3, V=V, blank=BLANK, big=BIG, dtype=torch.float64, scale=1.5):
    """Padded logits, labels avoiding every blank, lengths with T_b = 1 (utterance 1), U_b = 0 (utterance 2) and
    T_b shorter than the longest big blank."""
    gen = torch.Generator().manual_seed(seed)
    logits, targets, T, U = random_batch(gen, B, max_t, max_u, V, blank, dtype=dtype, scale=scale)
    T[1], U[2] = 1, 0
    if B > 3:
        T[3] = min(max_t, max(big) - 1)
    labels = torch.tensor([v for v in range(V) if not blank - len(big) <= v <= blank])
    targets = labels[targets % len(labels)]
    return logits, targets, T, U


def reference(logits, targets, T, U, big=BIG, blank=BLANK, sigma=0.0, lam=0.0, scale=None):
    """The float64 reference loss and its gradient of sum_b scale[b] * loss[b] over the utterances with a finite
    loss (zeros for the others)."""
    x = logits.detach().double().requires_grad_()
    loss = multiblank_loss_reference(x, targets, T, U, big, blank, sigma, lam)
    scale = torch.ones(len(T), dtype=torch.float64) if scale is None else scale.double()
    finite = torch.isfinite(loss.detach())
    (grad,) = torch.autograd.grad((loss[finite] * scale[finite]).sum(), x) if finite.any() else (torch.zeros_like(x),)
    return loss.detach(), grad


def brute_force(logits, y, T, U, big, blank, sigma):
    """-log of the sum over every complete alignment, enumerated one by one in plain Python floats."""

    def lp(t, u, v):
        row = logits[t][u]
        m = max(row)
        return row[v] - m - math.log(sum(math.exp(x - m) for x in row)) - sigma

    arcs = [(1, blank)] + [(d, blank - 1 - i) for i, d in enumerate(big)]
    total = []

    def walk(t, u, weight):
        if u < U:
            walk(t, u + 1, weight + lp(t, u, y[u]))
        for d, column in arcs:
            if t + d < T:
                walk(t + d, u, weight + lp(t, u, column))
            elif t + d == T and u == U:
                total.append(weight + lp(t, u, column))

    walk(0, 0, 0.0)
    m = max(total)
    return -(m + math.log(sum(math.exp(w - m) for w in total)))


@pytest.mark.parametrize(
    "T,U,big,sigma",
    [(1, 0, [2], 0.0), (3, 1, [2], 0.1), (5, 2, [2, 3], 0.0), (4, 3, [2, 4], 0.05), (6, 1, [3, 5, 2], 0.0)],
)
def test_reference_equals_brute_force(T, U, big, sigma):
    gen = torch.Generator().manual_seed(T * 10 + U)
    V = 4 + len(big) + 1
    blank = V - 1
    logits = torch.randn(1, T, U + 1, V, generator=gen, dtype=torch.float64)
    y = torch.randint(0, V - 1 - len(big), (1, max(U, 1)), generator=gen)
    got = multiblank_loss_reference(logits, y, torch.tensor([T]), torch.tensor([U]), big, blank, sigma)
    want = brute_force(logits[0].tolist(), y[0].tolist(), T, U, big, blank, sigma)
    assert got.item() == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_reference_gradcheck():
    logits, targets, T, U = batch(1, B=3, max_t=4, max_u=2)
    x = logits.detach().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda z: multiblank_loss_reference(z, targets, T, U, BIG, BLANK, 0.05), (x,), eps=1e-6, atol=1e-7
    )


CASES = [  # layout, blank, big, sigma, fastemit_lambda, clamp
    ("padded", -1, [2, 4], 0.0, 0.0, -1.0),
    ("compact", -1, [2, 4], 0.05, 0.0, -1.0),
    ("compact", 5, [3], 0.0, 0.3, -1.0),  # the blank in the middle: big blank 4, labels 6 ... 8 too
    ("padded", -1, [2, 3, 5], 0.1, 0.2, 0.05),
    ("padded", 8, [8], 0.0, 0.0, -1.0),  # a big blank longer than every utterance
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference_float64(device, case):
    layout, blank, big, sigma, lam, clamp = CASES[case]
    column = blank % V
    logits, targets, T, U = batch(100 + case, blank=column, big=big)
    scale = torch.rand(len(T), generator=torch.Generator().manual_seed(case), dtype=torch.float64) + 0.5
    want, want_grad = reference(logits, targets, T, U, big, column, sigma, lam, scale)
    if clamp > 0:  # the clamp applies to the unit gradient, before the scale
        unit_grad = reference(logits, targets, T, U, big, column, sigma, lam)[1]
        want_grad = torch.zeros_like(want_grad)
        for b in range(len(T)):
            want_grad[b] = unit_grad[b].clamp(-clamp, clamp) * scale[b]
    x = (compact(logits, T, U) if layout == "compact" else logits).to(device).requires_grad_()
    got = multiblank_loss(
        x,
        targets.to(device),
        T.to(device),
        U.to(device),
        big,
        blank,
        sigma=sigma,
        fastemit_lambda=lam,
        clamp=clamp,
        reduction="none",
    )
    (got_grad,) = torch.autograd.grad((got * scale.to(device)).sum(), x)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-10)
    got_grad = got_grad.cpu()
    if layout == "compact":
        want_grad = compact(want_grad, T, U)
    else:  # padding gets zeros
        mask = torch.zeros(logits.shape[:3], dtype=torch.bool)
        for b in range(len(T)):
            mask[b, : T[b], : U[b] + 1] = True
        assert not got_grad[~mask].any()
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-9, atol=1e-10)
    assert got_grad.abs().sum() > 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_reductions_infeasible_and_non_finite(device):
    # durations all longer than T_b = 1 still leave the standard blank; a NaN logit makes its utterance NaN and
    # leaves the others' gradient; reductions as for transducer_loss
    logits, targets, T, U = batch(7)
    logits[4, 0, 0, 3] = math.nan
    x = logits.to(device).requires_grad_()
    args = (targets.to(device), T.to(device), U.to(device), BIG, -1)
    none = multiblank_loss(x, *args, reduction="none")
    assert torch.isnan(none[4]) and torch.isfinite(none[:4]).all()
    (grad,) = torch.autograd.grad(none[:4].sum(), x)
    assert not grad[4].any() and torch.isfinite(grad).all()
    finite = multiblank_loss(
        x[:4], targets[:4].to(device), T[:4].to(device), U[:4].to(device), BIG, -1, reduction="none"
    )
    torch.testing.assert_close(
        multiblank_loss(x[:4], *(a[:4] for a in args[:3]), BIG, -1, reduction="sum"), finite.sum()
    )
    torch.testing.assert_close(multiblank_loss(x[:4], *(a[:4] for a in args[:3]), BIG, -1), finite.mean())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision(device, dtype):
    # the loss reads fp32 / fp16 / bf16 logits as they are and accumulates in fp32: within what rounding the
    # logits to the dtype moves the float64 reference of the rounded logits
    logits, targets, T, U = batch(20, B=4, max_t=12, max_u=5, V=40, blank=39, big=[2, 3, 6])
    x = logits.to(dtype)
    want, want_grad = reference(x, targets, T, U, [2, 3, 6], 39, 0.05)
    y = x.to(device).requires_grad_()
    got = multiblank_loss(
        y, targets.to(device), T.to(device), U.to(device), [2, 3, 6], -1, sigma=0.05, reduction="none"
    )
    (grad,) = torch.autograd.grad(got.sum(), y)
    assert got.dtype == torch.float32 and grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    ulp = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(grad.cpu().double(), want_grad, rtol=ulp, atol=ulp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [0, 1, 2])
def test_fused_equals_unfused(device, case):
    # fused_joiner_loss(big_blank_durations=...) equals multiblank_loss(F.linear(act(pack(...)))) in float64,
    # tiles splitting utterances
    big, sigma, max_rows = [([2, 4], 0.0, None), ([2, 3, 5], 0.05, 5), ([3], 0.1, 1)][case]
    gen = torch.Generator().manual_seed(200 + case)
    logits, targets, T, U = batch(200 + case, B=5, max_t=8, max_u=4, V=17, blank=16, big=big)
    B, J = len(T), 12
    enc = torch.randn(B, 8, J, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    pred = torch.randn(B, int(U.max()) + 1, J, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    weight = (torch.randn(17, J, generator=gen, dtype=torch.float64) * 0.5).to(device).requires_grad_()
    bias = torch.randn(17, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    targets, T, U = targets.to(device), T.to(device), U.to(device)
    params = (enc, pred, weight, bias)
    w = torch.rand(B, generator=gen, dtype=torch.float64).to(device) + 0.5
    fused = fused_joiner_loss(
        enc,
        pred,
        weight,
        bias,
        targets,
        T,
        U,
        blank=-1,
        big_blank_durations=big,
        sigma=sigma,
        max_rows=max_rows,
        reduction="none",
    )
    unfused = multiblank_loss(
        F.linear(torch.tanh(pack(enc, pred, T, U)), weight, bias), targets, T, U, big, -1, sigma=sigma, reduction="none"
    )
    torch.testing.assert_close(fused, unfused, rtol=1e-10, atol=1e-12)
    for got, want in zip(
        torch.autograd.grad((fused * w).sum(), params), torch.autograd.grad((unfused * w).sum(), params)
    ):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    m = FusedJoinerLoss(J, 17, blank=-1, big_blank_durations=big, sigma=sigma).to(device).double()
    assert m.output.out_features == 17 and "big_blank_durations" in repr(m)
    torch.testing.assert_close(
        m(enc, pred, targets, T, U),
        multiblank_loss(m.logits(enc[:, :, None], pred[:, None]), targets, T, U, big, -1, sigma=sigma),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_module_opcheck_compile(device):
    logits, targets, T, U = (t.to(device) for t in batch(30))
    m = MultiblankLoss(BIG, blank=-1, sigma=0.05, reduction="sum")
    assert "big_blank_durations=[2, 4], blank=-1" in repr(m)
    x = logits.requires_grad_()
    torch.testing.assert_close(
        m(x, targets, T, U), multiblank_loss(x, targets, T, U, BIG, -1, sigma=0.05, reduction="sum")
    )
    options = LossOptions(blank=BLANK, sigma=0.05, fastemit_lambda=0.1, clamp=-1.0, big_blank_durations=tuple(BIG))
    op_args = (logits.detach().requires_grad_(), None, targets, T, U, logits.size(-1), *options.flat(), True, False)
    torch.library.opcheck(torch.ops.transducer.loss.default, op_args)

    def f(z):
        return multiblank_loss(z, targets, T, U, BIG, -1, sigma=0.05)

    explained = torch._dynamo.explain(f)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(x)
    torch.testing.assert_close(got, f(x))
    exported = torch.export.export(m, (logits, targets, T, U))
    torch.testing.assert_close(exported.module()(logits, targets, T, U), m(logits, targets, T, U))


def _bad(**change):
    logits, targets, T, U = batch(40)
    args = dict(logits=logits, targets=targets, logit_lengths=T, target_lengths=U, big_blank_durations=BIG, blank=-1)
    args.update(change)
    return multiblank_loss(**args)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(big_blank_durations=[]), ValueError, "big_blank_durations: expected at least one big blank"),
        (dict(big_blank_durations=[1, 3]), ValueError, "big_blank_durations: expected distinct ints >= 2"),
        (dict(big_blank_durations=[2, 2]), ValueError, "big_blank_durations: expected distinct ints >= 2"),
        (dict(big_blank_durations=[2.5]), ValueError, "big_blank_durations: expected a sequence of ints"),
        (dict(big_blank_durations=[True, 2]), ValueError, "big_blank_durations: expected a sequence of ints"),
        (
            dict(big_blank_durations=[2, 1 << 16]),
            ValueError,
            "big_blank_durations: expected durations of at most 65535",
        ),
        (dict(big_blank_durations=None), ValueError, "big_blank_durations: the multi-blank loss needs"),
        (dict(big_blank_durations=[2, 3, 4], blank=2), ValueError, "3 big blanks sit in the columns"),
        (dict(blank=9), ValueError, r"blank: expected an int in \[-9, 9\)"),
        (dict(sigma=math.nan), ValueError, "sigma: expected a number, not NaN"),
        (dict(sigma=math.inf), ValueError, "sigma: expected a finite number"),
        (dict(targets=torch.full((5, 3), 7)), ValueError, r"equal to a blank \(6 ... 8\)"),
        (dict(targets=torch.full((5, 3), 6)), ValueError, r"equal to a blank \(6 ... 8\)"),
        (dict(reduction="avg"), ValueError, "reduction: expected one of"),
    ],
)
def test_bad_input(change, error, match):
    with pytest.raises(error, match=match):
        _bad(**change)


def test_bad_module_and_fused_options():
    with pytest.raises(ValueError, match="big_blank_durations: expected distinct ints >= 2"):
        MultiblankLoss([1], blank=-1)
    with pytest.raises(ValueError, match="big_blank_durations: the multi-blank loss needs"):
        MultiblankLoss(None, blank=-1)
    with pytest.raises(ValueError, match="big_blank_durations: 1 big blanks sit in the columns"):
        MultiblankLoss([2], blank=0)  # no vocabulary fits a big blank before column 0
    MultiblankLoss([2], blank=1)  # nor refused where one fits
    with pytest.raises(ValueError, match="big_blank_durations: the TDT loss does not take this option"):
        FusedJoinerLoss(8, 10, blank=-1, big_blank_durations=[2], durations=[0, 1])
    with pytest.raises(ValueError, match="omega: the multi-blank RNN-T loss does not take this option"):
        FusedJoinerLoss(8, 10, blank=-1, big_blank_durations=[2], omega=0.1)
    with pytest.raises(ValueError, match="big_blank_durations: 2 big blanks sit in the columns"):
        FusedJoinerLoss(8, 10, blank=1, big_blank_durations=[2, 3])
    with pytest.raises(ValueError, match="one_sym_per_frame: the multi-blank RNN-T loss does not take this option"):
        FusedJoinerLoss(8, 10, blank=-1, big_blank_durations=[2], one_sym_per_frame=True)


@pytest.mark.cuda
@pytest.mark.parametrize("walk", ["fast", "general"])
@pytest.mark.parametrize("big", [[2, 4], [2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7, 8]], ids=["K2", "K6", "K7"])
def test_cuda_walks_match_the_cpu(walk, big, monkeypatch):
    # the multi-blank lattice on both CUDA walks (tdt_walk_kernel: D = K + 2 <= 8; tdt_alpha_beta_kernel
    # otherwise, or when forced), against the CPU twin
    import transducer.cuda.stages

    if walk == "general":
        monkeypatch.setattr(transducer.cuda.stages, "WALK_MAX_THREADS", 0)
    calls = []
    launch = transducer.cuda.stages.launch
    monkeypatch.setattr(transducer.cuda.stages, "launch", lambda *a, **k: calls.append(a[1]) or launch(*a, **k))
    V = 12
    logits, targets, T, U = batch(50 + len(big), B=6, max_t=20, max_u=6, V=V, blank=V - 1, big=big)
    want = multiblank_loss(logits, targets, T, U, big, -1, sigma=0.05, reduction="none")
    got = multiblank_loss(logits.cuda(), targets.cuda(), T.cuda(), U.cuda(), big, -1, sigma=0.05, reduction="none")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-10)
    fast = walk == "fast" and len(big) + 2 <= 8
    assert any(
        name.startswith("tdt_walk_kernel" if fast else "tdt_alpha_beta_kernel") and name.endswith("true>")
        for name in calls
    )


def test_cpu_walk_is_tdt_with_the_big_blanks_as_blank_arcs():
    # itertools.product over small grids: every (T, U) up to 4 x 3 with big blanks [2, 3], sigma 0.1, against
    # the reference, one utterance at a time (the walk's edges: T_b < d_i, U_b = 0)
    gen = torch.Generator().manual_seed(60)
    for T, U in itertools.product(range(1, 5), range(0, 4)):
        logits = torch.randn(1, T, U + 1, 7, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 4, (1, max(U, 1)), generator=gen)
        lengths = torch.tensor([T]), torch.tensor([U])
        want = multiblank_loss_reference(logits, y, *lengths, [2, 3], 6, 0.1)
        got = multiblank_loss(logits, y, *lengths, [2, 3], -1, sigma=0.1, reduction="none")
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
