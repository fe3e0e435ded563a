"""Inputs at the edges of the contract, on every device: strided length tensors, non-finite logits,
lengths whose products overflow, and the bf16 rounding that GPUs before sm_80 do in software."""

import math

import numpy as np
import pytest
import torch

from _batches import DEVICES, compact, random_batch
from transducer import pack, transducer_loss, transducer_loss_reference


def to(device, *tensors):
    return tuple(t.to(device) for t in tensors)


# ------------------------------------------------------------------------------------ strided lengths


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check_inputs", [True, False])
def test_length_columns_of_one_tensor(device, check_inputs):
    # T and U as two columns of one (B, 2) tensor: each needs its own contiguous copy for the kernels,
    # and both copies must live until the launch that reads them is queued
    gen = torch.Generator().manual_seed(40)
    logits, targets, T, U = random_batch(gen, 5, 9, 4, 13, blank=0, dtype=torch.float32)
    T[1], U[2] = 1, 0
    lens = torch.stack([T, U], dim=1)
    strided_T, strided_U = lens[:, 0], lens[:, 1]
    assert not strided_T.is_contiguous()
    for x in (logits, compact(logits, T, U)):
        want = transducer_loss(*to(device, x, targets, T, U), reduction="none")
        x, targets_d, sT, sU = to(device, x, targets, strided_T, strided_U)
        x.requires_grad_()
        got = transducer_loss(x, targets_d, sT, sU, reduction="none", check_inputs=check_inputs)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got.sum().backward()
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0

    enc = torch.randn(5, 9, 6, generator=gen).to(device)
    pred = torch.randn(5, 5, 6, generator=gen).to(device)
    want = pack(enc, pred, *to(device, T, U))
    torch.testing.assert_close(pack(enc, pred, *to(device, strided_T, strided_U)), want, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ non-finite logits


NON_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["compact", "padded"])
@pytest.mark.parametrize("rna", [False, True])
def test_non_finite_logit_makes_its_utterance_nan(device, layout, rna):
    """Contract: a NaN or +-inf logit among an utterance's cells makes its loss NaN and its gradient zero,
    on every device; other utterances keep their loss and gradient; zero_infinity never hides a NaN."""
    gen = torch.Generator().manual_seed(41 + rna)
    logits, targets, T, U = random_batch(gen, 4, 7, 3, 9, blank=2, rna=rna)
    T[1], U[1] = (4, 0)          # a U_b = 0 utterance
    T[2], U[2] = (1, 0)          # a T_b = 1 utterance
    if rna:
        U[3] = min(int(U[3]), int(T[3]) - 1)
    weights = torch.rand(4, generator=gen, dtype=torch.float64) + 0.5
    for value in NON_FINITE:
        for b, (t, u, v) in [(1, (3, 0, 0)), (2, (0, 0, 5)), (0, (int(T[0]) - 1, 0, 2))]:
            x = logits.clone()
            x[b, t, u, v] = value
            ref_in = x.clone().requires_grad_()
            ref = transducer_loss_reference(ref_in, targets, T, U, blank=2, one_sym_per_frame=rna)
            assert math.isnan(ref[b].item())
            keep = [i for i in range(4) if i != b]
            (ref[keep] * weights[keep]).sum().backward()

            inp = (compact(x, T, U) if layout == "compact" else x).to(device).requires_grad_()
            args = to(device, targets, T, U)
            for zero_infinity in (False, True):
                got = transducer_loss(inp, *args, blank=2, reduction="none", one_sym_per_frame=rna,
                                      zero_infinity=zero_infinity)
                assert math.isnan(got[b].item()), (value, b, zero_infinity)
                torch.testing.assert_close(got[keep].cpu(), ref[keep].detach(), rtol=1e-10, atol=1e-10)
            (got * weights.to(device)).sum().backward()  # NaN loss, but its utterance's gradient is zero
            want = ref_in.grad.clone()
            want[b] = 0  # the reference's log_softmax backward leaves NaN on the bad row itself
            want = compact(want, T, U) if layout == "compact" else want
            torch.testing.assert_close(inp.grad.cpu(), want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_logit_off_the_rna_band(device):
    # cell (0, U) lies on no RNA alignment when U > 0, yet a NaN there still makes the loss NaN
    gen = torch.Generator().manual_seed(43)
    logits, targets, T, U = random_batch(gen, 2, 6, 3, 5, blank=0, rna=True)
    T[0], U[0] = 6, 3
    logits[0, 0, 3, 1] = math.nan
    got = transducer_loss(*to(device, compact(logits, T, U), targets, T, U), reduction="none", one_sym_per_frame=True)
    ref = transducer_loss_reference(logits, targets, T, U, one_sym_per_frame=True)
    assert math.isnan(got[0].item()) and math.isnan(ref[0].item())
    torch.testing.assert_close(got[1].cpu(), ref[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
def test_log_probs_may_be_minus_inf(device):
    # from_log_softmax: -inf log-probs are legal (a blank that cannot be emitted: no alignment, +inf)
    gen = torch.Generator().manual_seed(44)
    logits, targets, T, U = random_batch(gen, 3, 6, 3, 7, blank=0)
    lp = logits.log_softmax(-1)
    lp[1, :, :, 0] = -math.inf
    lp[0, 0, 0, 4] = -math.inf
    x = lp.to(device).requires_grad_()
    got = transducer_loss(x, *to(device, targets, T, U), reduction="none", from_log_softmax=True)
    want = transducer_loss_reference(lp, targets, T, U, from_log_softmax=True)
    assert math.isinf(got[1].item()) and got[1].item() > 0
    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-10)
    got[[0, 2]].sum().backward()
    assert torch.isfinite(x.grad).all()
    zeroed = transducer_loss(x, *to(device, targets, T, U), reduction="none", from_log_softmax=True,
                             zero_infinity=True)
    assert zeroed[1].item() == 0


# ------------------------------------------------------------------------------------ huge lengths


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T, U", [
    ([2**62, 2], [3, 1]),                    # T_b * (U_b + 1) wraps to 0 + 4 = 4 rows
    ([2**31, 2**31, 2**31, 2**31, 2], [2**31 - 1] * 4 + [1]),  # each product 2^62: the sum wraps
    ([2, 1], [2**63 - 1, 0]),                # U_b + 1 itself overflows
])
def test_lengths_whose_products_overflow(device, T, U):
    logits = torch.randn(4, 5)
    targets = torch.ones(len(T), 2, dtype=torch.long)
    T, U = torch.tensor(T), torch.tensor(U)
    with pytest.raises(ValueError, match=r"logit_lengths, target_lengths: sum_b T_b\*\(U_b\+1\) overflows"):
        transducer_loss(*to(device, logits, targets, T, U))


