"""The Hopper gradient epilogue's arithmetic (transducer/hopper/epilogue.py's token_gradient, which the CuTe kernel
traces) evaluated with torch's operations on the CPU, from each row's coefficients as the fused loss gives them to the
kernel, against the float64 gradient of the CPU stages: RNN-T with FastEmit and a clamp, multi-blank RNN-T (the big
blanks' arcs on their columns) and TDT's token scores."""

import math
from types import SimpleNamespace

import pytest
import torch
from _batches import random_batch

from transducer.cpu import stages as cpu
from transducer.custom_ops import make_layout
from transducer.hopper.epilogue import ColumnFlags, RowTerms, token_gradient
from transducer.lattices import Lattice
from transducer.layout import LabelCheck
from transducer.options import LossOptions

TORCH_OPS = SimpleNamespace(
    exp_minus=lambda a, b: torch.exp(a - b), where=torch.where, maximum=torch.maximum, minimum=torch.minimum
)


def epilogue(z, row, columns, clamp):
    """G over every entry of z (N, V), as the kernel forms it: token_gradient on (N, 1) rows and (N, V) columns."""
    row = RowTerms(*(x[:, None] for x in row[:5]), tuple(x[:, None] for x in row.extra_arcs))
    return token_gradient(z, row, columns, torch.tensor(clamp, dtype=z.dtype) if clamp > 0 else None, TORCH_OPS)


def batch(V, blank, seed):
    gen = torch.Generator().manual_seed(seed)
    logits, targets, T, U = random_batch(gen, 3, 7, 4, V, blank, dtype=torch.float64, scale=3.0)
    mask = torch.zeros(logits.shape[:3], dtype=torch.bool)
    for b in range(len(T)):
        mask[b, : T[b], : U[b] + 1] = True
    z = logits[mask]
    scale = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    return z, targets, T, U, make_layout(logits[mask], targets, T, U), scale


@pytest.mark.parametrize("lam, clamp", [(0.0, 0.0), (0.3, 0.0), (0.0, 0.05), (0.3, 0.05)])
@pytest.mark.parametrize("big_blanks", [(), (2, 3)])
def test_token_gradient_matches_the_cpu_stages(lam, clamp, big_blanks):
    """RNN-T (FastEmit, clamp) and multi-blank RNN-T: the per-row coefficients the CUDA row kernel gives the Hopper
    kernel (FastEmit's label arc folded into the softmax's factor and the label's arc), through token_gradient."""
    V, blank = 9, 8
    z, targets, T, U, layout, scale = batch(V, blank, seed=len(big_blanks) + int(10 * lam) + int(100 * clamp))
    options = LossOptions(blank=blank, fastemit_lambda=lam, clamp=clamp, big_blank_durations=big_blanks)
    if big_blanks:
        lp, den, lp_arcs = cpu.multiblank_log_probs(z, targets, layout, options)
        walks = cpu.multiblank_alpha_beta(lp, lp_arcs, layout, options)
    else:
        (lp, den), lp_arcs = cpu.log_probs(z, targets, layout, options), None
        walks = cpu.alpha_beta(lp, layout, options)
    lattice = Lattice(layout, lp, den, *walks, lp_arcs=lp_arcs)
    want = cpu.gradient(z, targets, lattice, scale, options, torch.empty_like(z))

    N = z.size(0)
    cells = cpu._cells(layout, 0, N)
    occupancy, blank_arc, label_arc, b, u, has_label, live = cpu._gradient_coefficients(
        layout, lp, walks, scale, False, 0, N, cells
    )
    extra = ()
    if big_blanks:
        big = cpu._big_blank_occupancies(layout, lattice, big_blanks, live, 0, N, cells)
        extra = tuple(big[:, i] for i in range(len(big_blanks)))
    row = RowTerms(
        torch.where(live, den, math.inf), occupancy + lam * label_arc, blank_arc, (1 + lam) * label_arc, scale[b], extra
    )
    labels = cpu._labels(targets, b, u, has_label, blank)
    col = torch.arange(V)
    columns = ColumnFlags(
        col == blank,
        has_label[:, None] & (col == labels[:, None]),
        tuple(col == blank - 1 - i for i in range(len(big_blanks))),
    )
    got = epilogue(z, row, columns, clamp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if clamp:  # the clamp bites somewhere
        assert (want.abs() >= clamp * scale[b][:, None] - 1e-12).any()


@pytest.mark.parametrize("lam, clamp", [(0.0, 0.0), (0.2, 0.0), (0.0, 0.02)])
def test_token_gradient_matches_tdt_token_scores(lam, clamp):
    """TDT: the token scores' gradient (the duration columns are formed apart, by the row kernels) from the arcs'
    totals over the durations."""
    V, blank, durations = 7, 6, (0, 1, 2)
    D = len(durations)
    gen = torch.Generator().manual_seed(int(10 * lam) + int(100 * clamp))
    logits, targets, T, U = random_batch(gen, 3, 6, 3, V, blank, dtype=torch.float64, scale=3.0)
    logits = torch.cat([logits, torch.randn(*logits.shape[:3], D, generator=gen, dtype=torch.float64)], -1)
    mask = torch.zeros(logits.shape[:3], dtype=torch.bool)
    for b in range(len(T)):
        mask[b, : T[b], : U[b] + 1] = True
    z2d = logits[mask]
    layout = cpu.layout(T, U, targets.size(1) + 1, labels=LabelCheck(targets, V, blank))
    scale = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    options = LossOptions(blank=blank, durations=durations, fastemit_lambda=lam, clamp=clamp)
    lp, den, lp_arcs, den_arcs = cpu.tdt_log_probs(z2d[:, :V], z2d[:, V:], targets, layout, options)
    walks = cpu.tdt_alpha_beta(lp, lp_arcs, layout, options)
    lattice = Lattice(layout, lp, den, *walks, lp_arcs, den_arcs)
    want = torch.empty_like(z2d)
    cpu.tdt_gradient(z2d[:, :V], z2d[:, V:], targets, lattice, scale, options, (want[:, :V], want[:, V:]))

    N = z2d.size(0)
    cells = cpu._cells(layout, 0, N)
    b, t, u, is_cell = cells
    live = is_cell & (torch.isfinite(walks[2]) & (scale != 0))[b]
    gamma, blank_arc, label_arc = cpu._tdt_arc_occupancies(layout, lattice, live, torch.tensor(durations), 0, N, cells)
    blank_total, label_total = blank_arc.sum(1), label_arc.sum(1)
    row = RowTerms(
        torch.where(live, den, math.inf), gamma + lam * label_total, blank_total, (1 + lam) * label_total, scale[b]
    )
    has_label = is_cell & (u < layout.target_lengths[b])
    labels = cpu._labels(targets, b, u, has_label, blank)
    col = torch.arange(V)
    columns = ColumnFlags(col == blank, has_label[:, None] & (col == labels[:, None]))
    torch.testing.assert_close(epilogue(z2d[:, :V], row, columns, clamp), want[:, :V], rtol=1e-12, atol=1e-12)
