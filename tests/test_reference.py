"""The float64 references, the oracles of every other test: the TDT reference against a brute-force sum over
alignments (and the CPU loss against the same sum), gradcheck, omega, infeasible utterances and FastEmit; the
RNN-T reference's delay penalty and FastEmit."""

import math

import pytest
import torch
from _batches import random_batch

from transducer import tdt_loss, tdt_loss_reference, transducer_loss_reference

# ---------------------------------------------------------------------------------------------------------
# TDT


def brute_force(logits, y, T, U, durations, blank, sigma):
    """-log sum over every complete TDT alignment, enumerated one by one in plain Python floats; and their count."""
    D = len(durations)
    V = len(logits[0][0]) - D

    def lse(xs):
        m = max(xs)
        return m + math.log(sum(math.exp(x - m) for x in xs))

    def tok(t, u, v):
        return logits[t][u][v] - lse(logits[t][u][:V]) - sigma

    def dur(t, u, i):
        return logits[t][u][V + i] - lse(logits[t][u][V:])

    complete = []  # the total log-weight of each complete alignment

    def walk(t, u, weight):
        for i, d in enumerate(durations):
            if u < U and t + d < T:
                walk(t + d, u + 1, weight + tok(t, u, y[u]) + dur(t, u, i))
            if d >= 1:
                w = weight + tok(t, u, blank) + dur(t, u, i)
                if t + d < T:
                    walk(t + d, u, w)
                elif t + d == T and u == U:
                    complete.append(w)

    walk(0, 0, 0.0)
    return (-lse(complete) if complete else math.inf), len(complete)


@pytest.mark.parametrize(
    "durations, T, U, blank, sigma",
    [
        ([0, 1, 2, 3], 4, 2, 0, 0.0),
        ([1, 3], 5, 1, 2, 0.0),
        ([0, 2, 3], 5, 2, 1, 0.07),
        ([3, 0, 1], 3, 3, 3, 0.0),  # unsorted durations, U_b = T_b (labels of duration 0 needed)
        ([1], 3, 1, 0, 0.0),  # a one-label RNA-like grid
    ],
)
def test_tdt_reference_equals_brute_force(durations, T, U, blank, sigma):
    gen = torch.Generator().manual_seed(T * 10 + U)
    V = 4
    logits = torch.randn(1, T, U + 1, V + len(durations), generator=gen, dtype=torch.float64)
    targets = torch.tensor([[v for v in range(V) if v != blank][(3 * u + 1) % (V - 1)] for u in range(U)] or [[0]])
    targets = targets.reshape(1, -1)
    expected, count = brute_force(logits[0].tolist(), targets[0].tolist(), T, U, durations, blank, sigma)
    assert count > 1  # a real sum over alignments
    got = tdt_loss_reference(logits, targets, torch.tensor([T]), torch.tensor([U]), durations, blank, sigma)
    assert got.dtype == torch.float64
    assert abs(float(got[0]) - expected) <= 1e-12 * max(1.0, abs(expected))
    # the CPU loss (its stages) gives the same sum
    loss = tdt_loss(logits, targets, torch.tensor([T]), torch.tensor([U]), durations, blank, sigma, reduction="none")
    assert abs(float(loss[0]) - expected) <= 1e-12 * max(1.0, abs(expected))


def test_tdt_brute_force_counts_alignments():
    # durations [0, 1], T = 2, U = 1: label at t=0 (d 0 or 1) or t=1 (d 0), blanks of duration 1 elsewhere:
    # (0,0)-y/0->(0,1)-b->(1,1)-b->end, (0,0)-y/1->(1,1)-b->end, (0,0)-b->(1,0)-y/0->(1,1)-b->end
    logits = torch.randn(2, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).tolist()
    assert brute_force(logits, [1], 2, 1, [0, 1], 0, 0.0)[1] == 3


@pytest.mark.parametrize(
    "durations, blank, sigma, omega",
    [
        ([0, 1, 2, 3, 4], 0, 0.0, 0.0),
        ([1, 2], 2, 0.05, 0.0),
        ([1, 3, 4], 1, 0.0, 0.4),
        ([0, 2, 1], 3, 0.1, 0.25),
    ],
)
def test_tdt_reference_gradcheck(durations, blank, sigma, omega):
    gen = torch.Generator().manual_seed(len(durations) + blank)
    V = 4
    logits, targets, T, U = random_batch(gen, 3, 4, 2, V, blank, edges=True, extra=len(durations))
    U = torch.minimum(U, T - 1)  # every utterance feasible, also without a duration 0
    T[1], U[1] = 4, 1
    loss = tdt_loss_reference(logits, targets, T, U, durations, blank, sigma, omega)
    assert torch.isfinite(loss).all()
    logits.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: tdt_loss_reference(x, targets, T, U, durations, blank, sigma, omega), (logits,), fast_mode=True
    )


def test_tdt_reference_omega_mixes_the_rnnt_loss():
    gen = torch.Generator().manual_seed(3)
    V, durations, blank = 5, [0, 1, 2], 4
    logits, targets, T, U = random_batch(gen, 3, 5, 3, V, blank, scale=1.5, edges=True, extra=len(durations))
    tdt = tdt_loss_reference(logits, targets, T, U, durations, blank, sigma=0.1)
    rnnt = transducer_loss_reference(logits[..., :V], targets, T, U, blank)
    mixed = tdt_loss_reference(logits, targets, T, U, durations, blank, sigma=0.1, omega=0.3)
    torch.testing.assert_close(mixed, 0.7 * tdt + 0.3 * rnnt, rtol=1e-13, atol=1e-13)
    # omega = 1: the RNN-T loss alone
    only = tdt_loss_reference(logits, targets, T, U, durations, blank, sigma=0.1, omega=1.0)
    torch.testing.assert_close(only, rnnt, rtol=1e-13, atol=1e-13)


