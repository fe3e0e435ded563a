"""Tests of the Token-and-Duration Transducer (TDT) loss: the autograd reference (brute force, gradcheck,
infeasible and non-finite utterances, FastEmit) and the stages (the TDT part of transducer.cpu, and of
transducer.cuda on the GPU, twins with one signature) against it."""

import itertools
import math

import pytest
import torch

from _batches import DEVICES
from transducer import cpu
from transducer.checks import check_durations
from transducer.cpu import tdt_alpha_beta, tdt_log_probs
from transducer.layout import Lattice, LossOptions, stages_for
from transducer.reference import _tdt_loss_from_log_probs, tdt_loss_reference, transducer_loss_reference


def _batch(gen, B, max_t, max_u, V, durations, blank, dtype=torch.float64, scale=1.5):
    """Padded logits (B, maxT, maxU+1, V + D), targets avoiding blank, ragged lengths: utterance 0 at the
    maxima, one with T_b = 1 and one with U_b = 0 (when B allows)."""
    T = torch.randint(1, max_t + 1, (B,), generator=gen)
    U = torch.randint(0, max_u + 1, (B,), generator=gen)
    T[0], U[0] = max_t, max_u
    if B > 1:
        T[1] = 1
    if B > 2:
        U[2] = 0
    labels = torch.tensor([v for v in range(V) if v != blank])
    targets = labels[torch.randint(0, len(labels), (B, max(max_u, 1)), generator=gen)]
    W = V + len(durations)
    logits = torch.randn(B, max_t, int(U.max()) + 1, W, generator=gen, dtype=torch.float64) * scale
    return logits.to(dtype), targets, T, U


def _cell_mask(shape, T, U):
    mask = torch.zeros(shape[:3], dtype=torch.bool)
    for b in range(len(T)):
        mask[b, :T[b], :U[b] + 1] = True
    return mask


def _stages(logits, targets, T, U, durations, blank, V, sigma=0.0, omega=0.0, lam=0.0, scale=None, padded=True,
            alias=False, device="cpu"):
    """The loss (B,) and the gradient of sum_b scale[b] * loss[b] (padded like logits, zeros on padding) from
    the stages of ``device`` (transducer.cpu or transducer.cuda, twins): tdt_log_probs, tdt_alpha_beta,
    (alpha_beta for omega), tdt_gradient; returned on the CPU."""
    stages = stages_for(torch.device(device))
    B, max_t, max_u1, W = logits.shape
    mask = _cell_mask(logits.shape, T, U)
    if padded:
        logits2d = logits.masked_fill(~mask[..., None], math.nan).reshape(-1, W)  # padding must not be read
    else:
        logits2d = logits[mask]  # cells in (b, t, u) order: the compact layout
    logits2d, targets, T, U = (x.to(device) for x in (logits2d, targets, T, U))
    if padded:
        layout = stages.layout(T, U, max_u1, padded_t=max_t, targets=targets, vocab_size=V, blank=blank)
    else:
        layout = stages.layout(T, U, targets.size(1) + 1, targets=targets, vocab_size=V, blank=blank)
    assert int(layout.stats[-1]) == 0
    options = LossOptions(blank=blank, durations=tuple(durations), sigma=sigma, omega=omega, fastemit_lambda=lam)
    lp, lp_dur, den = stages.tdt_log_probs(logits2d[:, :V], logits2d[:, V:], targets, layout, options)
    alpha, beta, loss = stages.tdt_alpha_beta(lp, lp_dur, layout, options)
    rnnt, total = None, loss
    if omega:
        rnnt = stages.alpha_beta(lp + sigma, layout, options)
        total = (1 - omega) * loss + omega * rnnt.nll
    scale = torch.ones(B, dtype=lp.dtype) if scale is None else scale
    out = logits2d if alias else torch.empty_like(logits2d)
    lattice = Lattice(layout, lp, den, alpha, beta, loss, lp_dur, rnnt)
    stages.tdt_gradient(logits2d[:, :V], logits2d[:, V:], targets, lattice, scale.to(device), options, out[:, :V],
                        out[:, V:])
    out, total = out.cpu(), total.cpu()
    if padded:
        grad = out.view(logits.shape)
        assert not grad[~mask].any()  # zeros on padding rows
    else:
        grad = torch.zeros(logits.shape, dtype=out.dtype)
        grad[mask] = out
    return total, grad


