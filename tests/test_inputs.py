"""What the losses accept and refuse, on every device: pack (encoder and predictor outputs to compact rows), bad
arguments and values (each a clear error before any compute, the device left healthy), and inputs at the edges
of the contract: T_b = 1 and U_b = 0, strided length tensors, logits rows off 16 bytes, more than 2^31
elements, non-finite logits and incoming gradients, lengths whose products overflow."""

import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from _batches import DEVICES, compact, random_batch, to_device

from transducer import (
    FusedJoinerLoss,
    RNNTLoss,
    TDTLoss,
    TransducerLoss,
    fused_joiner_loss,
    multiblank_loss,
    pack,
    rnnt_loss,
    tdt_loss,
    tdt_loss_reference,
    transducer_loss,
    transducer_loss_reference,
)

DEV = "cuda"


# ---------------------------------------------------------------------------------------------------------
# pack


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
    with pytest.raises(ValueError, match=r"encoder_out: expected rows of at least one entry \(B, maxT, D >= 1\)"):
        pack(enc[:, :, :0], pred[:, :, :0], T, U)


def test_numpy_scalars_as_options():
    """Options take numpy's numbers as Python's (a config read through numpy): floats of any width, numpy's bool."""
    logits, targets, T, U = _good()
    want = transducer_loss(logits, targets, T, U, clamp=0.5, fastemit_lambda=0.25, zero_infinity=True)
    got = transducer_loss(
        logits, targets, T, U, clamp=np.float32(0.5), fastemit_lambda=np.float16(0.25), zero_infinity=np.bool_(True)
    )
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="zero_infinity: expected a bool, got"):
        transducer_loss(logits, targets, T, U, zero_infinity=np.float32(1.0))
    with pytest.raises(TypeError, match="clamp: expected a number, got bool"):
        transducer_loss(logits, targets, T, U, clamp=np.bool_(True))


@pytest.mark.parametrize("entry", ["loss", "loss-inplace_grad", "loss-checkpoint", "pack", "fused", "fused-checkpoint"])
def test_no_silent_second_derivative(entry):
    """A gradient taken with create_graph=True has the first derivative's value, and differentiating it raises: the
    ops have no second derivative, and one computed as if the gradient were a constant would be wrong. Also with
    inplace_grad and under non-reentrant checkpointing (whose saved tensors unpack once)."""
    torch.manual_seed(0)
    targets, T, U = torch.tensor([[1, 2], [3, 0]]), torch.tensor([4, 3]), torch.tensor([2, 1])
    enc = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    pred = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    W = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)

    def step(enc, pred, W):
        if entry.startswith("loss"):
            logits = F.linear(torch.tanh(enc[:, :, None] + pred[:, None]), W)
            return transducer_loss(logits, targets, T, U, inplace_grad=entry.endswith("inplace_grad"))
        if entry == "pack":
            return pack(torch.sin(enc), pred, T, U).square().sum()
        return fused_joiner_loss(enc, pred, W, None, targets, T, U)

    def make():
        if entry.endswith("checkpoint"):
            return torch.utils.checkpoint.checkpoint(step, enc, pred, W, use_reentrant=False)
        return step(enc, pred, W)

    inputs = (W, pred) if entry != "pack" else (enc,)
    first = torch.autograd.grad(make(), inputs)
    graphed = torch.autograd.grad(make(), inputs, create_graph=True)
    for a, b in zip(first, graphed):
        assert torch.equal(a, b.detach())
    penalty = sum(g.square().sum() for g in graphed)
    op = {"loss": "loss", "pack": "pack", "fused": "fused_joiner_loss"}[entry.split("-")[0]]
    with pytest.raises(RuntimeError, match=f"transducer::{op}: no second derivative"):
        torch.autograd.grad(penalty, enc if entry == "pack" else pred)


# ---------------------------------------------------------------------------------------------------------
# Bad arguments and values