def test_row_counts_beyond_32_bits():
    one = torch.zeros(1, 1)
    T, U = torch.tensor([2**31]), torch.tensor([0])
    with pytest.raises(ValueError, match=r"logits: at most 2\^31 - 1 rows"):
        transducer_loss(one.expand(2**31, 1), torch.zeros(1, 1, dtype=torch.long), T, U)
    with pytest.raises(ValueError, match=r"logits: at most 2\^31 - 1 rows"):
        transducer_loss(one.expand(1, 2**16, 2**15, 1), torch.zeros(1, 1, dtype=torch.long), T, U)
    enc, pred = torch.zeros(1, 1, 1).expand(2, 2**16, 4), torch.zeros(1, 1, 1).expand(2, 2**15 + 1, 4)
    with pytest.raises(ValueError, match=r"sum_b T_b\*\(U_b\+1\) = 4295098368 rows; at most 2\^31 - 1"):
        pack(enc, pred, torch.tensor([2**16, 2**16]), torch.tensor([2**15, 2**15]))


# ------------------------------------------------------------------------------------ bf16 rounding


def bf16_bits_rn(x):
    """A numpy transcription of ops/numeric.cuh's bf16_bits_rn, the software float -> bf16 rounding used
    before sm_80 (the GPU test in tests/test_cuda.py runs the device function itself)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def test_software_bf16_rounding_matches_torch():
    gen = torch.Generator().manual_seed(45)
    x = torch.cat([
        torch.randn(100_000, generator=gen) * 10.0 ** torch.randint(-40, 39, (100_000,), generator=gen),
        torch.tensor([0.0, -0.0, math.inf, -math.inf, 3.3895e38, -3.3895e38, 1e-45, -1e-45, 1.0 + 2**-8,
                      1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20]),
        torch.randint(0, 2**31 - 1, (10_000,), generator=gen, dtype=torch.int32).view(torch.float32),
    ])
    got = bf16_bits_rn(x.numpy())
    want = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = torch.isfinite(x).numpy() | torch.isinf(x).numpy()
    assert np.array_equal(got[finite], want[finite])
    nans = ~finite
    assert nans.any()
    assert np.isnan(torch.from_numpy(got[nans].view(np.int16)).view(torch.bfloat16).float().numpy()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_infinite_incoming_gradient(device):
    """An infinite incoming gradient gives the unit gradient times inf (no NaN from inf - inf): the CPU stages
    multiply the scale into their per-row terms only when it is finite."""
    gen = torch.Generator().manual_seed(31)
    T, U, V = torch.tensor([4, 3]), torch.tensor([2, 1]), 6
    logits = torch.randn(int((T * (U + 1)).sum()), V, generator=gen, dtype=torch.float64).to(device)
    targets = torch.randint(1, V, (2, 2), generator=gen).to(device)
    grads = []
    for weight in (torch.tensor([0.0, 1.0]), torch.tensor([0.0, math.inf])):
        x = logits.clone().requires_grad_()
        transducer_loss(x, targets, T.to(device), U.to(device), reduction="none").backward(weight.to(device,
                                                                                                   torch.float64))
        grads.append(x.grad)
    unit, infinite = grads
    rows = int(T[0] * (U[0] + 1))
    assert torch.equal(infinite[:rows], torch.zeros_like(unit[:rows]))
    assert (unit[rows:] != 0).all()
    torch.testing.assert_close(infinite[rows:], unit[rows:] * math.inf)


def test_cuda_gradient_names_a_bad_out():
    # transducer.cuda.gradient writes into `out` of the logits' shape and dtype, at any row stride (the
    # loss's padded gradient rows) but unit column stride; anything else is a ValueError naming `out`, raised
    # before any launch (so it is checked here on CPU tensors, without a GPU)
    from transducer import cuda
    logits = torch.randn(6, 5)
    args = (None,) * 4  # targets, lattice, scale, options: not reached
    for bad in (torch.empty(6, 5, dtype=torch.float64), torch.empty(6, 4), torch.empty(5, 6).t()):
        with pytest.raises(ValueError, match="out must"):
            cuda.gradient(logits, *args, bad)


@pytest.mark.cuda
@pytest.mark.parametrize("lengths", ["U_past_the_threads", "T_past_the_grid_U_negative"])
def test_unchecked_lengths_stay_in_bounds(lengths):
    """check_inputs=False with lengths that break the contract gives undefined values but no illegal address
    (which would break the CUDA context for the rest of the process): the TDT walk plants beta(T, U) = 0 only
    inside its shared memory (U_0 = 5000 against 32 threads a block), and the padded walks' fill stays within
    the utterance's rows (T_0 past the padded T, U_0 = -1)."""
    from transducer import tdt_loss
    gen = torch.Generator().manual_seed(47)
    B, maxT, maxU, V, durations = 3, 6, 5, 7, [0, 1, 2]
    T, U = torch.tensor([maxT, 4, 5]), torch.tensor([maxU, 2, 3])
    if lengths == "U_past_the_threads":
        U[0] = 5000
    else:
        T[0], U[0] = maxT + 3, -1
    targets = torch.randint(1, V, (B, maxU), generator=gen)
    for width in (V + len(durations), V):
        logits = torch.randn(B, maxT, maxU + 1, width, generator=gen).cuda().requires_grad_()
        args = (logits, targets.cuda(), T.cuda(), U.cuda())
        if width == V:
            if lengths == "U_past_the_threads":
                continue  # the RNN-T walk of a U past its columns reads global memory past the grid: not covered
            loss = transducer_loss(*args, reduction="sum", check_inputs=False)
        else:
            loss = tdt_loss(*args, durations, reduction="sum", check_inputs=False)
        loss.backward()
        torch.cuda.synchronize()  # raises on an illegal address
    # the context still works, and a valid batch still gives the reference's value
    logits, targets, T, U = random_batch(gen, 3, 5, 3, 6, blank=0, dtype=torch.float64)
    got = transducer_loss(*to("cuda", logits, targets, T, U), reduction="none")
    torch.testing.assert_close(got.cpu(), transducer_loss_reference(logits, targets, T, U))
