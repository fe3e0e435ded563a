"""Logits far outside the usual range: the loss stays what the float64 reference computes, and a finite loss has a
finite gradient, bounded as the gradient is (each entry within 1 + fastemit_lambda), for every lattice and the fused
loss; a FastEmit lambda whose gradient cannot be finite is refused."""

import pytest
import torch
from _batches import DEVICES, random_batch, to_device

from transducer import (
    fused_joiner_loss,
    multiblank_loss,
    multiblank_loss_reference,
    tdt_loss,
    tdt_loss_reference,
    transducer_loss,
    transducer_loss_reference,
)

DURATIONS = [0, 1, 2]
BIG_BLANKS = [2, 3]
V = 6  # token columns; the multi-blank loss's blank is the last, its big blanks the two before
# logits at these scales have log Z whose rounding, |log Z| * eps, exceeds 1: the posteriors alpha + beta - log Z
# round above 0, where exp overflowed and the gradient got inf - inf
SCALES = [(torch.float32, 1e10), (torch.float64, 1e20)]
LOSSES = ["rnnt", "rna", "tdt", "multiblank"]


def _loss(kind, logits, targets, T, U, **kw):
    if kind in ("rnnt", "rna"):
        return transducer_loss(logits, targets, T, U, reduction="none", one_sym_per_frame=kind == "rna", **kw)
    if kind == "tdt":
        return tdt_loss(logits, targets, T, U, durations=DURATIONS, reduction="none", **kw)
    return multiblank_loss(logits, targets, T, U, big_blank_durations=BIG_BLANKS, blank=-1, reduction="none", **kw)


def _reference(kind, logits, targets, T, U, lam):
    if kind in ("rnnt", "rna"):
        return transducer_loss_reference(logits, targets, T, U, one_sym_per_frame=kind == "rna", fastemit_lambda=lam)
    if kind == "tdt":
        return tdt_loss_reference(logits, targets, T, U, DURATIONS, fastemit_lambda=lam)
    return multiblank_loss_reference(logits, targets, T, U, BIG_BLANKS, V - 1, fastemit_lambda=lam)


def _batch(kind, dtype, scale, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blank = list(range(V - 1 - len(BIG_BLANKS), V)) if kind == "multiblank" else 0
    return random_batch(
        gen,
        3,
        6,
        3,
        V,
        blank,
        dtype,
        rna=kind == "rna",
        scale=scale,
        min_t=2,
        extra=len(DURATIONS) if kind == "tdt" else 0,
    )


def _check_gradient(grad, lam, tol):
    assert torch.isfinite(grad).all()
    assert grad.abs().max() <= 1 + lam + tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("dtype, scale", SCALES)
@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_large_logits_give_a_finite_gradient(device, kind, dtype, scale, lam):
    logits, targets, T, U = _batch(kind, dtype, scale)
    x = logits.to(device).requires_grad_()
    loss = _loss(kind, x, *to_device(device, targets, T, U), fastemit_lambda=lam)
    loss.sum().backward()
    want = _reference(kind, logits.double(), targets, T, U, 0.0)
    assert torch.isfinite(want).all()
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(loss.cpu().double(), want, rtol=rtol, atol=0)
    _check_gradient(x.grad, lam, 1e-5)


@pytest.mark.parametrize("kind", LOSSES)
def test_gradient_where_the_posteriors_are_resolved(kind):
    """Below that scale the cap on the posteriors changes nothing: fp32 logits of a few tens match the reference."""
    logits, targets, T, U = _batch(kind, torch.float32, 30.0, seed=1)
    x = logits.clone().requires_grad_()
    _loss(kind, x, targets, T, U, fastemit_lambda=0.5).sum().backward()
    x64 = logits.double().requires_grad_()
    _reference(kind, x64, targets, T, U, 0.5).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=0, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "options",
    [{}, {"one_sym_per_frame": True}, {"durations": DURATIONS}, {"big_blank_durations": BIG_BLANKS, "blank": V - 1}],
)
@pytest.mark.parametrize("dtype, scale", SCALES)
def test_fused_loss_at_large_scales(device, options, dtype, scale):
    """The fused loss over a projection scaled so that its logits reach the scales above, in tiles of a few rows:
    the unfused loss of the same logits, and finite gradients for the encoder, predictor and weight."""
    gen = torch.Generator().manual_seed(2)
    B, max_t, max_u, J = 3, 6, 3, 8
    T, U = torch.tensor([6, 4, 3]), torch.tensor([3, 2, 0])
    targets = torch.randint(1, V - len(BIG_BLANKS) - 1, (B, max_u), generator=gen)
    rows = V + (len(DURATIONS) if "durations" in options else 0)
    enc = torch.randn(B, max_t, J, generator=gen, dtype=dtype, device="cpu").to(device).requires_grad_()
    pred = torch.randn(B, max_u + 1, J, generator=gen, dtype=dtype, device="cpu").to(device).requires_grad_()
    weight = (torch.randn(rows, J, generator=gen, dtype=dtype) * scale).to(device).requires_grad_()
    targets, T, U = to_device(device, targets, T, U)
    loss = fused_joiner_loss(enc, pred, weight, None, targets, T, U, reduction="none", max_rows=5, **options)
    grads = torch.autograd.grad(loss.sum(), (enc, pred, weight))
    assert all(torch.isfinite(g).all() for g in grads)
    logits = torch.tanh(enc[:, :, None] + pred[:, None]) @ weight.t()
    if "durations" in options:
        want = tdt_loss(logits, targets, T, U, reduction="none", **options)
    elif "big_blank_durations" in options:
        want = multiblank_loss(logits, targets, T, U, reduction="none", **options)
    else:
        want = transducer_loss(logits, targets, T, U, reduction="none", **options)
    torch.testing.assert_close(loss, want, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0)


def test_fastemit_lambda_bound():
    """1 + fastemit_lambda bounds the gradient's entries: the largest lambda keeps them finite in float16; one
    above is refused, as is 1e308 (whose gradient was NaN)."""
    logits, targets, T, U = _batch("rnnt", torch.float32, 1.0)
    for lam in (65504.0, 1e308):
        with pytest.raises(ValueError, match=r"fastemit_lambda: expected a number in \[0, 65503\]"):
            transducer_loss(logits, targets, T, U, fastemit_lambda=lam)
    for dtype in (torch.float16, torch.float32):
        x = logits.to(dtype).requires_grad_()
        loss = transducer_loss(x, targets, T, U, fastemit_lambda=65503.0, reduction="sum")
        assert torch.isfinite(loss)
        loss.backward()
        _check_gradient(x.grad.float(), 65503.0, 65504 * 1e-3)