def _good():
    """A small valid compact batch: V = 5, utterances of (T_b, U_b) = (2, 2) and (4, 0)."""
    logits = torch.randn(2 * 3 + 4 * 1, 5)
    return logits, torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 4]), torch.tensor([2, 0])


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda a: (a[0].long(),) + a[1:], TypeError, "logits: expected dtype"),
        (lambda a: (a[0][None],) + a[1:], ValueError, "logits: expected 2 or 4 dimensions"),
        (lambda a: (a[0], a[1].float()) + a[2:], TypeError, "targets: expected dtype"),
        (lambda a: (a[0], a[1][0]) + a[2:], ValueError, "targets: expected 2 dimensions"),
        (lambda a: (a[0], a[1][:1]) + a[2:], ValueError, "targets: expected 2 rows"),
        (lambda a: a[:2] + (a[2].float(), a[3]), TypeError, "logit_lengths: expected dtype"),
        (lambda a: a[:3] + (a[3][:1],), ValueError, r"target_lengths: expected shape \(2,\)"),
        # the argument that differs from the others is named, whichever it is
        (
            lambda a: a[:2] + (torch.tensor([2, 4, 1]), a[3]),
            ValueError,
            r"logit_lengths: expected shape \(2,\), one entry per utterance \(the batch size of target_lengths and "
            r"targets\), got shape \(3,\)",
        ),
        (lambda a: a[:2] + (torch.tensor([2, -1]), a[3]), ValueError, "logit_lengths: every T_b must be >= 1"),
        (lambda a: a[:2] + (torch.tensor([0, 4]), a[3]), ValueError, "logit_lengths: every T_b must be >= 1"),
        (lambda a: a[:3] + (torch.tensor([-1, 0]),), ValueError, "target_lengths: every U_b must be >= 0"),
        (lambda a: a[:3] + (torch.tensor([3, 0]),), ValueError, "target_lengths: U_b = 3 exceeds targets.size"),
        (lambda a: (a[0][:-1],) + a[1:], ValueError, "logits: compact logits must have sum_b"),
        (lambda a: (a[0], torch.tensor([[1, 5], [3, 4]])) + a[2:], ValueError, r"targets: 1 entry .* outside"),
        (lambda a: (a[0], torch.tensor([[1, 0], [3, 4]])) + a[2:], ValueError, "equal to blank"),
        (lambda a: (a[0], torch.tensor([[1, -2], [3, 4]])) + a[2:], ValueError, "targets: 1 entry within"),
        (lambda a: (a[0][:0].view(0, 5),) + (a[1][:0], a[2][:0], a[3][:0]), ValueError, "empty batch"),
    ],
)
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
    with pytest.raises(
        ValueError,
        match=r"logits: expected padded logits of 2 utterances \(the batch size of "
        r"logit_lengths, target_lengths and targets\)",
    ):
        transducer_loss(padded[:1], targets, T, U)
    with pytest.raises(
        ValueError,
        match=r"logit_lengths: expected shape \(2,\), one entry per utterance \(the batch "
        r"size of logits, target_lengths and targets\), got shape \(3,\)",
    ):
        transducer_loss(padded, targets, torch.tensor([2, 4, 1]), U)
    with pytest.raises(
        ValueError,
        match=r"target_lengths: expected shape \(2,\), .* \(the batch size of logits and "
        r"logit_lengths\)",
    ):  # two against two: the logits' side
        transducer_loss(padded, targets[:1], T, U[:1])
    with pytest.raises(TypeError, match="logits: expected a torch.Tensor"):
        transducer_loss(logits.numpy(), targets, T, U)


