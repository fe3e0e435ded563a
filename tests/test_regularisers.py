"""FastEmit, the delay penalty and the gradient clamp on every device against the float64 reference, their options
checked, and rnnt_loss / RNNTLoss taking them."""

import math

import pytest
import torch
from _batches import DEVICES, compact, random_batch, to_device

from transducer import RNNTLoss, rnnt_loss, transducer_loss, transducer_loss_reference

CASES = [(layout, rna, fls) for layout in ("compact", "padded") for rna in (False, True) for fls in (False, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout,rna,from_log_softmax", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fastemit_and_delay_penalty_match_reference(device, layout, rna, from_log_softmax, dtype):
    seed = 60 + CASES.index((layout, rna, from_log_softmax))
    blank = seed % 3
    gen = torch.Generator().manual_seed(seed)
    logits, targets, T, U = random_batch(gen, 5, 7, 4, 9, blank, rna=rna, scale=2.0, edges=True)
    w = torch.rand(5, generator=gen, dtype=torch.float64) + 0.5
    if from_log_softmax:
        logits = logits.log_softmax(-1)
    tol = (
        (dict(rtol=1e-10, atol=1e-10), dict(rtol=1e-9, atol=1e-10))
        if dtype == torch.float64
        else (dict(rtol=1e-5, atol=1e-5), dict(rtol=1e-4, atol=1e-5))
    )
    for lam, dp in ((0.5, 0.0), (0.0, 0.25), (0.3, -0.2)):
        ref_in = logits.clone().requires_grad_()
        ref = transducer_loss_reference(
            ref_in,
            targets,
            T,
            U,
            blank,
            one_sym_per_frame=rna,
            from_log_softmax=from_log_softmax,
            fastemit_lambda=lam,
            delay_penalty=dp,
        )
        (ref * w).sum().backward()
        x = (compact(logits, T, U) if layout == "compact" else logits).to(device, dtype).clone().requires_grad_()
        got = transducer_loss(
            x,
            *to_device(device, targets, T, U),
            blank=blank,
            reduction="none",
            one_sym_per_frame=rna,
            from_log_softmax=from_log_softmax,
            fastemit_lambda=lam,
            delay_penalty=dp,
        )
        torch.testing.assert_close(got.cpu().double(), ref.detach(), **tol[0])
        (got * w.to(device, got.dtype)).sum().backward()
        want = compact(ref_in.grad, T, U) if layout == "compact" else ref_in.grad
        torch.testing.assert_close(x.grad.cpu().double(), want, **tol[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("from_log_softmax", [False, True])
def test_clamp_clamps_the_unit_gradient_then_scales(device, from_log_softmax):
    gen = torch.Generator().manual_seed(70)
    logits, targets, T, U = random_batch(gen, 5, 7, 4, 9, 0, scale=2.0, edges=True)
    w = torch.rand(5, generator=gen, dtype=torch.float64) + 0.5
    logits = logits * 3
    if from_log_softmax:
        logits = logits.log_softmax(-1)
    # the unit gradient of each utterance (rows are per utterance, so the gradient of the sum has them all)
    ref_in = logits.clone().requires_grad_()
    transducer_loss_reference(ref_in, targets, T, U, from_log_softmax=from_log_softmax).sum().backward()
    unit = compact(ref_in.grad, T, U)
    row_weight = torch.repeat_interleave(w, T * (U + 1))[:, None]
    c = 0.05
    assert (unit.abs() > c).any() and (unit.abs() < c).any()
    x = compact(logits, T, U).to(device).requires_grad_()
    got = transducer_loss(
        x, *to_device(device, targets, T, U), reduction="none", from_log_softmax=from_log_softmax, clamp=c
    )
    (got * w.to(device)).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), unit.clamp(-c, c) * row_weight, rtol=1e-9, atol=1e-12)
    # no clamp for clamp <= 0
    x.grad = None
    (
        transducer_loss(
            x, *to_device(device, targets, T, U), reduction="none", from_log_softmax=from_log_softmax, clamp=0.0
        )
        * w.to(device)
    ).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), unit * row_weight, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(clamp="1"), TypeError, "clamp: expected a number"),
        (dict(fastemit_lambda=-0.1), ValueError, r"fastemit_lambda: expected a number in \[0, 65503\]"),
        (dict(fastemit_lambda=math.nan), ValueError, "fastemit_lambda: expected a number, not NaN"),
        (dict(delay_penalty=None), TypeError, "delay_penalty: expected a number"),
        (dict(delay_penalty=True), TypeError, "delay_penalty: expected a number"),
        (dict(delay_penalty=-math.inf), ValueError, "delay_penalty: expected a finite number"),
        (dict(fastemit_lambda=math.inf), ValueError, r"fastemit_lambda: expected a number in \[0, 65503\]"),
    ],
)
def test_bad_regulariser_options(kwargs, error, match):
    gen = torch.Generator().manual_seed(72)
    logits, targets, T, U = random_batch(gen, 5, 7, 4, 9, 0, scale=2.0, edges=True)
    with pytest.raises(error, match=match):
        transducer_loss(logits, targets, T, U, **kwargs)


def test_rnnt_loss_and_module_take_the_regularisers():
    gen = torch.Generator().manual_seed(74)
    # rnnt_loss's blank = -1 is the last index, 8
    logits, targets, T, U = random_batch(gen, 5, 7, 4, 9, 8, scale=2.0, edges=True)
    want = transducer_loss(logits, targets, T, U, blank=8, delay_penalty=0.2, fastemit_lambda=0.3, reduction="sum")
    got = rnnt_loss(logits, targets, T, U, delay_penalty=0.2, fastemit_lambda=0.3, reduction="sum")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    module = RNNTLoss(reduction="sum", delay_penalty=0.2, fastemit_lambda=0.3)
    torch.testing.assert_close(module(logits, targets, T, U), want, rtol=0, atol=0)
    assert "delay_penalty=0.2" in repr(module)
    with pytest.raises(ValueError, match=r"fastemit_lambda: expected a number in \[0, 65503\]"):
        RNNTLoss(fastemit_lambda=-1)