def _reference(logits, targets, T, U, durations, blank, sigma=0.0, omega=0.0, lam=0.0, scale=None):
    """The float64 reference loss and its autograd gradient of sum_b scale[b] * loss[b] over the utterances with a
    finite loss (zeros for the others, as the stages give)."""
    x = logits.detach().double().requires_grad_()
    loss = tdt_loss_reference(x, targets, T, U, durations, blank, sigma, omega, lam)
    scale = torch.ones(len(T), dtype=torch.float64) if scale is None else scale.double()
    finite = torch.isfinite(loss.detach())
    if finite.any():
        grad, = torch.autograd.grad((loss[finite] * scale[finite]).sum(), x)
    else:
        grad = torch.zeros_like(x)
    grad = grad.masked_fill(~finite[:, None, None, None], 0.0)
    return loss.detach(), grad


# ---------------------------------------------------------------------------------------------------------
# The reference


def _brute_force(logits, y, T, U, durations, blank, sigma):
    """-log sum over every complete alignment, enumerated one by one in plain Python floats."""
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


@pytest.mark.parametrize("durations, T, U, blank, sigma", [
    ([0, 1, 2, 3], 4, 2, 0, 0.0),
    ([1, 3], 5, 1, 2, 0.0),
    ([0, 2, 3], 5, 2, 1, 0.07),
    ([3, 0, 1], 3, 3, 3, 0.0),   # unsorted durations, U_b = T_b (labels of duration 0 needed)
    ([1], 3, 1, 0, 0.0),         # a one-label RNA-like grid
])
def test_reference_equals_brute_force(durations, T, U, blank, sigma):
    gen = torch.Generator().manual_seed(T * 10 + U)
    V = 4
    logits = torch.randn(1, T, U + 1, V + len(durations), generator=gen, dtype=torch.float64)
    targets = torch.tensor([[v for v in range(V) if v != blank][(3 * u + 1) % (V - 1)] for u in range(U)] or [[0]])
    targets = targets.reshape(1, -1)
    expected, count = _brute_force(logits[0].tolist(), targets[0].tolist(), T, U, durations, blank, sigma)
    assert count > 1  # a real sum over alignments
    got = tdt_loss_reference(logits, targets, torch.tensor([T]), torch.tensor([U]), durations, blank, sigma)
    assert got.dtype == torch.float64
    assert abs(float(got[0]) - expected) <= 1e-12 * max(1.0, abs(expected))
    loss, _ = _stages(logits, targets, torch.tensor([T]), torch.tensor([U]), durations, blank, V, sigma)
    assert abs(float(loss[0]) - expected) <= 1e-12 * max(1.0, abs(expected))


def test_brute_force_counts_alignments():
    # durations [0, 1], T = 2, U = 1: label at t=0 (d 0 or 1) or t=1 (d 0), blanks of duration 1 elsewhere:
    # (0,0)-y/0->(0,1)-b->(1,1)-b->end, (0,0)-y/1->(1,1)-b->end, (0,0)-b->(1,0)-y/0->(1,1)-b->end
    logits = torch.randn(2, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).tolist()
    assert _brute_force(logits, [1], 2, 1, [0, 1], 0, 0.0)[1] == 3


@pytest.mark.parametrize("durations, blank, sigma, omega", [
    ([0, 1, 2, 3, 4], 0, 0.0, 0.0),
    ([1, 2], 2, 0.05, 0.0),
    ([1, 3, 4], 1, 0.0, 0.4),
    ([0, 2, 1], 3, 0.1, 0.25),
])
def test_reference_gradcheck(durations, blank, sigma, omega):
    gen = torch.Generator().manual_seed(len(durations) + blank)
    V = 4
    logits, targets, T, U = _batch(gen, 3, 4, 2, V, durations, blank, scale=1.0)
    U = torch.minimum(U, T - 1)  # every utterance feasible, also without a duration 0
    T[1], U[1] = 4, 1
    loss = tdt_loss_reference(logits, targets, T, U, durations, blank, sigma, omega)
    assert torch.isfinite(loss).all()
    logits.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: tdt_loss_reference(x, targets, T, U, durations, blank, sigma, omega), (logits,), fast_mode=True)