def test_rnnt_loss_bad_blank():
    logits, targets, T, U = random_batch(torch.Generator().manual_seed(73), 5, 7, 4, 9, 0, scale=2.0, edges=True)
    with pytest.raises(ValueError, match=r"blank: expected an int in \[-9, 9\)"):
        rnnt_loss(logits, targets, T, U, blank=9)
    with pytest.raises(TypeError, match="blank: expected an int .*, got float 1.5"):
        RNNTLoss(blank=1.5)
    with pytest.raises(ValueError, match=r"blank: expected an int in \[-9, 9\)"):
        rnnt_loss(logits, targets, T, U, blank=-10)
    for blank in (1.0, "0"):  # the wrong type: TypeError, with the type named
        with pytest.raises(TypeError, match=f"blank: expected an int .*, got {type(blank).__name__}"):
            rnnt_loss(logits, targets, T, U, blank=blank)
        with pytest.raises(TypeError, match="blank: expected an int"):
            tdt_loss(torch.cat([logits, logits[..., :2]], -1), targets, T, U, [0, 1], blank=blank)


def test_errors_name_what_is_wrong():
    """Messages in the singular where one thing is wrong, naming the argument another is compared with, the first
    bad label by its utterance, and what TDT took for the duration columns."""
    logits, targets, T, U = random_batch(torch.Generator().manual_seed(74), 3, 6, 3, 9, 0, edges=True)
    with pytest.raises(ValueError, match=r"logit_lengths: expected 1 dimension, got shape \(3, 1\)"):
        transducer_loss(logits, targets, T[:, None], U)
    enc, pred = torch.randn(1, 6, 4), torch.randn(1, 4, 4)
    w = torch.randn(9, 4)
    with pytest.raises(ValueError, match=r"targets: expected 1 entry along dim 0"):
        fused_joiner_loss(enc, pred, w, None, targets, T[:1], U[:1])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"targets: expected a tensor on cpu \(encoder_out's device\)"):
            fused_joiner_loss(enc, pred, w, None, targets[:1].cuda(), T[:1], U[:1])
    bad = targets.clone()
    bad[2, 1] = 11  # within U_2 (utterance 2 has U = 0 with edges: utterance 0 then)
    bad[0, 2] = 13
    with pytest.raises(
        ValueError,
        match=r"targets: 1 entry within target_lengths is outside \[0, 9\) or equal to "
        r"blank = 0; the first is targets\[0, 2\] = 13 \(utterance 0\)",
    ):
        transducer_loss(logits, bad, T, U)
    # TDT on logits without the duration columns: the last 5 columns were taken as durations
    with pytest.raises(
        ValueError, match="the last 5 of the logits' 9 columns are the 5 durations' scores, leaving 4 token columns"
    ):
        tdt_loss(logits, (targets % 8) + 1, T, U, [0, 1, 2, 3, 4])
    with pytest.raises(
        ValueError, match="the last 3 of weight's 9 rows are the 3 durations' scores, leaving 6 token rows"
    ):
        fused_joiner_loss(
            torch.randn(3, 6, 4), torch.randn(3, 4, 4), w, None, (targets % 8) + 1, T, U, durations=[0, 1, 2]
        )


@pytest.mark.parametrize("device", DEVICES)
def test_negative_blank_counts_from_the_end(device):
    # torchaudio's convention, for every entry point: blank=-k is blank=V-k, the same loss and gradients
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
    same(
        lambda blank: grads(
            fused_joiner_loss(enc, pred, weight, None, targets, T, U, blank=blank, durations=[0, 1, 2]), enc, weight
        )
    )
    module = FusedJoinerLoss(4, V, blank=-2, dtype=torch.float64).to(device)
    assert module.options["blank"] == V - 2
    for bad in (V, -V - 1):
        with pytest.raises(ValueError, match=rf"blank: expected an int in \[{-V}, {V}\)"):
            transducer_loss(z, targets, T, U, blank=bad)
        with pytest.raises(ValueError, match=rf"blank: expected an int in \[{-V}, {V}\)"):
            TransducerLoss(blank=bad)(z, targets, T, U)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_grad_misuse_raises_and_blank_accepts_integers(device):
    logits, targets, T, U = (t.to(device) for t in _good())
    x = logits.clone().requires_grad_()
    # log_softmax's backward needs its output, which the in-place gradient overwrites: autograd must notice
    loss = transducer_loss(x.log_softmax(-1), targets, T, U, from_log_softmax=True, inplace_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    a = transducer_loss(logits, targets, T, U, blank=np.int64(0))
    b = transducer_loss(logits, targets, T, U, blank=torch.tensor(0))
    torch.testing.assert_close(a, b)
    with pytest.raises(TypeError, match="blank: expected an int"):
        TransducerLoss(blank=1.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True])
