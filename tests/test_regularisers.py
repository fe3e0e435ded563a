"""FastEmit, the delay penalty and the gradient clamp, on every device, against the float64 reference."""

import math

import pytest
import torch

from _batches import DEVICES, compact, random_batch
from transducer import RNNTLoss, rnnt_loss, transducer_loss, transducer_loss_reference


def to(device, *tensors):
    return tuple(t.to(device) for t in tensors)


def ragged_batch(seed, rna=False, dtype=torch.float64, V=9, blank=0):
    """A random ragged batch with a U_b = 0 and a T_b = 1 utterance."""
    gen = torch.Generator().manual_seed(seed)
    logits, targets, T, U = random_batch(gen, 5, 7, 4, V, blank, dtype=dtype, rna=rna, scale=2.0)
    T[1], U[1] = 5, 0
    T[2], U[2] = 1, 0
    return logits, targets, T, U, torch.rand(5, generator=gen, dtype=torch.float64) + 0.5


def test_reference_delay_penalty_gradcheck():
    logits, targets, T, U, _ = ragged_batch(50, rna=True)  # feasible for RNA too
    x = logits.requires_grad_()
    for rna in (False, True):
        f = lambda x: transducer_loss_reference(x, targets, T, U, one_sym_per_frame=rna, delay_penalty=0.3)  # noqa
        assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_reference_delay_penalty_value():
    # one utterance, T = 3, U = 1: the label moves (t, 0) -> (t, 1) and costs delay_penalty * (1 - t)
    logits = torch.randn(1, 3, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(51))
    targets, T, U = torch.tensor([[2]]), torch.tensor([3]), torch.tensor([1])
    lp = logits.log_softmax(-1)[0]
    paths = [lp[:t, 0, 0].sum() + lp[t, 0, 2] + 0.4 * (1 - t) + lp[t:, 1, 0].sum() for t in range(3)]
    want = -torch.logsumexp(torch.stack(paths), 0)
    got = transducer_loss_reference(logits, targets, T, U, delay_penalty=0.4)
    torch.testing.assert_close(got[0], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rna", [False, True])
def test_reference_fastemit_scales_label_gradients(rna):
    # with log-probs in, FastEmit's gradient is the plain one with its label entries times 1 + lambda
    logits, targets, T, U, w = ragged_batch(52, rna=rna)
    lp = logits.log_softmax(-1)
    grads = []
    for lam in (0.0, 0.7):
        x = lp.clone().requires_grad_()
        loss = transducer_loss_reference(x, targets, T, U, one_sym_per_frame=rna, from_log_softmax=True,
                                         fastemit_lambda=lam)
        (loss * w).sum().backward()
        grads.append((loss.detach(), x.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-14, atol=0)  # the value is unchanged
    label = torch.zeros(lp.shape, dtype=torch.bool)
    for b in range(len(T)):
        for u in range(int(U[b])):
            label[b, :, u, targets[b, u]] = True
    torch.testing.assert_close(grads[1][1][label], 1.7 * grads[0][1][label], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads[1][1][~label], grads[0][1][~label], rtol=1e-12, atol=1e-14)
    assert grads[0][1][label].abs().sum() > 0


CASES = [(layout, rna, fls) for layout in ("compact", "padded") for rna in (False, True) for fls in (False, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout,rna,from_log_softmax", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fastemit_and_delay_penalty_match_reference(device, layout, rna, from_log_softmax, dtype):
    seed = 60 + CASES.index((layout, rna, from_log_softmax))
    logits, targets, T, U, w = ragged_batch(seed, rna=rna, blank=seed % 3)
    blank = seed % 3
    if from_log_softmax:
        logits = logits.log_softmax(-1)
    tol = (dict(rtol=1e-10, atol=1e-10), dict(rtol=1e-9, atol=1e-10)) if dtype == torch.float64 else \
        (dict(rtol=1e-5, atol=1e-5), dict(rtol=1e-4, atol=1e-5))
    for lam, dp in ((0.5, 0.0), (0.0, 0.25), (0.3, -0.2)):
        ref_in = logits.clone().requires_grad_()
        ref = transducer_loss_reference(ref_in, targets, T, U, blank, one_sym_per_frame=rna,
                                        from_log_softmax=from_log_softmax, fastemit_lambda=lam, delay_penalty=dp)
        (ref * w).sum().backward()
        x = (compact(logits, T, U) if layout == "compact" else logits).to(device, dtype).clone().requires_grad_()
        got = transducer_loss(x, *to(device, targets, T, U), blank=blank, reduction="none", one_sym_per_frame=rna,
                              from_log_softmax=from_log_softmax, fastemit_lambda=lam, delay_penalty=dp)
        torch.testing.assert_close(got.cpu().double(), ref.detach(), **tol[0])
        (got * w.to(device, got.dtype)).sum().backward()
        want = compact(ref_in.grad, T, U) if layout == "compact" else ref_in.grad
        torch.testing.assert_close(x.grad.cpu().double(), want, **tol[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("from_log_softmax", [False, True])
def test_clamp_clamps_the_unit_gradient_then_scales(device, from_log_softmax):
    logits, targets, T, U, w = ragged_batch(70)
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
    got = transducer_loss(x, *to(device, targets, T, U), reduction="none", from_log_softmax=from_log_softmax, clamp=c)
    (got * w.to(device)).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), unit.clamp(-c, c) * row_weight, rtol=1e-9, atol=1e-12)
    # no clamp for clamp <= 0
    x.grad = None
    (transducer_loss(x, *to(device, targets, T, U), reduction="none", from_log_softmax=from_log_softmax,
                     clamp=0.0) * w.to(device)).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), unit * row_weight, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_rnnt_loss_matches_torchaudio_cpu(device):
    from _imports import require
    ta = require("torchaudio.functional", "test")
    gen = torch.Generator().manual_seed(71)
    for case, (V, clamp, fused, reduction) in enumerate([(17, -1, True, "mean"), (40, 0.2, True, "none"),
                                                         (9, -1, False, "sum"), (30, 0.05, False, "mean")]):
        logits, targets, T, U = random_batch(gen, 4, 9, 4, V, V - 1, dtype=torch.float32, scale=3.0)
        if not fused:
            logits = logits.log_softmax(-1)
        y, Ti, Ui = targets[:, :int(U.max())].int(), T.int(), U.int()
        ta_in = logits.clone().requires_grad_()
        want = ta.rnnt_loss(ta_in, y, Ti, Ui, blank=-1, clamp=clamp, reduction=reduction, fused_log_softmax=fused)
        weights = torch.rand(want.shape, generator=gen) + 0.5
        (want * weights).sum().backward()
        x = logits.to(device).requires_grad_()
        got = rnnt_loss(x, *to(device, y, Ti, Ui), clamp=clamp, reduction=reduction, fused_log_softmax=fused)
        (got * weights.to(device)).sum().backward()
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
        valid = torch.zeros(logits.shape[:3], dtype=torch.bool)
        for b in range(len(T)):
            valid[b, :T[b], :U[b] + 1] = True
        torch.testing.assert_close(x.grad.cpu()[valid], ta_in.grad[valid], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(clamp="1"), TypeError, "clamp: expected a number"),
    (dict(fastemit_lambda=-0.1), ValueError, "fastemit_lambda: expected a number >= 0"),
    (dict(fastemit_lambda=math.nan), TypeError, "fastemit_lambda: expected a number"),
    (dict(delay_penalty=None), TypeError, "delay_penalty: expected a number"),
    (dict(delay_penalty=True), TypeError, "delay_penalty: expected a number"),
    (dict(delay_penalty=-math.inf), ValueError, "delay_penalty: expected a finite number"),
    (dict(fastemit_lambda=math.inf), ValueError, "fastemit_lambda: expected a number >= 0, and finite"),
])
def test_bad_regulariser_options(kwargs, error, match):
    logits, targets, T, U, _ = ragged_batch(72)
    with pytest.raises(error, match=match):
        transducer_loss(logits, targets, T, U, **kwargs)


def test_rnnt_loss_bad_blank():
    logits, targets, T, U, _ = ragged_batch(73)
    with pytest.raises(ValueError, match=r"blank: expected an int in \[-9, 9\)"):
        rnnt_loss(logits, targets, T, U, blank=9)
    with pytest.raises(ValueError, match="blank: expected an int .*, got 1.5"):
        RNNTLoss(blank=1.5)
    with pytest.raises(ValueError, match=r"blank: expected an int in \[-9, 9\)"):
        rnnt_loss(logits, targets, T, U, blank=-10)


def test_rnnt_loss_and_module_take_the_regularisers():
    from transducer import RNNTLoss
    logits, targets, T, U, w = ragged_batch(74, blank=8)  # rnnt_loss: blank = -1, the last index
    want = transducer_loss(logits, targets, T, U, blank=8, delay_penalty=0.2, fastemit_lambda=0.3, reduction="sum")
    got = rnnt_loss(logits, targets, T, U, delay_penalty=0.2, fastemit_lambda=0.3, reduction="sum")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    module = RNNTLoss(reduction="sum", delay_penalty=0.2, fastemit_lambda=0.3)
    torch.testing.assert_close(module(logits, targets, T, U), want, rtol=0, atol=0)
    assert "delay_penalty=0.2" in repr(module)
    with pytest.raises(ValueError, match="fastemit_lambda: expected a number >= 0"):
        RNNTLoss(fastemit_lambda=-1)
