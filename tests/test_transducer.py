"""The CPU loss against the pure-PyTorch reference and torchaudio; options, dtypes, pack."""

import math

import pytest
import torch

from _batches import DEVICES, cell_mask, compact, random_batch
from _imports import require
from transducer import (TransducerLoss, pack, rnnt_loss, tdt_loss, tdt_loss_reference, transducer_loss,
                        transducer_loss_reference)


def reduce_like(losses, reduction):
    return {"none": losses, "sum": losses.sum(), "mean": losses.mean()}[reduction]


CASES = [(seed, rna) for seed in range(8) for rna in (False, True)]


@pytest.mark.parametrize("seed,rna", CASES)
def test_matches_reference_compact_and_padded(seed, rna):
    gen = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 6, (1,), generator=gen))
    V = int(torch.randint(2, 21, (1,), generator=gen))
    blank = 0 if seed % 2 == 0 else int(torch.randint(0, V, (1,), generator=gen))
    logits, targets, T, U = random_batch(gen, B, int(torch.randint(1, 13, (1,), generator=gen)),
                                         int(torch.randint(0, 7, (1,), generator=gen)), V, blank, rna=rna)
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
    B, max_t, max_u, V = (int(torch.randint(lo, hi + 1, (1,), generator=gen)) for lo, hi in ((1, 5), (1, 12), (0, 6), (2, 20)))
    blank = 0 if seed % 2 else int(torch.randint(0, V, (1,), generator=gen))
    logits, targets, T, U = random_batch(gen, B, max_t, max_u, V, blank, rna=rna)
    if layout == "compact":
        logits = compact(logits, T, U)
    logits.requires_grad_()
    loss = lambda x: transducer_loss(x, targets, T, U, blank=blank, reduction=reduction, one_sym_per_frame=rna)
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
            (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("from_log_softmax", [False, True])
def test_gradcheck_from_log_softmax(from_log_softmax):
    gen = torch.Generator().manual_seed(7)
    logits, targets, T, U = random_batch(gen, 2, 4, 3, 5, blank=0)
    x = logits.log_softmax(-1).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: transducer_loss(x, targets, T, U, reduction="sum", from_log_softmax=from_log_softmax),
        (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


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
    expected = ta.rnnt_loss(ta_in, targets[:, :int(U.max())].int(), T.int(), U.int(), blank=blank, reduction="none")
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
    expected = ta.rnnt_loss(ta_in, targets[:, :int(U.max())].int(), T.int(), U.int(), blank=0, reduction="sum",
                            fused_log_softmax=False)
    expected.backward()
    ours = log_probs.clone().requires_grad_()
    got = transducer_loss(ours, targets, T, U, reduction="sum", from_log_softmax=True)
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    valid = cell_mask(logits, T, U)
    torch.testing.assert_close(ours.grad[valid], ta_in.grad[valid], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,eps", [(torch.float16, 2.0 ** -11), (torch.bfloat16, 2.0 ** -8)])
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
    assert (rows.grad[start:start + n] == 0).all()

    rows.grad = None
    zeroed = transducer_loss(rows, targets, T, U, reduction="sum", one_sym_per_frame=True, zero_infinity=True)
    zeroed.backward()
    torch.testing.assert_close(zeroed, losses[[0, 2]].sum())
    assert (rows.grad[start:start + n] == 0).all()
    assert (rows.grad[:start] != 0).any()


def test_edge_shapes_t1_u0():
    for T, U in [(1, 0), (1, 3), (4, 0)]:
        logits = torch.randn(T * (U + 1), 6, dtype=torch.float64, requires_grad=True)
        targets = torch.randint(1, 6, (1, max(U, 1)))
        lengths = torch.tensor([T]), torch.tensor([U])
        got = transducer_loss(logits, targets, *lengths)
        expected = transducer_loss_reference(logits.view(1, T, U + 1, 6), targets, *lengths).mean()
        torch.testing.assert_close(got, expected)


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


def test_pack_matches_loop_and_gradcheck():
    gen = torch.Generator().manual_seed(4)
    B, max_t, max_u1, D = 4, 6, 5, 3
    enc = torch.randn(B, max_t, D, generator=gen, dtype=torch.float64, requires_grad=True)
    pred = torch.randn(B, max_u1, D, generator=gen, dtype=torch.float64, requires_grad=True)
    T = torch.tensor([6, 1, 4, 3])
    U = torch.tensor([4, 0, 2, 4])
    out = pack(enc, pred, T, U)
    expected = compact(enc[:, :, None, :] + pred[:, None, :, :], T, U)
    torch.testing.assert_close(out, expected)
    assert torch.autograd.gradcheck(lambda e, p: pack(e, p, T, U), (enc, pred))


# ---- validation: every bad argument gets a clear error before any compute ----

def _good():
    logits = torch.randn(2 * 3 + 4 * 1, 5)
    return logits, torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 4]), torch.tensor([2, 0])


@pytest.mark.parametrize("mutate,error,match", [
    (lambda a: (a[0].long(),) + a[1:], TypeError, "logits: expected dtype"),
    (lambda a: (a[0][None],) + a[1:], ValueError, "logits: expected 2 or 4 dimensions"),
    (lambda a: (a[0], a[1].float()) + a[2:], TypeError, "targets: expected dtype"),
    (lambda a: (a[0], a[1][0]) + a[2:], ValueError, "targets: expected 2 dimensions"),
    (lambda a: (a[0], a[1][:1]) + a[2:], ValueError, "targets: expected 2 rows"),
    (lambda a: a[:2] + (a[2].float(), a[3]), TypeError, "logit_lengths: expected dtype"),
    (lambda a: a[:3] + (a[3][:1],), ValueError, r"target_lengths: expected shape \(2,\)"),
    (lambda a: a[:2] + (torch.tensor([2, -1]), a[3]), ValueError, "logit_lengths: every T_b must be >= 1"),
    (lambda a: a[:2] + (torch.tensor([0, 4]), a[3]), ValueError, "logit_lengths: every T_b must be >= 1"),
    (lambda a: a[:3] + (torch.tensor([-1, 0]),), ValueError, "target_lengths: every U_b must be >= 0"),
    (lambda a: a[:3] + (torch.tensor([3, 0]),), ValueError, "target_lengths: U_b = 3 exceeds targets.size"),
    (lambda a: (a[0][:-1],) + a[1:], ValueError, "logits: compact logits must have sum_b"),
    (lambda a: (a[0], torch.tensor([[1, 5], [3, 4]])) + a[2:], ValueError, r"targets: 1 entries .* outside"),
    (lambda a: (a[0], torch.tensor([[1, 0], [3, 4]])) + a[2:], ValueError, "equal to blank"),
    (lambda a: (a[0], torch.tensor([[1, -2], [3, 4]])) + a[2:], ValueError, "targets: 1 entries"),
    (lambda a: (a[0][:0].view(0, 5),) + (a[1][:0], a[2][:0], a[3][:0]), ValueError, "empty batch"),
])
def test_bad_input(mutate, error, match):
    with pytest.raises(error, match=match):
        transducer_loss(*mutate(_good()))


def test_bad_options_and_padded_sizes():
    logits, targets, T, U = _good()
    with pytest.raises(ValueError, match=r"blank: expected an int in \[-5, 5\)"):
        transducer_loss(logits, targets, T, U, blank=5)
    with pytest.raises(ValueError, match=r"blank: expected an int in \[-5, 5\)"):
        transducer_loss(logits, targets, T, U, blank=-6)
    with pytest.raises(ValueError, match="reduction: expected one of"):
        transducer_loss(logits, targets, T, U, reduction="avg")
    with pytest.raises(ValueError, match="reduction"):
        TransducerLoss(reduction="max")
    padded = torch.randn(2, 4, 3, 5)
    with pytest.raises(ValueError, match="logit_lengths: T_b = 5 exceeds logits.size"):
        transducer_loss(padded, targets, torch.tensor([5, 4]), U)
    with pytest.raises(ValueError, match=r"target_lengths: U_b \+ 1 = 3 exceeds"):
        transducer_loss(padded[:, :, :2], targets, T, U)
    with pytest.raises(ValueError, match="padded logits must have batch size 2"):
        transducer_loss(padded[:1], targets, T, U)
    with pytest.raises(TypeError, match="logits: expected a torch.Tensor"):
        transducer_loss(logits.numpy(), targets, T, U)


def test_pack_bad_input():
    enc, pred = torch.randn(2, 4, 3), torch.randn(2, 3, 3)
    T, U = torch.tensor([4, 2]), torch.tensor([2, 1])
    with pytest.raises(ValueError, match="predictor_out: expected shape"):
        pack(enc, pred[:, :, :2], T, U)
    with pytest.raises(TypeError, match="predictor_out: expected dtype"):
        pack(enc, pred.long(), T, U)
    with pytest.raises(ValueError, match="logit_lengths: expected values in"):
        pack(enc, pred, torch.tensor([5, 2]), U)
    with pytest.raises(ValueError, match="target_lengths: expected values in"):
        pack(enc, pred, T, torch.tensor([3, 1]))
    with pytest.raises(TypeError, match="logit_lengths: expected dtype"):
        pack(enc, pred, T.float(), U)


def test_cuda_without_cupy_names_the_extra(monkeypatch):
    import sys

    import ops.cuda
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail, as on a machine without it
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[cuda\]'"):
        ops.cuda.cupy()
    import transducer.cuda  # noqa: F401  importing the CUDA stages never needs CuPy


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["compact", "padded"])
def test_non_finite_utterances_get_zero_gradient(layout, device):
    # utterance 1 cannot emit blank (log-prob -inf), so it has no alignment: with zero_infinity the batch
    # still trains
    gen = torch.Generator().manual_seed(31)
    logits, targets, T, U = random_batch(gen, 3, 6, 4, 9, blank=0)
    logits = logits.log_softmax(-1)
    logits[1, :, :, 0] = -math.inf
    expected = transducer_loss_reference(logits[[0, 2]], targets[[0, 2]], T[[0, 2]], U[[0, 2]],
                                         from_log_softmax=True)
    x = (compact(logits, T, U) if layout == "compact" else logits).to(device).requires_grad_()
    targets, T, U = targets.to(device), T.to(device), U.to(device)
    losses = transducer_loss(x, targets, T, U, reduction="none", zero_infinity=True, from_log_softmax=True)
    assert losses[1].item() == 0 and torch.isfinite(losses).all()
    losses.sum().backward()
    assert not torch.isnan(x.grad).any()
    torch.testing.assert_close(losses[[0, 2]].cpu(), expected)

    # an overflowing joiner (inf logits) gives a NaN loss; left out of the objective, it gets zeros too
    x = x.detach().clone()
    x[x == -math.inf] = math.inf
    x.requires_grad_()
    losses = transducer_loss(x, targets, T, U, reduction="none", zero_infinity=True)
    assert torch.isnan(losses[1]) and torch.isfinite(losses[[0, 2]]).all()
    torch.where(torch.isfinite(losses), losses, 0.0).sum().backward()
    assert not torch.isnan(x.grad).any()