def test_inplace_grad_refuses_leaf_logits(device, compiled):
    # the gradient would overwrite a leaf's values, and autograd copies a leaf's gradient into .grad anyway:
    # refused before anything runs, for a leaf and for a view of one, eager and under torch.compile (AOTAutograd's
    # backward, which would write over the leaf too); an op's output is written in place, with the gradient of
    # the out-of-place loss, in one graph
    torch._dynamo.reset()
    logits, targets, T, U = (t.to(device) for t in _good())

    def loss(x, inplace_grad=True):
        return transducer_loss(x, targets, T, U, inplace_grad=inplace_grad)

    def joined_loss(x, weight, inplace_grad):
        return loss(x @ weight, inplace_grad)

    if compiled:
        loss = torch.compile(loss, backend="aot_eager")
        joined_loss = torch.compile(joined_loss, backend="aot_eager", fullgraph=True)
    for leaf in (logits.clone().requires_grad_(), logits.clone().requires_grad_()[:, :]):
        kept = leaf.detach().clone()
        with pytest.raises(ValueError, match="inplace_grad: the logits are .*a leaf"):
            loss(leaf)
        assert torch.equal(leaf.detach(), kept)
    weight = torch.randn(5, 5, dtype=logits.dtype, device=device)
    grads = []
    for inplace_grad in (False, True):
        x = logits.clone().requires_grad_()
        joined_loss(x, weight, inplace_grad).backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0])
    assert grads[0].abs().max() > 0.01
    if not compiled:  # the op's output now holds the loss's gradient w.r.t. it
        x = logits.clone().requires_grad_()
        joined = x @ weight
        transducer_loss(joined, targets, T, U, inplace_grad=True).backward()
        torch.testing.assert_close(joined.detach() @ weight.t(), x.grad)
    # a tensor that needs no gradient is only read
    kept = logits.clone()
    loss(logits)
    assert torch.equal(logits, kept)


@pytest.mark.cuda
def test_bad_values_raise_on_cuda():
    logits = torch.randn(2 * 3 + 4, 5, device=DEV)
    targets = torch.tensor([[1, 2], [3, 4]], device=DEV)
    T, U = torch.tensor([2, 4], device=DEV), torch.tensor([2, 0], device=DEV)
    with pytest.raises(ValueError, match="targets: 1 entry within"):
        transducer_loss(logits, torch.tensor([[1, 0], [3, 4]], device=DEV), T, U)
    with pytest.raises(ValueError, match="logits: compact logits must have sum_b"):
        transducer_loss(logits[:-1], targets, T, U)
    with pytest.raises(ValueError, match="logit_lengths: every T_b must be >= 1"):
        transducer_loss(logits, targets, torch.tensor([0, 4], device=DEV), U)
    with pytest.raises(ValueError, match="targets: expected a tensor on cuda"):
        transducer_loss(logits, targets.cpu(), T, U)