def test_reference_omega_mixes_the_rnnt_loss():
    gen = torch.Generator().manual_seed(3)
    V, durations, blank = 5, [0, 1, 2], 4
    logits, targets, T, U = _batch(gen, 3, 5, 3, V, durations, blank)
    tdt = tdt_loss_reference(logits, targets, T, U, durations, blank, sigma=0.1)
    rnnt = transducer_loss_reference(logits[..., :V], targets, T, U, blank)
    mixed = tdt_loss_reference(logits, targets, T, U, durations, blank, sigma=0.1, omega=0.3)
    torch.testing.assert_close(mixed, 0.7 * tdt + 0.3 * rnnt, rtol=1e-13, atol=1e-13)
    # omega = 1: the RNN-T loss alone
    only = tdt_loss_reference(logits, targets, T, U, durations, blank, sigma=0.1, omega=1.0)
    torch.testing.assert_close(only, rnnt, rtol=1e-13, atol=1e-13)


def test_reference_infeasible_utterances():
    gen = torch.Generator().manual_seed(5)
    V = 3
    cases = [  # (durations, T, U): no complete alignment
        ([2], 3, 0),        # blanks of duration 2 never end on T = 3
        ([1, 2], 2, 2),     # every arc advances a frame: U + 1 <= T needed
        ([0, 2], 3, 1),     # every path lands on an even frame, the end T = 3 is odd
        ([0, 2, 3], 1, 0),  # the only closing blank from (0, 0) would need duration 1
    ]
    for durations, T, U in cases:
        logits = torch.randn(2, max(T, 4), U + 1, V + len(durations), generator=gen, dtype=torch.float64)
        targets = torch.ones(2, max(U, 1), dtype=torch.long)
        Ts, Us = torch.tensor([T, 4]), torch.tensor([U, 0])
        loss = tdt_loss_reference(logits, targets, Ts, Us, durations, 0)
        assert _brute_force(logits[0].tolist(), [1] * U, T, U, durations, 0, 0.0) == (math.inf, 0)
        assert loss[0] == math.inf
        assert math.isfinite(float(loss[1]))  # T = 4, U = 0 is feasible for each
        # the stages agree, with zero gradient for the infeasible utterance (whatever omega)
        for omega in (0.0, 0.5):
            got, grad = _stages(logits, targets, Ts, Us, durations, 0, V, omega=omega, lam=0.3)
            ref, ref_grad = _reference(logits, targets, Ts, Us, durations, 0, omega=omega, lam=0.3)
            assert got[0] == math.inf and ref[0] == math.inf
            assert not grad[0].any()
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("column", ["token", "duration"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_logits_give_nan(column, value, device):
    gen = torch.Generator().manual_seed(7)
    V, durations, blank = 4, [0, 1, 2], 1
    logits, targets, T, U = _batch(gen, 3, 4, 2, V, durations, blank)
    T[1], U[1] = 3, 1
    col = 2 if column == "token" else V + 1
    logits[1, T[1] - 1, U[1], col] = value  # a valid cell of utterance 1 (its last: not on any band)
    logits[2, -1, -1, 0] = math.nan        # padding of utterance 2 (T_2 < maxT): ignored
    assert T[2] < logits.size(1)
    loss = tdt_loss_reference(logits, targets, T, U, durations, blank)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()
    for padded in (True, False):
        got, grad = _stages(logits, targets, T, U, durations, blank, V, padded=padded, device=device)
        assert torch.isnan(got[1]) and torch.isfinite(got[[0, 2]]).all()
        assert not grad[1].any()
        torch.testing.assert_close(got[[0, 2]], loss[[0, 2]], rtol=1e-12, atol=1e-12)


def test_log_probs_contract():
    gen = torch.Generator().manual_seed(11)
    V, durations, blank, sigma = 5, [0, 1, 3], 2, 0.2
    logits, targets, T, U = _batch(gen, 4, 5, 3, V, durations, blank)
    W = V + len(durations)
    mask = _cell_mask(logits.shape, T, U)
    logits[0, 1, 1, V + 2] = math.inf  # a non-finite duration logit makes the whole row's den NaN
    layout = cpu.layout(T, U, logits.size(2), padded_t=logits.size(1), targets=targets, vocab_size=V, blank=blank)
    rows = logits.masked_fill(~mask[..., None], math.nan).reshape(-1, W)
    lp, lp_dur, den = tdt_log_probs(rows[:, :V], rows[:, V:], targets, layout, LossOptions(blank=blank, sigma=sigma))
    assert lp.shape == (logits[..., 0].numel(), 2) and lp_dur.shape == (lp.size(0), 3) and den.shape == lp.shape
    assert lp.dtype == lp_dur.dtype == den.dtype == torch.float64
    lp, lp_dur, den = lp.view(*mask.shape, 2), lp_dur.view(*mask.shape, 3), den.view(*mask.shape, 2)
    assert torch.isnan(den[0, 1, 1]).all() and torch.isnan(lp[0, 1, 1]).all() and torch.isnan(lp_dur[0, 1, 1]).all()
    mask[0, 1, 1] = False
    tok = logits[..., :V].log_softmax(-1) - sigma
    dur = logits[..., V:].log_softmax(-1)
    torch.testing.assert_close(lp[..., 0][mask], tok[..., blank][mask], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(lp_dur[mask], dur[mask], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(den[..., 0][mask], logits[..., :V].logsumexp(-1)[mask], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(den[..., 1][mask], logits[..., V:].logsumexp(-1)[mask], rtol=1e-14, atol=1e-14)
    for b in range(len(T)):
        for t, u in itertools.product(range(logits.size(1)), range(logits.size(2))):
            if (b, t, u) == (0, 1, 1):
                continue
            if t < T[b] and u < U[b]:
                assert abs(float(lp[b, t, u, 1] - tok[b, t, u, targets[b, u]])) < 1e-14
            else:  # the label at u == U_b and on padding
                assert lp[b, t, u, 1] == -math.inf


def test_fastemit_scales_the_label_token_log_prob_gradient():
    gen = torch.Generator().manual_seed(13)
    V, durations, blank = 5, [0, 1, 2, 4], 3
    logits, targets, T, U = _batch(gen, 4, 6, 3, V, durations, blank)
    tok = (logits[..., :V].log_softmax(-1) - 0.1).requires_grad_()
    dur = logits[..., V:].log_softmax(-1).requires_grad_()
    lam = 0.7
    grads = {}
    for value in (0.0, lam):
        loss = _tdt_loss_from_log_probs(tok, dur, targets, T, U, durations, blank, value)
        grads[value] = torch.autograd.grad(loss.sum(), (tok, dur)) + (loss.detach(),)
    torch.testing.assert_close(grads[lam][2], grads[0.0][2], rtol=0, atol=0)  # the value is unchanged
    torch.testing.assert_close(grads[lam][1], grads[0.0][1], rtol=1e-14, atol=1e-14)  # durations unchanged
    is_label = torch.zeros(tok.shape, dtype=torch.bool)
    for b in range(len(T)):
        for u in range(int(U[b])):
            is_label[b, :T[b], u, targets[b, u]] = True
    expected = torch.where(is_label, (1 + lam) * grads[0.0][0], grads[0.0][0])
    torch.testing.assert_close(grads[lam][0], expected, rtol=1e-13, atol=1e-14)
    assert grads[0.0][0][is_label].abs().sum() > 0.1  # the label entries are not all zero
    # through the public reference, the value is unchanged too
    torch.testing.assert_close(tdt_loss_reference(logits, targets, T, U, durations, blank, 0.1, 0.2, lam),
                               tdt_loss_reference(logits, targets, T, U, durations, blank, 0.1, 0.2), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# The stages against the reference

CONFIGS = [  # durations, sigma, omega, fastemit_lambda
    ([0, 1, 2, 3, 4], 0.0, 0.0, 0.0),
    ([1, 2], 0.05, 0.0, 0.0),
    ([1, 3, 4], 0.0, 0.3, 0.0),
    ([0, 2, 3], 0.1, 0.0, 0.5),      # infeasible utterances arise (odd and even frames)
    ([2, 0, 1], 0.02, 0.4, 0.25),
    ([3], 0.0, 0.0, 0.1),            # one duration: many infeasible utterances
]


# cuda's tdt_alpha_beta has two kernels: the read-ahead walk (U + 1 <= 512, D <= 8, rings within the GPU's
# shared memory) and the general one; "cuda-general" forces the second.
WALKS = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("cuda-general", marks=pytest.mark.cuda)]


def _walk_device(device, monkeypatch):
    if device == "cuda-general":
        import transducer.cuda
        monkeypatch.setattr(transducer.cuda, "WALK_MAX_THREADS", 0)
        return "cuda"
    return device


@pytest.mark.parametrize("device", WALKS)
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "compact"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_stages_match_reference(config, dtype, padded, device, monkeypatch):
    device = _walk_device(device, monkeypatch)
    durations, sigma, omega, lam = CONFIGS[config]
    gen = torch.Generator().manual_seed(100 + config)
    V = 5
    blank = int(torch.randint(0, V, (1,), generator=gen))
    B, max_t, max_u = 6, 7, 3
    logits, targets, T, U = _batch(gen, B, max_t, max_u, V, durations, blank, dtype=dtype)
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
    ref, ref_grad = _reference(logits, targets, T, U, durations, blank, sigma, omega, lam, scale)
    assert torch.isnan(ref[4])
    if 0 not in durations:
        assert ref[3] == math.inf
    assert torch.isfinite(ref).sum() >= 3
    ref_grad[5] = 0.0
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    loss, grad = _stages(logits, targets, T, U, durations, blank, V, sigma, omega, lam, scale.to(acc), padded,
                         device=device)
    assert loss.dtype == acc and grad.dtype == dtype
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=tol)
    assert ref_grad.abs().sum() > 1.0  # a real gradient was compared


@pytest.mark.parametrize("device", WALKS)
@pytest.mark.parametrize("durations, max_t, max_u", [([0, 1, 2, 3, 4], 12, 5), (list(range(10)), 9, 4),
                                                     ([0, 1, 3], 9, 70), ([0, 2, 3, 4, 5], 12, 199),
                                                     ([0, 1, 2], 4, 300), ([0, 1, 2], 3, 600)],
                         ids=["D5", "D10", "U70", "U200", "U300", "U600"])
def test_stages_wide_batches(durations, max_t, max_u, device, monkeypatch):
    """More durations than the read-ahead walk keeps (D = 10 > 8) and more labels than its block has threads
    (U + 1 > 512): the CUDA stages fall back to the general walk; the walk's cells in several warps (U70) and
    its rings over 48 KiB (U200: 155 KiB in float64, U300: 70 KiB); every device against the reference. On CUDA
    the walk that ran is the one named above."""
    general = device == "cuda-general"
    device = _walk_device(device, monkeypatch)
    kernels = []
    if device == "cuda":
        import transducer.cuda
        launch = transducer.cuda.launch

        def spy(path, name, *args, **kwargs):
            kernels.append(name)
            return launch(path, name, *args, **kwargs)
        monkeypatch.setattr(transducer.cuda, "launch", spy)
    gen = torch.Generator().manual_seed(18 + max_u)
    V, blank = 6, 2
    logits, targets, T, U = _batch(gen, 4, max_t, max_u, V, durations, blank)
    scale = torch.rand(4, generator=gen, dtype=torch.float64) + 0.5
    ref, ref_grad = _reference(logits, targets, T, U, durations, blank, 0.05, 0.2, 0.3, scale)
    assert torch.isfinite(ref).sum() >= 2 and ref_grad.abs().sum() > 1.0
    for padded in (True, False):
        loss, grad = _stages(logits, targets, T, U, durations, blank, V, 0.05, 0.2, 0.3, scale, padded,
                             device=device)
        torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)
    if device == "cuda":
        walks = {k.split("<")[0] for k in kernels if k.startswith(("tdt_walk_kernel", "tdt_alpha_beta_kernel"))}
        read_ahead = not general and len(durations) <= 8 and max_u + 1 <= 512
        assert walks == {"tdt_walk_kernel" if read_ahead else "tdt_alpha_beta_kernel"}, kernels


@pytest.mark.parametrize("device", DEVICES)
def test_stages_larger_ragged_batch(device):
    gen = torch.Generator().manual_seed(17)
    V, durations, blank = 6, [0, 1, 2, 3, 4], 5
    logits, targets, T, U = _batch(gen, 5, 12, 5, V, durations, blank)
    scale = torch.rand(5, generator=gen, dtype=torch.float64) + 0.5
    ref, ref_grad = _reference(logits, targets, T, U, durations, blank, 0.05, 0.2, 0.3, scale)
    for padded in (True, False):
        loss, grad = _stages(logits, targets, T, U, durations, blank, V, 0.05, 0.2, 0.3, scale, padded,
                             device=device)
        torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)


def test_gradient_may_overwrite_the_logits():
    gen = torch.Generator().manual_seed(19)
    V, durations, blank = 4, [0, 1, 2], 0
    logits, targets, T, U = _batch(gen, 4, 5, 3, V, durations, blank)
    for padded in (True, False):
        _, expected = _stages(logits, targets, T, U, durations, blank, V, 0.1, 0.3, 0.2, padded=padded)
        _, got = _stages(logits, targets, T, U, durations, blank, V, 0.1, 0.3, 0.2, padded=padded, alias=True)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_gradient_rows_sum_to_zero():
    # each softmax block's gradient sums to zero over its columns (tokens; durations) for omega = lambda = 0
    gen = torch.Generator().manual_seed(23)
    V, durations, blank = 5, [0, 1, 2, 3], 1
    logits, targets, T, U = _batch(gen, 3, 6, 3, V, durations, blank)
    _, grad = _stages(logits, targets, T, U, durations, blank, V, 0.3)
    torch.testing.assert_close(grad[..., :V].sum(-1), torch.zeros(grad.shape[:3], dtype=grad.dtype), atol=1e-12,
                               rtol=0)
    torch.testing.assert_close(grad[..., V:].sum(-1), torch.zeros(grad.shape[:3], dtype=grad.dtype), atol=1e-12,
                               rtol=0)


def test_check_durations():
    assert check_durations([0, 1, 2]) == (0, 1, 2)
    assert check_durations(torch.tensor([3, 1]), 2) == (3, 1)
    for bad in ([], [0], [1, 1], [-1, 1], [1.5, 2]):
        with pytest.raises(ValueError):
            check_durations(bad)
    with pytest.raises(ValueError):
        check_durations([0, 1], 3)
    gen = torch.Generator().manual_seed(29)
    logits, targets, T, U = _batch(gen, 2, 3, 1, 3, [0, 1], 0)
    layout = cpu.layout(T, U, logits.size(2), padded_t=logits.size(1))
    rows = logits.reshape(-1, 5)
    lp, lp_dur, _ = tdt_log_probs(rows[:, :3], rows[:, 3:], targets, layout, LossOptions())
    with pytest.raises(ValueError):
        tdt_alpha_beta(lp, lp_dur, layout, LossOptions(durations=(0, 1, 2)))  # 3 durations for 2 duration columns


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("column", [0, 4], ids=["token", "duration"])
def test_non_finite_logit_off_every_alignment_gives_nan(column, device):
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
        got, grad = _stages(logits, targets, T, U, durations, 0, V, padded=padded, device=device)
        assert torch.isnan(got[0]) and not grad[0].any()
        torch.testing.assert_close(got[1], loss[1], rtol=1e-12, atol=1e-12)
