"""The CUDA kernels' per-row terms (transducer/cuda/terms.cuh) evaluated on the CPU: the header's __host__ __device__
functions, compiled as host C++ into a small library (tests/terms_harness.cpp, loaded with ctypes), form the
log-probs and the gradients of random small batches from the CPU stages' logsumexps and walks, which must give the
CPU stages' values for every option that enters a term (sigma, the delay penalty, FastEmit, the clamp, omega, the
big blanks, TDT's durations; RNN-T and RNA). The gradient is checked as the stage kernels form it (TokenGradient)
and as the Hopper path's row coefficients give it. Each case's options change the CPU stages' values, so that a
term left out of a function fails it. tests/test_kernel_params.py checks that every kernel forms its terms with
these functions. Skipped without a C++ compiler on PATH."""

import ctypes
import math
import os
import shutil
import subprocess

import pytest
import torch
from _batches import compact, random_batch

import ops
from transducer.cpu import stages as cpu
from transducer.cuda.stages import TERMS
from transducer.custom_ops import make_layout
from transducer.lattices import Lattice
from transducer.options import LossOptions

CXX = next((shutil.which(c) for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
HARNESS = os.path.join(os.path.dirname(__file__), "terms_harness.cpp")

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++, c++ or clang++) on PATH")


class _Terms(ctypes.Structure):
    _fields_ = [(name, ctypes.c_double) for name, ctype in TERMS.c_fields]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("terms") / "libterms.so"
    cmd = [CXX, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{ops.cuda_include_dir()}", "-o", str(out), HARNESS]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}{res.stdout}"
    return ctypes.CDLL(str(out))


def _call(f, *args):
    """f(*args), tensors passed as pointers to their data (contiguous copies, kept alive for the call)."""
    keep = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
    return f(*(ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in keep))


def _terms(options):
    return _Terms(options.sigma, options.delay_penalty, options.fastemit_lambda, options.omega, max(options.clamp, 0.0))


def _batch(seed, V, blank, big_blanks=0, extra=0, rna=False):
    """Compact float64 scores (N, V + extra) of a random batch (labels other than the blank and the big blanks
    before it), its targets, layout and incoming scale, and per row its utterance, its cell (t, u, T_b, U_b, row
    stride) and its label's column (-1: none)."""
    gen = torch.Generator().manual_seed(seed)
    logits, targets, T, U = random_batch(
        gen, 3, 5, 3, V, list(range(blank - big_blanks, blank + 1)), rna=rna, scale=1.5, extra=extra, min_t=2
    )
    x = compact(logits, T, U)
    layout = make_layout(x[:, :V], targets, T, U, blank, big_blanks=big_blanks)
    b, cells, labels = [], [], []
    for i in range(len(T)):
        for t in range(int(T[i])):
            for u in range(int(U[i]) + 1):
                b.append(i)
                cells.append([t, u, int(T[i]), int(U[i]), int(U[i]) + 1])
                labels.append(int(targets[i, u]) if u < U[i] else -1)
    scale = torch.rand(len(T), generator=gen, dtype=torch.float64) + 0.5
    scale[-1] = 0.0  # no gradient for this utterance
    return (
        x,
        targets,
        layout,
        torch.tensor(b),
        torch.tensor(cells, dtype=torch.int32),
        torch.tensor(labels, dtype=torch.int32),
        scale,
    )


def _live(lattice, scale, b, cells, rna=False, rnnt=None):
    """The rows that get a gradient, as the gradient kernels decide it."""
    live = torch.isfinite(lattice.nll[b]) & (scale[b] != 0)
    if rnnt is not None:
        live &= torch.isfinite(rnnt.nll[b])
    if rna:
        t, u, T, U = cells[:, 0], cells[:, 1], cells[:, 2], cells[:, 3]
        live &= (u <= t) & (t - u <= T - 1 - U)
    return live.to(torch.int32)


def _from_coefficients(x, c, blank, labels, big, clamp):
    """A row's token gradient from its row coefficients (den, factor, blank arc, label arc, scale, then the big
    blanks' arcs of the columns blank - K ... blank - 1), as the Hopper kernels' epilogue forms it."""
    g = torch.exp(x - c[:, :1]) * c[:, 1:2]
    index = torch.arange(x.size(0))
    g[index, blank] -= c[:, 2]
    has = labels >= 0
    g[index[has], labels[has].long()] -= c[has, 3]
    if big:
        g[:, blank - big : blank] -= c[:, 5 : 5 + big]
    if clamp > 0:
        g = g.clamp(-clamp, clamp)
    return torch.where((c[:, 4:5] != 0), g * c[:, 4:5], 0.0)


def _log_probs(lib, options, x, labels, den, cells, blank):
    has = (labels >= 0).to(torch.int32)
    x_label = torch.where(labels >= 0, x[torch.arange(x.size(0)), labels.clamp(min=0).long()], -math.inf)
    lp = torch.empty(x.size(0), 2, dtype=torch.float64)
    _call(
        lib.token_log_probs,
        ctypes.byref(_terms(options)),
        ctypes.c_longlong(x.size(0)),
        x[:, blank],
        x_label,
        has,
        den,
        cells,
        lp,
    )
    return lp


def _arc_log_probs(lib, options, x, den, durations):
    out = torch.empty(x.shape, dtype=torch.float64)
    _call(
        lib.arc_log_probs,
        ctypes.byref(_terms(options)),
        ctypes.c_longlong(x.size(0)),
        x.size(1),
        int(durations),
        x,
        den,
        out,
    )
    return out


def _differs(a, b):
    return not torch.allclose(a, b, rtol=1e-6, atol=1e-9)


CLOSE = dict(rtol=1e-10, atol=1e-12)

RNNT_CASES = {
    "plain": dict(),
    "fastemit": dict(fastemit_lambda=0.3),
    "delay_penalty": dict(delay_penalty=0.25),
    "clamp": dict(clamp=0.05),
    "from_log_softmax": dict(from_log_softmax=True, fastemit_lambda=0.2),
    "rna": dict(one_sym_per_frame=True, fastemit_lambda=0.2, delay_penalty=0.1),
    "rna_clamp": dict(one_sym_per_frame=True, clamp=0.1),
    "big_blanks": dict(big_blank_durations=(2, 3)),
    "big_blanks_every_term": dict(
        big_blank_durations=(2, 4), sigma=0.2, fastemit_lambda=0.3, delay_penalty=0.2, clamp=0.1
    ),
}


@pytest.mark.parametrize("case", RNNT_CASES)
def test_rnnt_terms_match_the_cpu_stages(lib, case):
    more = RNNT_CASES[case]
    V, rna, K = 7, more.get("one_sym_per_frame", False), len(more.get("big_blank_durations", ()))
    blank = V - 1 if K else 0
    options = LossOptions(blank=blank, **more)
    x, targets, layout, b, cells, labels, scale = _batch(len(case), V, blank, K, rna=rna)
    if options.from_log_softmax:
        x = x.log_softmax(-1)
    n = x.size(0)
    if K:
        lp, den, lp_arcs = cpu.multiblank_log_probs(x, targets, layout, options)
        walks = cpu.multiblank_alpha_beta(lp, lp_arcs, layout, options)
    else:
        (lp, den), lp_arcs = cpu.log_probs(x, targets, layout, options), None
        walks = cpu.alpha_beta(lp, layout, options)
    # the log-probs: from the scores and den
    torch.testing.assert_close(_log_probs(lib, options, x, labels, den, cells, blank), lp, **CLOSE)
    if K:
        big = x[:, blank - K : blank].flip(1)  # big blank i: column blank - 1 - i
        torch.testing.assert_close(_arc_log_probs(lib, options, big, den, False), lp_arcs, **CLOSE)
    # the gradient: from the log-probs, den and the walks
    lattice = Lattice(layout, lp, den, walks.alpha, walks.beta, walks.nll, lp_arcs=lp_arcs)
    want = cpu.gradient(x, targets, lattice, scale, options, torch.empty_like(x))
    plain = cpu.gradient(
        x, targets, lattice, scale, options._replace(fastemit_lambda=0.0, clamp=-1.0), torch.empty_like(x)
    )
    assert case in ("plain", "delay_penalty", "big_blanks") or _differs(want, plain)  # the terms matter here
    live = _live(lattice, scale, b, cells, rna)
    grad = torch.empty_like(x)
    coefficients = torch.empty(n, 5 + K, dtype=torch.float64)
    durations = torch.tensor(list(options.big_blank_durations) or [0], dtype=torch.int32)
    _call(
        lib.rnnt_gradient,
        ctypes.byref(_terms(options)),
        int(rna),
        int(not options.from_log_softmax),
        int(options.clamp > 0),
        ctypes.c_longlong(n),
        V,
        blank,
        x,
        den,
        lp,
        walks.alpha,
        walks.beta,
        walks.nll[b],
        scale[b],
        cells,
        labels,
        live,
        K,
        durations,
        lp_arcs if K else torch.zeros(1, dtype=torch.float64),
        grad,
        coefficients,
    )
    torch.testing.assert_close(grad, want, **CLOSE)
    if not options.from_log_softmax:  # the fused loss's Hopper path: logits, not log-probs
        got = _from_coefficients(x, coefficients, blank, labels, K, options.clamp)
        torch.testing.assert_close(torch.where(live[:, None] != 0, got, 0.0), want, **CLOSE)


TDT_CASES = {
    "plain": dict(),
    "sigma": dict(sigma=0.1),
    "delay_penalty": dict(delay_penalty=0.2),
    "fastemit": dict(fastemit_lambda=0.3),
    "omega": dict(omega=0.4),
    "clamp": dict(clamp=0.05),
    "every_term": dict(sigma=0.05, delay_penalty=0.1, fastemit_lambda=0.2, omega=0.3, clamp=0.1),
}


@pytest.mark.parametrize("durations", [(0, 1, 2), (1, 3)])
@pytest.mark.parametrize("case", TDT_CASES)
def test_tdt_terms_match_the_cpu_stages(lib, case, durations):
    more = TDT_CASES[case]
    V, D, blank = 6, len(durations), 0
    options = LossOptions(blank=blank, durations=durations, **more)
    x, targets, layout, b, cells, labels, scale = _batch(len(case) + D, V, blank, extra=D)
    n, tokens, dur = x.size(0), x[:, :V].contiguous(), x[:, V:].contiguous()
    lp, den, lp_arcs, den_arcs = cpu.tdt_log_probs(tokens, dur, targets, layout, options)
    torch.testing.assert_close(_log_probs(lib, options, tokens, labels, den, cells, blank), lp, **CLOSE)
    torch.testing.assert_close(_arc_log_probs(lib, options, dur, den_arcs, True), lp_arcs, **CLOSE)
    walks = cpu.tdt_alpha_beta(lp, lp_arcs, layout, options)
    rnnt = cpu.alpha_beta(lp + options.sigma, layout, options) if options.omega else None
    lattice = Lattice(
        layout, lp, den, walks.alpha, walks.beta, walks.nll, lp_arcs=lp_arcs, den_arcs=den_arcs, rnnt=rnnt
    )
    want, want_dur = torch.empty_like(tokens), torch.empty_like(dur)
    cpu.tdt_gradient(tokens, dur, targets, lattice, scale, options, (want, want_dur))
    plain, plain_dur = torch.empty_like(tokens), torch.empty_like(dur)
    cpu.tdt_gradient(
        tokens,
        dur,
        targets,
        lattice,
        scale,
        options._replace(fastemit_lambda=0.0, clamp=-1.0, omega=0.0),
        (plain, plain_dur),
    )
    assert case in ("plain", "sigma", "delay_penalty") or _differs(
        torch.cat([want, want_dur], 1), torch.cat([plain, plain_dur], 1)
    )
    live = _live(lattice, scale, b, cells, rnnt=rnnt)
    walks_r = rnnt or walks
    grad, grad_dur = torch.empty_like(tokens), torch.empty_like(dur)
    coefficients = torch.empty(n, 5, dtype=torch.float64)
    _call(
        lib.tdt_gradient,
        ctypes.byref(_terms(options)),
        int(bool(options.omega)),
        int(options.clamp > 0),
        ctypes.c_longlong(n),
        V,
        D,
        blank,
        tokens,
        den,
        lp,
        lp_arcs,
        walks.alpha,
        walks.beta,
        walks.nll[b],
        walks_r.alpha,
        walks_r.beta,
        walks_r.nll[b],
        scale[b],
        cells,
        labels,
        live,
        torch.tensor(durations, dtype=torch.int32),
        grad,
        grad_dur,
        coefficients,
    )
    torch.testing.assert_close(grad, want, **CLOSE)
    torch.testing.assert_close(grad_dur, want_dur, **CLOSE)
    got = _from_coefficients(tokens, coefficients, blank, labels, 0, options.clamp)
    torch.testing.assert_close(torch.where(live[:, None] != 0, got, 0.0), want, **CLOSE)


def test_sigma_and_the_delay_penalty_change_the_log_probs():
    # the log-prob cases above would not see a dropped term if their options changed nothing
    gen = torch.Generator().manual_seed(0)
    logits, targets, T, U = random_batch(gen, 2, 4, 2, 5, 0, min_t=2)
    x = compact(logits, T, U)
    layout = make_layout(x, targets, T, U, 0)
    lp, _ = cpu.log_probs(x, targets, layout, LossOptions())
    for more in (dict(sigma=0.1), dict(delay_penalty=0.2)):
        other, _ = cpu.log_probs(x, targets, layout, LossOptions(**more))
        assert _differs(lp[torch.isfinite(lp)], other[torch.isfinite(lp)])