@pytest.mark.cuda
def test_bad_values_leave_the_device_healthy():
    """The checks run while log_probs is already queued: wild lengths and labels must raise, with no
    out-of-bounds access (a fault would poison the context and show at the synchronisations below)."""
    gen = torch.Generator().manual_seed(5)
    logits, targets, T, U = random_batch(gen, 3, 6, 4, 9, 0, dtype=torch.float32)
    logits = compact(logits, T, U).to(DEV)
    targets, T, U = targets.to(DEV), T.to(DEV), U.to(DEV)
    wild = [
        ("logit_lengths", dict(T=torch.tensor([10**6, -5, 3], device=DEV))),
        ("target_lengths", dict(U=torch.tensor([10**6, 2, -7], device=DEV))),
        ("targets", dict(targets=targets.clone().fill_(10**9))),
        ("targets", dict(targets=targets.clone().fill_(-(10**9)))),
        ("logits", dict(T=T * 1000)),
    ]
    for name, change in wild:
        args = {**dict(logits=logits, targets=targets, T=T, U=U), **change}
        with pytest.raises(ValueError, match=name):
            transducer_loss(args["logits"], args["targets"], args["T"], args["U"])
        torch.cuda.synchronize()
    x = logits.clone().requires_grad_()
    transducer_loss(x, targets, T, U).backward()
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "T, U",
    [
        ([2**62, 2], [3, 1]),  # T_b * (U_b + 1) wraps to 0 + 4 = 4 rows
        ([2**31, 2**31, 2**31, 2**31, 2], [2**31 - 1] * 4 + [1]),  # each product 2^62: the sum wraps
        ([2, 1], [2**63 - 1, 0]),  # U_b + 1 itself overflows
    ],
)
def test_lengths_whose_products_overflow(device, T, U):
    logits = torch.randn(4, 5)
    targets = torch.ones(len(T), 2, dtype=torch.long)
    T, U = torch.tensor(T), torch.tensor(U)
    with pytest.raises(ValueError, match=r"logit_lengths, target_lengths: sum_b T_b\*\(U_b\+1\) overflows"):
        transducer_loss(*to_device(device, logits, targets, T, U))


@pytest.mark.parametrize("device", DEVICES)
def test_lengths_whose_sum_wraps(device):
    """Sixteen products of 2^60 cells each, below the saturation bound, wrap their int64 sum to the 6 rows of
    the logits: refused by every entry. pack and the fused loss get expanded inputs whose copy would need
    hundreds of GB: refused before it."""
    T, U = torch.tensor([2**60] * 16 + [6]), torch.zeros(17, dtype=torch.long)
    logits, targets = torch.randn(6, 5), torch.ones(17, 1, dtype=torch.long)
    overflow = r"logit_lengths, target_lengths: sum_b T_b\*\(U_b\+1\) overflows"
    for loss in (transducer_loss, rnnt_loss, TransducerLoss(), RNNTLoss()):
        with pytest.raises(ValueError, match=overflow):
            loss(*to_device(device, logits, targets, T, U))
    with pytest.raises(ValueError, match=overflow):
        tdt_loss(*to_device(device, logits, targets, T, U), durations=[0, 1])
    with pytest.raises(ValueError, match=overflow):
        multiblank_loss(*to_device(device, logits, targets, T, U), big_blank_durations=[2], blank=-1)
    T, U = torch.tensor([2**30] * 16 + [6]), torch.tensor([2**30 - 1] * 16 + [0])
    enc = pred = torch.zeros(1, 1, 1, device=device).expand(17, 2**30, 2)
    rows = r"sum_b T_b\*\(U_b\+1\) = 2\^61 or more \(it overflows\) rows; at most 2\^31 - 1"
    with pytest.raises(ValueError, match=rows):
        pack(enc, pred, *to_device(device, T, U))
    with pytest.raises(ValueError, match=rows):
        fused_joiner_loss(enc, pred, torch.randn(5, 2, device=device), None, *to_device(device, targets, T, U))