JOINT_WIDTHS = [(torch.float32, 37), (torch.bfloat16, 37), (torch.bfloat16, 500), (torch.bfloat16, 2047),
                (torch.float32, 8193), (torch.bfloat16, 8197)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", ["rnnt", "tdt"])
@pytest.mark.parametrize("dtype,width", JOINT_WIDTHS)
@pytest.mark.parametrize("layout", ["compact", "padded"])
def test_joint_output_rows_off_16_bytes(device, loss, dtype, width, layout):
    """Logits made by an op (a joint Linear) with rows that are not a multiple of 16 bytes (TDT's 500 + 5
    columns): on CUDA the gradient of 16-bit rows up to 4 KiB goes on to that op in rows padded to 16 bytes
    (library.gradient_buffer; the kernels write them through shared memory when no 8-byte vector fits both
    row widths), other rows as the logits'; its values are those that a leaf copy of the same logits gets in
    a contiguous .grad, and equal the float64 reference's."""
    gen = torch.Generator().manual_seed(width + 2 * (dtype == torch.bfloat16) + 4 * (loss == "tdt") + 8 * len(layout))
    durations = [0, 1, 2, 3, 4]
    V = width - len(durations) if loss == "tdt" else width
    blank = V // 2
    _, _, T, U = random_batch(gen, 4, 6, 3, 2, 0)
    T[1], U[2] = 1, 0
    targets = torch.randint(0, V - 1, (4, 3), generator=gen)
    targets += targets >= blank  # labels other than blank
    padded = torch.randn(4, 6, int(U.max()) + 1, width, generator=gen, dtype=torch.float64).to(dtype)
    base = (padded if layout == "padded" else compact(padded, T, U)).to(device)
    w = torch.rand(4, generator=gen, dtype=torch.float64) + 0.5
    args = tuple(a.to(device) for a in (targets, T, U))

    def weighted_loss(logits):
        if loss == "tdt":
            losses = tdt_loss(logits, *args, durations, blank=blank, reduction="none")
        else:
            losses = transducer_loss(logits, *args, blank=blank, reduction="none")
        (losses * w.to(device)).sum().backward()
        return losses

    seen = []
    made = base.clone().requires_grad_()
    out = made * 1
    out.register_hook(seen.append)
    losses = weighted_loss(out)
    grad = seen[0]
    itemsize = base.element_size()
    wide = -(-width * itemsize // 16) * 16 // itemsize
    assert grad.shape == base.shape and grad.stride(-1) == 1
    wide_rows = device == "cuda" and itemsize == 2 and width * itemsize <= 4096
    assert grad.stride(-2) == (wide if wide_rows else width)
    leaf = base.clone().requires_grad_()
    weighted_loss(leaf)
    assert leaf.grad.is_contiguous()
    torch.testing.assert_close(grad, leaf.grad, rtol=0, atol=0)
    torch.testing.assert_close(made.grad, leaf.grad, rtol=0, atol=0)

    x = padded.double().requires_grad_()
    ref = (tdt_loss_reference(x, targets, T, U, durations, blank) if loss == "tdt" else
           transducer_loss_reference(x, targets, T, U, blank))
    (ref * w).sum().backward()
    want = x.grad if layout == "padded" else compact(x.grad, T, U)
    torch.testing.assert_close(losses.cpu().double(), ref.detach(), rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2.0 ** -7, atol=1e-4)
    torch.testing.assert_close(grad.cpu().double(), want, **tol)


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
def test_inplace_grad_misuse_raises_and_blank_accepts_integers(device):
    logits, targets, T, U = (t.to(device) for t in _good())
    x = logits.clone().requires_grad_()
    # log_softmax's backward needs its output, which the in-place gradient overwrites: autograd must notice
    loss = transducer_loss(x.log_softmax(-1), targets, T, U, from_log_softmax=True, inplace_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    import numpy as np
    a = transducer_loss(logits, targets, T, U, blank=np.int64(0))
    b = transducer_loss(logits, targets, T, U, blank=torch.tensor(0))
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="blank: expected an int"):
        TransducerLoss(blank=1.5)


def test_installed_but_broken_dependency_fails_the_tests(tmp_path, monkeypatch):
    # as torchaudio does beside a torch built for another CUDA version: a RuntimeError at import
    pkg = tmp_path / "broken_audio_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('compiled with different CUDA versions')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match="broken_audio_pkg is installed but cannot be imported: "
                                                     "RuntimeError: compiled with different CUDA versions"):
        require("broken_audio_pkg.functional", "test")
    with pytest.raises(pytest.skip.Exception, match="not_installed_pkg is not installed"):
        require("not_installed_pkg", "test")


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_grad_refuses_leaf_logits(device):
    # the gradient would overwrite a leaf's values, and autograd copies a leaf's gradient into .grad anyway:
    # refused before anything runs, for a leaf and for a view of one; an op's output is written in place,
    # with the gradient of the out-of-place loss
    logits, targets, T, U = (t.to(device) for t in _good())
    for leaf in (logits.clone().requires_grad_(), logits.clone().requires_grad_()[:, :]):
        kept = leaf.detach().clone()
        with pytest.raises(ValueError, match="inplace_grad: the logits are .*a leaf"):
            transducer_loss(leaf, targets, T, U, inplace_grad=True)
        assert torch.equal(leaf.detach(), kept)
    weight = torch.randn(5, 5, dtype=logits.dtype, device=device)
    grads = []
    for inplace_grad in (False, True):
        x = logits.clone().requires_grad_()
        joined = x @ weight
        transducer_loss(joined, targets, T, U, inplace_grad=inplace_grad).backward()
        grads.append(x.grad)
        if inplace_grad:  # the op's output now holds the loss's gradient w.r.t. it
            torch.testing.assert_close(joined.detach() @ weight.t(), x.grad)
    torch.testing.assert_close(grads[1], grads[0])
    # a tensor that needs no gradient is only read
    transducer_loss(logits, targets, T, U, inplace_grad=True)


@pytest.mark.parametrize("device", DEVICES)
def test_negative_blank_counts_from_the_end(device):
    # torchaudio's convention, for every entry point: blank=-k is blank=V-k, the same loss and gradients
    from transducer import FusedJoinerLoss, TDTLoss, fused_joiner_loss, tdt_loss
    gen = torch.Generator().manual_seed(41)
    V, D = 7, 3
    logits, targets, T, U = random_batch(gen, 3, 5, 3, V + D, blank=V - 2)
    targets = targets % (V - 2)  # labels below both blanks tried: V - 2 and V - 1
    logits, targets, T, U = (t.to(device) for t in (logits, targets, T, U))
    x = logits[..., :V]

    def same(fn):
        a, b = fn(-2), fn(V - 2)
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
        for ga, gb in zip(a[1], b[1]):
            torch.testing.assert_close(ga, gb, rtol=0, atol=0)

    def grads(loss, *inputs):
        return loss.detach(), torch.autograd.grad(loss, inputs)

    z = x.detach().requires_grad_()
    same(lambda blank: grads(transducer_loss(z, targets, T, U, blank=blank), z))
    same(lambda blank: grads(TransducerLoss(blank=blank)(z, targets, T, U), z))
    same(lambda blank: grads(rnnt_loss(z, targets, T, U, blank=blank), z))
    w = logits.detach().requires_grad_()
    same(lambda blank: grads(tdt_loss(w, targets, T, U, [0, 1, 2], blank=blank), w))
    same(lambda blank: grads(TDTLoss([0, 1, 2], blank=blank)(w, targets, T, U), w))
    enc = torch.randn(3, 5, 4, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    pred = torch.randn(3, 4, 4, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    weight = torch.randn(V + D, 4, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    same(lambda blank: grads(fused_joiner_loss(enc, pred, weight[:V], None, targets, T, U, blank=blank), enc, pred))
    same(lambda blank: grads(fused_joiner_loss(enc, pred, weight, None, targets, T, U, blank=blank,
                                               durations=[0, 1, 2]), enc, weight))
    module = FusedJoinerLoss(4, V, blank=-2, dtype=torch.float64).to(device)
    assert module.options["blank"] == V - 2
    for bad in (V, -V - 1):
        with pytest.raises(ValueError, match=rf"blank: expected an int in \[{-V}, {V}\)"):
            transducer_loss(z, targets, T, U, blank=bad)
        with pytest.raises(ValueError, match=rf"blank: expected an int in \[{-V}, {V}\)"):
            TransducerLoss(blank=bad)(z, targets, T, U)
