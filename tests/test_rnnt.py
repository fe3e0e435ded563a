"""The RNN-T and RNA loss API (transducer_loss, TransducerLoss, rnnt_loss) against the float64 reference and
torchaudio: compact and padded logits, gradcheck, every reduction, half precision, infeasible RNA utterances,
the module, in-place gradients and losses changed in place; on the CPU and CUDA."""

import math

import pytest
import torch
from _batches import DEVICES, cell_mask, compact, random_batch, to_device
from _imports import require

from transducer import RNNTLoss, TransducerLoss, rnnt_loss, transducer_loss, transducer_loss_reference

DEV = "cuda"


def reduce_like(losses, reduction):
    return {"none": losses, "sum": losses.sum(), "mean": losses.mean()}[reduction]


CASES = [(seed, rna) for seed in range(8) for rna in (False, True)]


@pytest.mark.parametrize("seed,rna", CASES)
def test_matches_reference_compact_and_padded(seed, rna):
    gen = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 6, (1,), generator=gen))
    V = int(torch.randint(2, 21, (1,), generator=gen))
    blank = 0 if seed % 2 == 0 else int(torch.randint(0, V, (1,), generator=gen))
    logits, targets, T, U = random_batch(
        gen,
        B,
        int(torch.randint(1, 13, (1,), generator=gen)),
        int(torch.randint(0, 7, (1,), generator=gen)),
        V,
        blank,
        rna=rna,
    )
    reduction = ("none", "sum", "mean")[seed % 3]
    ref_in = logits.clone().requires_grad_()
    expected = reduce_like(transducer_loss_reference(ref_in, targets, T, U, blank, one_sym_per_frame=rna), reduction)
    weights = torch.rand(expected.shape, generator=gen, dtype=torch.float64) + 0.5  # a non-trivial grad_output
    (expected * weights).sum().backward()

    padded = logits.clone().requires_grad_()
    got = transducer_loss(padded, targets, T, U, blank=blank, reduction=reduction, one_sym_per_frame=rna)
    (got * weights).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(padded.grad, ref_in.grad, rtol=1e-9, atol=1e-10)

    rows = compact(logits, T, U).requires_grad_()
    got = transducer_loss(rows, targets, T, U, blank=blank, reduction=reduction, one_sym_per_frame=rna)
    (got * weights).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(rows.grad, compact(ref_in.grad, T, U), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("layout", ["compact", "padded"])
@pytest.mark.parametrize("rna", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_gradcheck(layout, rna, reduction):
    seed = ["compact", "padded"].index(layout) * 6 + rna * 3 + ["none", "sum", "mean"].index(reduction)
    gen = torch.Generator().manual_seed(seed)
    B, max_t, max_u, V = (
        int(torch.randint(lo, hi + 1, (1,), generator=gen)) for lo, hi in ((1, 5), (1, 12), (0, 6), (2, 20))
    )
    blank = 0 if seed % 2 else int(torch.randint(0, V, (1,), generator=gen))
    logits, targets, T, U = random_batch(gen, B, max_t, max_u, V, blank, rna=rna)
    if layout == "compact":
        logits = compact(logits, T, U)
    logits.requires_grad_()

    def loss(x):
        return transducer_loss(x, targets, T, U, blank=blank, reduction=reduction, one_sym_per_frame=rna)

    # fast mode checks random projections of the Jacobian: the full one costs 2 * numel forward passes
    assert torch.autograd.gradcheck(loss, (logits,), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("layout", ["compact", "padded"])
def test_gradcheck_full_jacobian(layout):
    gen = torch.Generator().manual_seed(21)
    for rna in (False, True):
        logits, targets, T, U = random_batch(gen, 3, 5, 3, 4, blank=2, rna=rna)
        x = (compact(logits, T, U) if layout == "compact" else logits).requires_grad_()
        assert torch.autograd.gradcheck(
            lambda x: transducer_loss(x, targets, T, U, blank=2, reduction="none", one_sym_per_frame=rna),
            (x,),
            eps=1e-6,
            atol=1e-7,
            rtol=1e-5,
        )


@pytest.mark.parametrize("from_log_softmax", [False, True])
def test_gradcheck_from_log_softmax(from_log_softmax):
    gen = torch.Generator().manual_seed(7)
    logits, targets, T, U = random_batch(gen, 2, 4, 3, 5, blank=0)
    x = logits.log_softmax(-1).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: transducer_loss(x, targets, T, U, reduction="sum", from_log_softmax=from_log_softmax),
        (x,),
        eps=1e-6,
        atol=1e-7,
        rtol=1e-5,
    )


@pytest.mark.parametrize("seed", range(6))
def test_matches_torchaudio(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    B = int(torch.randint(1, 9, (1,), generator=gen))
    V = (2, 17, 128, 500, 1000, 1000)[seed]
    blank = (0, 3, V - 1, 0, 5, 0)[seed]
    max_t, max_u = (1, 9, 30, 20, 12, 40)[seed], (0, 4, 10, 15, 6, 3)[seed]
    logits, targets, T, U = random_batch(gen, B, max_t, max_u, V, blank, dtype=torch.float32)
    logits = logits * 3
    ta = require("torchaudio.functional", "test")
    ta_in = logits.clone().requires_grad_()
    expected = ta.rnnt_loss(ta_in, targets[:, : int(U.max())].int(), T.int(), U.int(), blank=blank, reduction="none")
    expected.sum().backward()

    rows = compact(logits, T, U).requires_grad_()
    got = transducer_loss(rows, targets, T, U, blank=blank, reduction="none")
    got.sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(rows.grad, compact(ta_in.grad, T, U), rtol=1e-4, atol=1e-6)

    padded = logits.clone().requires_grad_()
    got = transducer_loss(padded, targets, T, U, blank=blank, reduction="none")
    got.sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    valid = cell_mask(logits, T, U)
    torch.testing.assert_close(padded.grad[valid], ta_in.grad[valid], rtol=1e-4, atol=1e-6)
    assert (padded.grad[~valid] == 0).all()


def test_matches_torchaudio_without_fused_log_softmax():
    gen = torch.Generator().manual_seed(5)
    logits, targets, T, U = random_batch(gen, 4, 10, 5, 30, blank=0, dtype=torch.float32)
    log_probs = logits.log_softmax(-1)
    ta = require("torchaudio.functional", "test")
    ta_in = log_probs.clone().requires_grad_()
    expected = ta.rnnt_loss(
        ta_in, targets[:, : int(U.max())].int(), T.int(), U.int(), blank=0, reduction="sum", fused_log_softmax=False
    )
    expected.backward()
    ours = log_probs.clone().requires_grad_()
    got = transducer_loss(ours, targets, T, U, reduction="sum", from_log_softmax=True)
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    valid = cell_mask(logits, T, U)
    torch.testing.assert_close(ours.grad[valid], ta_in.grad[valid], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,eps", [(torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)])
def test_half_precision_matches_float32(device, dtype, eps):
    # Inputs are rounded to `dtype` once; the loss accumulates in float32, so it must match the float32
    # loss on the same rounded values to float32 accuracy; the gradient is rounded once to `dtype`, so
    # each element may differ by half an ulp of `dtype` (relative eps) plus float32 noise.
    gen = torch.Generator().manual_seed(11)
    logits, targets, T, U = random_batch(gen, 6, 30, 10, 1024, blank=0, dtype=dtype)
    half = compact(logits, T, U).to(device).requires_grad_()
    full = half.detach().float().requires_grad_()
    targets, T, U = targets.to(device), T.to(device), U.to(device)
    got = transducer_loss(half, targets, T, U, reduction="none")
    expected = transducer_loss(full, targets, T, U, reduction="none")
    got.sum().backward()
    expected.sum().backward()
    assert got.dtype == torch.float32 and half.grad.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(half.grad.float(), full.grad, rtol=eps, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_rnnt_loss_returns_the_logits_dtype(dtype, reduction):
    """torchaudio's spelling returns the logits' dtype, as torchaudio does: transducer_loss's float32 (float64)
    losses rounded once, with the same gradient; transducer_loss itself keeps float32 for 16-bit logits."""
    gen = torch.Generator().manual_seed(13)
    logits, targets, T, U = random_batch(gen, 3, 6, 3, 9, 8, dtype=dtype, scale=2.0)
    want_in = logits.clone().requires_grad_()
    want = transducer_loss(want_in, targets, T, U, blank=8, reduction=reduction)
    assert want.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want.sum().backward()
    for loss in (lambda x: rnnt_loss(x, targets, T, U, reduction=reduction), RNNTLoss(reduction=reduction)):
        x = logits.clone().requires_grad_()
        got = loss(x, targets, T, U) if isinstance(loss, RNNTLoss) else loss(x)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want.detach().to(dtype), rtol=0, atol=0)
        got.sum().backward()
        assert x.grad.dtype == dtype
        torch.testing.assert_close(x.grad, want_in.grad, rtol=0, atol=0)


class _FirstGradDropped(torch.autograd.Function):
    """(a, b) -> (a, b) whose backward gives ``a`` no gradient (None): autograd then hands a's maker an undefined
    incoming gradient."""

    @staticmethod
    def forward(ctx, a, b):
        return a.detach().clone(), b.clone()

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        return None, grad_b


@pytest.mark.parametrize("loss", [transducer_loss, rnnt_loss])
def test_undefined_incoming_gradient_gives_a_zero_gradient(loss):
    """Where autograd hands the loss's backward an undefined gradient (the loss unused by what backward runs
    through; gradcheck's check of undefined gradients), the logits get a defined zero gradient, as torchaudio's
    loss gives them: a hook on the logits sees a tensor, not None."""
    gen = torch.Generator().manual_seed(17)
    logits, targets, T, U = random_batch(gen, 3, 5, 3, 7, 0)
    x, y = logits.clone().requires_grad_(), torch.ones(2, requires_grad=True)
    _, other = _FirstGradDropped.apply(loss(x, targets, T, U, blank=0, reduction="none"), y)
    # the losses' backward runs with an undefined incoming gradient
    grad_x, grad_y = torch.autograd.grad(other.sum(), (x, y), allow_unused=True)
    assert grad_x is not None and torch.equal(grad_x, torch.zeros_like(x)) and torch.equal(grad_y, torch.ones(2))
    # reduction="none" with one entry used: that utterance's gradient, zeros for the others
    loss(x, targets, T, U, blank=0, reduction="none")[1].backward()
    assert x.grad[[0, 2]].eq(0).all() and x.grad[1].ne(0).any()
    seen = []
    x.register_hook(lambda g: seen.append(g))
    # gradcheck, whose check of undefined incoming gradients the hook sees
    seen.clear()
    assert torch.autograd.gradcheck(
        lambda z: loss(z, targets, T, U, blank=0, reduction="none"), (x,), check_undefined_grad=True
    )
    assert seen and all(g is not None for g in seen) and not seen[-1].any()


@pytest.mark.parametrize("device", DEVICES)
def test_rna_infeasible_is_inf_with_zero_gradient(device):
    gen = torch.Generator().manual_seed(3)
    logits, targets, T, U = random_batch(gen, 3, 6, 4, 7, blank=0)
    T[1], U[1] = 3, 4  # U > T - 1: no alignment
    U[0], U[2] = min(int(U[0]), 5), min(int(U[2]), int(T[2]) - 1)
    start, n = int(T[0] * (U[0] + 1)), int(T[1] * (U[1] + 1))
    rows = compact(logits, T, U).to(device).requires_grad_()
    targets, T, U = targets.to(device), T.to(device), U.to(device)
    losses = transducer_loss(rows, targets, T, U, reduction="none", one_sym_per_frame=True)
    assert math.isinf(losses[1].item()) and losses[1].item() > 0
    assert torch.isfinite(losses[[0, 2]]).all()
    losses.sum().backward()  # an infinite loss: its utterance gets zeros, never NaN
    assert not torch.isnan(rows.grad).any()
    assert (rows.grad[start : start + n] == 0).all()

    rows.grad = None
    zeroed = transducer_loss(rows, targets, T, U, reduction="sum", one_sym_per_frame=True, zero_infinity=True)
    zeroed.backward()
    torch.testing.assert_close(zeroed, losses[[0, 2]].sum())
    assert (rows.grad[start : start + n] == 0).all()
    assert (rows.grad[:start] != 0).any()


@pytest.mark.parametrize("device", DEVICES)
def test_module_matches_functional_and_inplace_grad(device):
    gen = torch.Generator().manual_seed(9)
    logits, targets, T, U = random_batch(gen, 3, 7, 4, 11, blank=1, dtype=torch.float32)
    rows = compact(logits, T, U).to(device)
    targets, T, U = targets.to(device), T.to(device), U.to(device)
    weight = torch.randn(11, 11, generator=gen).to(device)
    grads = []
    for inplace_grad in (False, True):
        x = rows.clone().requires_grad_()
        joined = x @ weight  # a non-leaf whose value nothing else needs in backward
        TransducerLoss(blank=1, reduction="sum", inplace_grad=inplace_grad)(joined, targets, T, U).backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0])
    assert grads[0].abs().sum() > 0
    x = rows.clone().requires_grad_()
    functional = transducer_loss(x @ weight, targets, T, U, blank=1, reduction="sum")
    functional.backward()
    torch.testing.assert_close(x.grad, grads[0])
    assert "blank=1" in repr(TransducerLoss(blank=1))


@pytest.mark.parametrize("device", DEVICES)
def test_losses_may_be_changed_in_place(device):
    gen = torch.Generator().manual_seed(32)
    logits, targets, T, U = random_batch(gen, 2, 5, 3, 6, blank=0)
    x = compact(logits, T, U).to(device).requires_grad_()
    targets, T, U = targets.to(device), T.to(device), U.to(device)
    losses = transducer_loss(x, targets, T, U, reduction="none")
    expected = torch.autograd.grad(losses.sum() / 2, x, retain_graph=True)[0]
    losses.div_(2)  # as torchaudio allows: normalise in place
    losses.sum().backward()
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_rnnt_loss_matches_torchaudio_cpu(device):
    ta = require("torchaudio.functional", "test")
    gen = torch.Generator().manual_seed(71)
    for case, (V, clamp, fused, reduction) in enumerate(
        [(17, -1, True, "mean"), (40, 0.2, True, "none"), (9, -1, False, "sum"), (30, 0.05, False, "mean")]
    ):
        logits, targets, T, U = random_batch(gen, 4, 9, 4, V, V - 1, dtype=torch.float32, scale=3.0)
        if not fused:
            logits = logits.log_softmax(-1)
        y, Ti, Ui = targets[:, : int(U.max())].int(), T.int(), U.int()
        ta_in = logits.clone().requires_grad_()
        want = ta.rnnt_loss(ta_in, y, Ti, Ui, blank=-1, clamp=clamp, reduction=reduction, fused_log_softmax=fused)
        weights = torch.rand(want.shape, generator=gen) + 0.5
        (want * weights).sum().backward()
        x = logits.to(device).requires_grad_()
        got = rnnt_loss(x, *to_device(device, y, Ti, Ui), clamp=clamp, reduction=reduction, fused_log_softmax=fused)
        (got * weights.to(device)).sum().backward()
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
        valid = cell_mask(logits, T, U)
        torch.testing.assert_close(x.grad.cpu()[valid], ta_in.grad[valid], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# On CUDA: against the reference and torchaudio's CUDA loss


# The oracle is the float64 reference. torchaudio 2.11's CUDA rnnt_loss returns 0 for an utterance with
# T_b == 1 or U_b == 0 inside a larger batch (its CPU path is right; README: "torchaudio's CUDA loss"), so it
# is only a second witness, on the other utterances. Every batch here has such utterances.
TA_CASES = [  # B, max_t, max_u, V, blank, reduction
    (4, 30, 10, 1024, 0, "none"),
    (8, 50, 20, 500, 0, "mean"),
    (3, 8, 4, 8192, 5, "sum"),
    (3, 2, 3, 17, 16, "none"),  # T <= 2
    (5, 12, 6, 4096, 4095, "mean"),
    (6, 20, 1, 2, 1, "none"),  # V = 2
    (3, 40, 15, 1000, 3, "sum"),  # V * 4 not a multiple of 16: narrower accesses
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", range(len(TA_CASES)))
def test_matches_reference_and_torchaudio_cuda(case):
    B, max_t, max_u, V, blank, reduction = TA_CASES[case]
    gen = torch.Generator().manual_seed(200 + case)
    logits, targets, T, U = random_batch(gen, B, max_t, max_u, V, blank, dtype=torch.float32, scale=3.0, edges=True)
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
        torch.testing.assert_close(x.grad, compact(want, T, U) if layout == "compact" else want, rtol=1e-4, atol=atol)
        reduced = transducer_loss(x.detach(), targets, T, U, blank=blank, reduction=reduction)
        want = {"none": ref, "sum": ref.sum(), "mean": ref.mean()}[reduction]
        torch.testing.assert_close(reduced.cpu().double(), want, rtol=1e-5, atol=1e-5)

    # the second witness, where it is right
    ta = require("torchaudio.functional", "test")
    ta_loss = ta.rnnt_loss(
        logits, targets[:, : int(U.max())].int().contiguous(), T.int(), U.int(), blank=blank, reduction="none"
    )
    right = ((T >= 2) & (U >= 1)).cpu()
    torch.testing.assert_close(ta_loss.cpu().double()[right], ref[right], rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_matches_torchaudio_without_fused_log_softmax_cuda():
    ta = require("torchaudio.functional", "test")
    gen = torch.Generator().manual_seed(5)
    logits, targets, T, U = random_batch(gen, 4, 10, 5, 300, blank=0, dtype=torch.float32, min_t=2, min_u=1)
    log_probs = logits.log_softmax(-1).to(DEV)
    targets, T, U = targets.to(DEV), T.to(DEV), U.to(DEV)
    ta_in = log_probs.clone().requires_grad_()
    expected = ta.rnnt_loss(
        ta_in,
        targets[:, : int(U.max())].int().contiguous(),
        T.int(),
        U.int(),
        blank=0,
        reduction="sum",
        fused_log_softmax=False,
    )
    expected.backward()
    ours = log_probs.clone().requires_grad_()
    got = transducer_loss(ours, targets, T, U, reduction="sum", from_log_softmax=True)
    got.backward()
    ref = transducer_loss_reference(log_probs.double().cpu(), targets.cpu(), T.cpu(), U.cpu(), from_log_softmax=True)
    torch.testing.assert_close(got.cpu().double(), ref.sum(), rtol=1e-5, atol=0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    for b in range(len(T)):
        torch.testing.assert_close(
            ours.grad[b, : T[b], : U[b] + 1], ta_in.grad[b, : T[b], : U[b] + 1], rtol=1e-4, atol=1e-6
        )


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["compact", "padded"])
@pytest.mark.parametrize("rna", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_gradcheck_cuda(layout, rna, reduction):
    gen = torch.Generator().manual_seed(len(layout) + 10 * rna + len(reduction))
    logits, targets, T, U = random_batch(gen, 3, 5, 3, 4, blank=2, dtype=torch.float64, rna=rna)
    if layout == "compact":
        logits = compact(logits, T, U)
    logits = logits.to(DEV).requires_grad_()
    targets, T, U = targets.to(DEV), T.to(DEV), U.to(DEV)
    assert torch.autograd.gradcheck(
        lambda x: transducer_loss(x, targets, T, U, blank=2, reduction=reduction, one_sym_per_frame=rna),
        (logits,),
        eps=1e-6,
        atol=1e-7,
        rtol=1e-5,
    )


@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(6))
def test_matches_reference_float64_cuda(seed):
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