def test_row_counts_beyond_32_bits():
    one = torch.zeros(1, 1)
    T, U = torch.tensor([2**31]), torch.tensor([0])
    # refused from the shape, before the entries copy the expanded view (43 GB)
    wide = torch.zeros(1, 5).expand(2**31, 5)
    for loss in (
        transducer_loss,
        functools.partial(tdt_loss, durations=[0, 1]),
        functools.partial(multiblank_loss, big_blank_durations=[2], blank=-1),
    ):
        with pytest.raises(ValueError, match=r"logits: at most 2\^31 - 1 rows"):
            loss(wide, torch.zeros(1, 1, dtype=torch.long), T, U)
    with pytest.raises(ValueError, match=r"logits: at most 2\^31 - 1 rows"):
        transducer_loss(one.expand(1, 2**16, 2**15, 1), torch.zeros(1, 1, dtype=torch.long), T, U)
    enc, pred = torch.zeros(1, 1, 1).expand(2, 2**16, 4), torch.zeros(1, 1, 1).expand(2, 2**15 + 1, 4)
    with pytest.raises(ValueError, match=r"sum_b T_b\*\(U_b\+1\) = 4295098368 rows; at most 2\^31 - 1"):
        pack(enc, pred, torch.tensor([2**16, 2**16]), torch.tensor([2**15, 2**15]))


@pytest.mark.cuda
@pytest.mark.parametrize("lengths", ["U_past_the_threads", "T_past_the_grid_U_negative"])
def test_unchecked_lengths_stay_in_bounds(lengths):
    """check_inputs=False with lengths that break the contract gives undefined values but no illegal address
    (which would break the CUDA context for the rest of the process): the TDT walk plants beta(T, U) = 0 only
    inside its shared memory (U_0 = 5000 against 32 threads a block), and the padded walks' fill stays within
    the utterance's rows (T_0 past the padded T, U_0 = -1)."""
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
    got = transducer_loss(*to_device("cuda", logits, targets, T, U), reduction="none")
    torch.testing.assert_close(got.cpu(), transducer_loss_reference(logits, targets, T, U))


# ---------------------------------------------------------------------------------------------------------
# Shapes and layouts at the edges


def test_edge_shapes_t1_u0():
    for T, U in [(1, 0), (1, 3), (4, 0)]:
        logits = torch.randn(T * (U + 1), 6, dtype=torch.float64, requires_grad=True)
        targets = torch.randint(1, 6, (1, max(U, 1)))
        lengths = torch.tensor([T]), torch.tensor([U])
        got = transducer_loss(logits, targets, *lengths)
        expected = transducer_loss_reference(logits.view(1, T, U + 1, 6), targets, *lengths).mean()
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check_inputs", [True, False])
def test_length_columns_of_one_tensor(device, check_inputs):
    # T and U as two columns of one (B, 2) tensor: each needs its own contiguous copy for the kernels,
    # and both copies must live until the launch that reads them is queued
    gen = torch.Generator().manual_seed(40)
    logits, targets, T, U = random_batch(gen, 5, 9, 4, 13, blank=0, dtype=torch.float32, edges=True)
    lens = torch.stack([T, U], dim=1)
    strided_T, strided_U = lens[:, 0], lens[:, 1]
    assert not strided_T.is_contiguous()
    for x in (logits, compact(logits, T, U)):
        want = transducer_loss(*to_device(device, x, targets, T, U), reduction="none")
        x, targets_d, sT, sU = to_device(device, x, targets, strided_T, strided_U)
        x.requires_grad_()
        got = transducer_loss(x, targets_d, sT, sU, reduction="none", check_inputs=check_inputs)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got.sum().backward()
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0

    enc = torch.randn(5, 9, 6, generator=gen).to(device)
    pred = torch.randn(5, 5, 6, generator=gen).to(device)
    want = pack(enc, pred, *to_device(device, T, U))
    torch.testing.assert_close(pack(enc, pred, *to_device(device, strided_T, strided_U)), want, rtol=0, atol=0)