def test_tdt_reference_infeasible_utterances():
    gen = torch.Generator().manual_seed(5)
    V = 3
    cases = [  # (durations, T, U): no complete alignment
        ([2], 3, 0),  # blanks of duration 2 never end on T = 3
        ([1, 2], 2, 2),  # every arc advances a frame: U + 1 <= T needed
        ([0, 2], 3, 1),  # every path lands on an even frame, the end T = 3 is odd
        ([0, 2, 3], 1, 0),  # the only closing blank from (0, 0) would need duration 1
    ]
    for durations, T, U in cases:
        logits = torch.randn(2, max(T, 4), U + 1, V + len(durations), generator=gen, dtype=torch.float64)
        targets = torch.ones(2, max(U, 1), dtype=torch.long)
        Ts, Us = torch.tensor([T, 4]), torch.tensor([U, 0])
        loss = tdt_loss_reference(logits, targets, Ts, Us, durations, 0)
        assert brute_force(logits[0].tolist(), [1] * U, T, U, durations, 0, 0.0) == (math.inf, 0)
        assert loss[0] == math.inf
        assert math.isfinite(float(loss[1]))  # T = 4, U = 0 is feasible for each
        # the CPU loss agrees, with zero gradient for the infeasible utterance (whatever omega)
        for omega in (0.0, 0.5):
            x = logits.clone().requires_grad_()
            got = tdt_loss(x, targets, Ts, Us, durations, 0, omega=omega, fastemit_lambda=0.3, reduction="none")
            (grad,) = torch.autograd.grad(got.sum(), x)
            r = logits.clone().requires_grad_()
            ref = tdt_loss_reference(r, targets, Ts, Us, durations, 0, omega=omega, fastemit_lambda=0.3)
            (ref_grad,) = torch.autograd.grad(ref[1], r)  # the finite loss alone
            assert got[0] == math.inf and ref[0] == math.inf
            assert not grad[0].any()
            torch.testing.assert_close(got.detach(), ref.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)


def test_tdt_reference_fastemit_scales_the_label_token_log_prob_gradient():
    # The gradient w.r.t. the token log-probs, which tdt_loss_reference (taking logits) does not expose: its
    # private core, on log-probs, is called directly.
    from transducer.reference import tdt_loss_from_log_probs

    gen = torch.Generator().manual_seed(13)
    V, durations, blank = 5, [0, 1, 2, 4], 3
    logits, targets, T, U = random_batch(gen, 4, 6, 3, V, blank, scale=1.5, edges=True, extra=len(durations))
    tok = (logits[..., :V].log_softmax(-1) - 0.1).requires_grad_()
    dur = logits[..., V:].log_softmax(-1).requires_grad_()
    lam = 0.7
    grads = {}
    for value in (0.0, lam):
        loss = tdt_loss_from_log_probs(tok, dur, targets, T, U, durations, blank, value)
        grads[value] = torch.autograd.grad(loss.sum(), (tok, dur)) + (loss.detach(),)
    torch.testing.assert_close(grads[lam][2], grads[0.0][2], rtol=0, atol=0)  # the value is unchanged
    torch.testing.assert_close(grads[lam][1], grads[0.0][1], rtol=1e-14, atol=1e-14)  # durations unchanged
    is_label = torch.zeros(tok.shape, dtype=torch.bool)
    for b in range(len(T)):
        for u in range(int(U[b])):
            is_label[b, : T[b], u, targets[b, u]] = True
    expected = torch.where(is_label, (1 + lam) * grads[0.0][0], grads[0.0][0])
    torch.testing.assert_close(grads[lam][0], expected, rtol=1e-13, atol=1e-14)
    assert grads[0.0][0][is_label].abs().sum() > 0.1  # the label entries are not all zero
    # through the public reference, the value is unchanged too
    torch.testing.assert_close(
        tdt_loss_reference(logits, targets, T, U, durations, blank, 0.1, 0.2, lam),
        tdt_loss_reference(logits, targets, T, U, durations, blank, 0.1, 0.2),
        rtol=0,
        atol=0,
    )


# ---------------------------------------------------------------------------------------------------------
# RNN-T and RNA: the regularisers


def test_reference_delay_penalty_gradcheck():
    gen = torch.Generator().manual_seed(50)
    logits, targets, T, U = random_batch(gen, 5, 7, 4, 9, 0, rna=True, scale=2.0, edges=True)  # feasible for RNA
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
    gen = torch.Generator().manual_seed(52)
    logits, targets, T, U = random_batch(gen, 5, 7, 4, 9, 0, rna=rna, scale=2.0, edges=True)
    w = torch.rand(5, generator=gen, dtype=torch.float64) + 0.5
    lp = logits.log_softmax(-1)
    grads = []
    for lam in (0.0, 0.7):
        x = lp.clone().requires_grad_()
        loss = transducer_loss_reference(
            x, targets, T, U, one_sym_per_frame=rna, from_log_softmax=True, fastemit_lambda=lam
        )
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