JOINT_WIDTHS = [
    (torch.float32, 37),
    (torch.bfloat16, 37),
    (torch.bfloat16, 500),
    (torch.bfloat16, 2047),
    (torch.float32, 8193),
    (torch.bfloat16, 8197),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", ["rnnt", "tdt"])
@pytest.mark.parametrize("dtype,width", JOINT_WIDTHS)
@pytest.mark.parametrize("layout", ["compact", "padded"])
def test_joint_output_rows_off_16_bytes(device, loss, dtype, width, layout):
    """Logits made by an op (a joint Linear) with rows that are not a multiple of 16 bytes (TDT's 500 + 5
    columns): on CUDA the gradient of 16-bit rows up to 4 KiB goes on to that op in rows padded to 16 bytes
    (custom_ops.gradient_buffer; the kernels write them through shared memory when no 8-byte vector fits both
    row widths), other rows as the logits'; its values are those that a leaf copy of the same logits gets in
    a contiguous .grad, and equal the float64 reference's."""
    gen = torch.Generator().manual_seed(width + 2 * (dtype == torch.bfloat16) + 4 * (loss == "tdt") + 8 * len(layout))
    durations = [0, 1, 2, 3, 4]
    V = width - len(durations) if loss == "tdt" else width
    blank = V // 2
    padded, targets, T, U = random_batch(gen, 4, 6, 3, V, blank, dtype=dtype, edges=True, extra=width - V)
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
    ref = (
        tdt_loss_reference(x, targets, T, U, durations, blank)
        if loss == "tdt"
        else transducer_loss_reference(x, targets, T, U, blank)
    )
    (ref * w).sum().backward()
    want = x.grad if layout == "padded" else compact(x.grad, T, U)
    torch.testing.assert_close(losses.cpu().double(), ref.detach(), rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2.0**-7, atol=1e-4)
    torch.testing.assert_close(grad.cpu().double(), want, **tol)


@pytest.mark.cuda
@pytest.mark.parametrize("from_log_softmax", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_off_a_16_byte_boundary(from_log_softmax, dtype):
    # contiguous logits one element past an aligned address: the gradient (a new, aligned tensor) lies
    # at another offset from a 16-byte boundary than the logits; with from_log_softmax the gradient
    # kernel reads no logits and lays its row pass on the gradient alone (transducer.cuda.stages.gradient)
    gen = torch.Generator().manual_seed(71 + from_log_softmax)
    logits, targets, T, U = random_batch(gen, 4, 12, 5, 500, blank=3, dtype=torch.float32, scale=3.0, edges=True)
    if from_log_softmax:
        logits = logits.log_softmax(-1)
    logits = logits.to(dtype)
    ref_in = logits.double().requires_grad_()
    ref = transducer_loss_reference(ref_in, targets, T, U, blank=3, from_log_softmax=from_log_softmax)
    ref.sum().backward()
    ref = ref.detach()
    logits = compact(logits, T, U)
    buf = torch.empty(logits.numel() + 1, dtype=dtype, device=DEV)
    x = buf[1:].view(logits.shape)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    x.copy_(logits.to(DEV)).requires_grad_()
    got = transducer_loss(
        x, *(a.to(DEV) for a in (targets, T, U)), blank=3, reduction="none", from_log_softmax=from_log_softmax
    )
    got.sum().backward()
    # float32: absolute error ~ |loss| ulp (as above); bf16: the gradient is rounded to 8 bits
    atol = 1e-6 * max(1.0, float(ref.abs().max())) if dtype == torch.float32 else 1e-2
    rtol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(x.grad.cpu().double(), compact(ref_in.grad, T, U), rtol=rtol, atol=atol)


@pytest.mark.cuda
def test_more_than_2_31_elements():
    """Compact fp16 logits of more than 2^31 elements (about 4.3 GB): the rows past element 2^31 are right."""
    V, T0, U0, B = 8192, 50, 20, 252
    rows_per = T0 * (U0 + 1)
    N = B * rows_per
    assert N * V > 2**31
    straddle = (2**31) // V // rows_per  # the utterance whose rows cross element 2^31
    assert straddle < B - 1
    torch.cuda.empty_cache()
    gen = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randn(N, V, generator=gen, device=DEV, dtype=torch.float16).requires_grad_()
    targets = torch.randint(1, V, (B, U0), generator=gen, device=DEV)
    T = torch.full((B,), T0, device=DEV)
    U = torch.full((B,), U0, device=DEV)
    weights = torch.rand(B, generator=gen, device=DEV) + 0.5
    losses = transducer_loss(logits, targets, T, U, reduction="none")
    (losses * weights).sum().backward()
    grad = logits.grad
    for b in (straddle - 1, straddle, B - 1):
        rows = logits.detach()[b * rows_per : (b + 1) * rows_per].cpu().double().requires_grad_()
        ref = transducer_loss(rows, targets[b : b + 1].cpu(), T[b : b + 1].cpu(), U[b : b + 1].cpu(), reduction="sum")
        (ref * weights[b].cpu().double()).backward()
        torch.testing.assert_close(losses[b].double().cpu(), ref.detach(), rtol=1e-5, atol=0)
        torch.testing.assert_close(
            grad[b * rows_per : (b + 1) * rows_per].float().cpu(), rows.grad.float(), rtol=2.0**-10, atol=1e-6
        )
    assert torch.isfinite(losses).all()
    del logits, grad
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# Non-finite logits and gradients


NON_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["compact", "padded"])
@pytest.mark.parametrize("rna", [False, True])
def test_non_finite_logit_makes_its_utterance_nan(device, layout, rna):
    """Contract: a NaN or +-inf logit among an utterance's cells makes its loss NaN and its gradient zero,
    on every device; other utterances keep their loss and gradient; zero_infinity never hides a NaN."""
    gen = torch.Generator().manual_seed(41 + rna)
    logits, targets, T, U = random_batch(gen, 4, 7, 3, 9, blank=2, rna=rna)
    T[1], U[1] = (4, 0)  # a U_b = 0 utterance
    T[2], U[2] = (1, 0)  # a T_b = 1 utterance
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
            args = to_device(device, targets, T, U)
            for zero_infinity in (False, True):
                got = transducer_loss(
                    inp, *args, blank=2, reduction="none", one_sym_per_frame=rna, zero_infinity=zero_infinity
                )
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
    got = transducer_loss(
        *to_device(device, compact(logits, T, U), targets, T, U), reduction="none", one_sym_per_frame=True
    )
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
    got = transducer_loss(x, *to_device(device, targets, T, U), reduction="none", from_log_softmax=True)
    want = transducer_loss_reference(lp, targets, T, U, from_log_softmax=True)
    assert math.isinf(got[1].item()) and got[1].item() > 0
    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-10)
    got[[0, 2]].sum().backward()
    assert torch.isfinite(x.grad).all()
    zeroed = transducer_loss(
        x, *to_device(device, targets, T, U), reduction="none", from_log_softmax=True, zero_infinity=True
    )
    assert zeroed[1].item() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["compact", "padded"])
def test_non_finite_utterances_get_zero_gradient(layout, device):
    # utterance 1 cannot emit blank (log-prob -inf), so it has no alignment: with zero_infinity the batch
    # still trains
    gen = torch.Generator().manual_seed(31)
    logits, targets, T, U = random_batch(gen, 3, 6, 4, 9, blank=0)
    logits = logits.log_softmax(-1)
    logits[1, :, :, 0] = -math.inf
    expected = transducer_loss_reference(logits[[0, 2]], targets[[0, 2]], T[[0, 2]], U[[0, 2]], from_log_softmax=True)
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
        transducer_loss(x, targets, T.to(device), U.to(device), reduction="none").backward(
            weight.to(device, torch.float64)
        )
        grads.append(x.grad)
    unit, infinite = grads
    rows = int(T[0] * (U[0] + 1))
    assert torch.equal(infinite[:rows], torch.zeros_like(unit[:rows]))
    assert (unit[rows:] != 0).all()
    torch.testing.assert_close(infinite[rows:], unit[rows:] * math.inf)
