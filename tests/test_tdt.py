"""transducer.tdt_loss and TDTLoss on every device against the float64 reference: compact and padded, concatenated
and split heads (column views read in place), durations with and without 0, infeasible utterances, sigma, omega,
FastEmit, clamp, every reduction, half precision; the registered op under opcheck and torch.compile; the
durations' checks and bad input."""

import math

import pytest
import torch
import torch._dynamo
from _batches import DEVICES, cell_mask, compact, random_batch

import transducer.tdt
from transducer import TDTLoss, tdt_loss, tdt_loss_reference
from transducer.checks import check_durations
from transducer.cpu import stages as cpu
from transducer.options import LossOptions

CASES = [  # durations, blank, options
    ([0, 1, 2, 3, 4], 0, {}),
    ([1, 2], 3, dict(sigma=0.05)),
    ([0, 2, 3], 8, dict(omega=0.3)),
    ([1, 3, 4], 2, dict(fastemit_lambda=0.2, sigma=0.1, omega=0.1)),
    ([0, 1, 2], 0, dict(clamp=0.1)),
    ([0, 1, 65535], 0, {}),  # the longest duration taken: no arc of it fits an utterance
]


def reference(logits, targets, T, U, durations, blank, w, clamp=-1.0, **options):
    """The reference losses and the gradient of sum_b w_b * loss_b (its token scores' part clamped per utterance
    before weighting)."""
    x = logits.double().clone().requires_grad_()
    losses = tdt_loss_reference(x, targets, T, U, durations, blank, **options)
    live = torch.isfinite(losses)
    if clamp > 0:  # the unit gradient of each utterance, its token columns clamped (NeMo's), then weighted
        grad = torch.autograd.grad(losses[live].sum(), x)[0]
        tokens = grad.size(-1) - len(durations)
        grad[..., :tokens] = grad[..., :tokens].clamp(-clamp, clamp)
        grad = grad * w[:, None, None, None]
    else:
        grad = torch.autograd.grad((losses[live] * w[live]).sum(), x)[0]
    return losses.detach(), grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["compact", "padded"])
@pytest.mark.parametrize("heads", ["joint", "split"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference_float64(device, layout, heads, case):
    durations, blank, options = CASES[case]
    gen = torch.Generator().manual_seed(600 + case)
    logits, targets, T, U = random_batch(gen, 5, 7, 3, 9, blank, scale=1.5, edges=True, extra=len(durations))
    w = torch.rand(5, generator=gen, dtype=torch.float64) + 0.5
    want, want_grad = reference(logits, targets, T, U, durations, blank, w, **options)
    V = logits.size(-1) - len(durations)
    x = compact(logits, T, U) if layout == "compact" else logits
    if heads == "split":
        tok = x[..., :V].contiguous().to(device).requires_grad_()
        dur = x[..., V:].contiguous().to(device).requires_grad_()
        inputs, kwargs = (tok,), dict(duration_logits=dur)
    else:
        tok = x.to(device).requires_grad_()
        inputs, kwargs = (tok,), {}
    got = tdt_loss(
        *inputs,
        targets.to(device),
        T.to(device),
        U.to(device),
        durations,
        blank=blank,
        reduction="none",
        **options,
        **kwargs,
    )
    torch.testing.assert_close(got.cpu(), want, rtol=1e-9, atol=1e-10)
    (got[torch.isfinite(got)] * w.to(device)[torch.isfinite(got)]).sum().backward()
    grad = torch.cat([tok.grad, dur.grad], dim=-1) if heads == "split" else tok.grad
    expect = compact(want_grad, T, U) if layout == "compact" else want_grad
    torch.testing.assert_close(grad.cpu(), expect, rtol=1e-9, atol=1e-10)
    if layout == "padded":
        assert (grad.cpu()[~cell_mask(logits, T, U)] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_float32_and_reductions(device):
    durations = [0, 1, 2, 3, 4]
    gen = torch.Generator().manual_seed(610)
    logits, targets, T, U = random_batch(gen, 6, 20, 6, 64, 0, scale=1.5, edges=True, extra=len(durations))
    want, want_grad = reference(logits, targets, T, U, durations, 0, torch.ones(6, dtype=torch.float64), sigma=0.05)
    x = compact(logits, T, U).float().to(device).requires_grad_()
    args = (targets.to(device), T.to(device), U.to(device), durations)
    for reduction, value in (("none", want), ("sum", want.sum()), ("mean", want.mean())):
        got = tdt_loss(x, *args, reduction=reduction, sigma=0.05)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.cpu().double(), value, rtol=2e-5, atol=2e-5)
    tdt_loss(x, *args, reduction="sum", sigma=0.05).backward()
    torch.testing.assert_close(x.grad.cpu().double(), compact(want_grad, T, U), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, dtype):
    durations = [0, 1, 2]
    gen = torch.Generator().manual_seed(620)
    logits, targets, T, U = random_batch(gen, 4, 12, 5, 40, 0, scale=1.5, edges=True, extra=len(durations))
    half = compact(logits, T, U).to(dtype).to(device).requires_grad_()
    full = half.detach().float().requires_grad_()
    args = (targets.to(device), T.to(device), U.to(device), durations)
    got, expected = tdt_loss(half, *args, reduction="none"), tdt_loss(full, *args, reduction="none")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    expected.sum().backward()
    assert half.grad.dtype == dtype
    eps = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    torch.testing.assert_close(half.grad.float(), full.grad, rtol=eps, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_infeasible_and_non_finite(device):
    # durations [2] only: a blank moves two frames, so T_b = 3 with U_b = 0 has no alignment (+inf, zero
    # gradient, 0 with zero_infinity); a NaN score makes its utterance NaN
    gen = torch.Generator().manual_seed(630)
    logits, targets, T, U = random_batch(gen, 3, 4, 1, 5, 0, scale=1.5, edges=True, extra=1)
    T[:], U[:] = torch.tensor([3, 4, 4]), torch.tensor([0, 1, 0])
    logits[2, 0, 0, 3] = math.nan
    logits[0, 1, 1, 2] = math.nan  # a padding row of utterance 0 (U_0 = 0): its log-probs go unused
    x = logits.to(device).requires_grad_()
    args = (targets.to(device), T.to(device), U.to(device), [2])
    got = tdt_loss(x, *args, reduction="none")
    want = tdt_loss_reference(logits, targets, T, U, [2])
    assert math.isinf(got[0].item()) and math.isnan(got[2].item())
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-10, atol=1e-10)
    zeroed = tdt_loss(x, *args, reduction="none", zero_infinity=True)
    assert zeroed[0].item() == 0 and math.isnan(zeroed[2].item())
    zeroed[:2].sum().backward()
    assert (x.grad[0] == 0).all() and (x.grad[2] == 0).all() and x.grad[1].abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["compact", "padded"])
def test_column_views_of_a_wider_joint(device, layout, monkeypatch):
    """Token and duration heads as column slices of one joint padded to a width of 16 (read in place, no
    copy): the loss and gradients of the contiguous heads; the padding columns get a zero gradient."""
    gen = torch.Generator().manual_seed(31)
    logits, targets, T, U = random_batch(gen, 5, 7, 3, 9, 4, dtype=torch.float32, scale=1.5, edges=True, extra=3)
    w = torch.rand(5, generator=gen, dtype=torch.float64) + 0.5
    if layout == "compact":
        logits = compact(logits, T, U)
    joint = torch.randn(*logits.shape[:-1], 16, dtype=torch.float32)
    joint[..., :9], joint[..., 13:] = logits[..., :9], logits[..., 9:]
    joint = joint.to(device).requires_grad_()
    op, seen = transducer.tdt.loss_call, []

    def spy(*inputs):  # the registered op's call, noting the heads it is given
        seen.append(inputs[0])
        return op(*inputs)

    monkeypatch.setattr(transducer.tdt, "loss_call", spy)
    args = (targets.to(device), T.to(device), U.to(device), [0, 1, 2])
    tokens, duration_scores = joint[..., :9], joint[..., 13:]
    loss = tdt_loss(tokens, *args, blank=4, reduction="none", duration_logits=duration_scores)
    assert seen[0][0] is tokens and seen[0][1] is duration_scores  # read in place: no copy
    (loss * w.float().to(device)).sum().backward()
    x = logits.to(device).requires_grad_()
    ref = tdt_loss(x, *args, blank=4, reduction="none")
    (ref * w.float().to(device)).sum().backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(joint.grad[..., :9], x.grad[..., :9])
    torch.testing.assert_close(joint.grad[..., 13:], x.grad[..., 9:])
    assert joint.grad[..., 9:13].abs().max() == 0 and x.grad.abs().sum() > 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_module_and_opcheck(device):
    gen = torch.Generator().manual_seed(640)
    logits, targets, T, U = random_batch(gen, 5, 7, 3, 9, 0, scale=1.5, edges=True, extra=4)
    durations = [0, 1, 2, 3]
    m = TDTLoss(durations, blank=0, sigma=0.02, reduction="sum")
    x = logits.to(device)
    args = (targets.to(device), T.to(device), U.to(device))
    torch.testing.assert_close(m(x, *args), tdt_loss(x, *args, durations, sigma=0.02, reduction="sum"))
    assert "durations=[0, 1, 2, 3]" in repr(m)
    options = LossOptions(durations=tuple(durations), sigma=0.02, omega=0.2, fastemit_lambda=0.1, clamp=-1.0)
    op_args = (x.clone().requires_grad_(), None, *args, 9, *options.flat(), True, False)
    torch.library.opcheck(torch.ops.transducer.loss.default, op_args)
    # omega = 0 (the default): the RNN-T outputs are empty, and must not alias each other
    op_args = op_args[:6] + options._replace(omega=0.0).flat() + op_args[8:]
    torch.library.opcheck(torch.ops.transducer.loss.default, op_args)
    # the duration head on its own
    op_args = (x[..., :9].clone().requires_grad_(), x[..., 9:].clone().requires_grad_(), *op_args[2:])
    torch.library.opcheck(torch.ops.transducer.loss.default, op_args)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    gen = torch.Generator().manual_seed(650)
    logits, targets, T, U = random_batch(gen, 5, 7, 3, 9, 0, dtype=torch.float32, scale=1.5, edges=True, extra=4)
    linear = torch.nn.Linear(13, 13).to(device)
    x = logits.to(device)
    args = (targets.to(device), T.to(device), U.to(device))

    for omega in (0.1, 0.0):

        def f(x):
            return tdt_loss(linear(x), *args, [0, 1, 2, 3], sigma=0.05, omega=omega)

        explained = torch._dynamo.explain(f)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        want = f(x)
        want_grad = torch.autograd.grad(want, linear.weight)[0]
        torch._dynamo.reset()
        got = torch.compile(f, fullgraph=True)(x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got, linear.weight)[0], want_grad)
        torch._dynamo.reset()


def test_check_durations():
    assert check_durations([0, 1, 2]) == (0, 1, 2)
    assert check_durations(torch.tensor([3, 1]), 2) == (3, 1)
    for bad in ([], [0], [1, 1], [-1, 1], [1.5, 2]):
        with pytest.raises(ValueError):
            check_durations(bad)
    with pytest.raises(ValueError):
        check_durations([0, 1], 3)
    gen = torch.Generator().manual_seed(29)
    logits, targets, T, U = random_batch(gen, 2, 3, 1, 3, 0, scale=1.5, edges=True, extra=2)
    layout = cpu.layout(T, U, logits.size(2), padded_t=logits.size(1))
    rows = logits.reshape(-1, 5)
    lp, _, lp_arcs, _ = cpu.tdt_log_probs(rows[:, :3], rows[:, 3:], targets, layout, LossOptions())
    with pytest.raises(ValueError):
        cpu.tdt_alpha_beta(lp, lp_arcs, layout, LossOptions(durations=(0, 1, 2)))  # 3 durations for 2 duration columns


def test_long_durations_pad_the_cpu_grid_by_its_steps(monkeypatch):
    """The CPU walk pads its step grid by the longest arc that fits it, not by the longest duration: an arc longer
    than the grid joins no two cells."""
    pads, on_grid = [], cpu._on_grid
    monkeypatch.setattr(
        cpu, "_on_grid", lambda values, grid, pad=0: pads.append((pad, grid.steps)) or on_grid(values, grid, pad)
    )
    gen = torch.Generator().manual_seed(31)
    logits, targets, T, U = random_batch(gen, 3, 5, 2, 4, 0, scale=1.5, edges=True, extra=3)
    got = tdt_loss(logits, targets, T, U, [0, 1, 65535], reduction="none")
    torch.testing.assert_close(got, tdt_loss_reference(logits, targets, T, U, [0, 1, 65535]), rtol=1e-9, atol=1e-10)
    assert pads and all(pad == steps + 2 for pad, steps in pads)


def _bad(**change):
    gen = torch.Generator().manual_seed(660)
    logits, targets, T, U = random_batch(gen, 5, 7, 3, 9, 0, scale=1.5, edges=True, extra=4)
    args = dict(logits=logits, targets=targets, logit_lengths=T, target_lengths=U, durations=[0, 1, 2, 3])
    args.update({k: change.pop(k) for k in list(change) if k in args})
    return tdt_loss(**args, **change)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(durations=[]), ValueError, "durations: expected distinct ints >= 0"),
        (dict(durations=[0, 1, 1, 2]), ValueError, "durations: expected distinct ints >= 0"),
        (dict(durations=[-1, 1, 2, 3]), ValueError, "durations: expected distinct ints >= 0"),
        (dict(durations=[0]), ValueError, "durations: expected distinct ints >= 0"),
        (dict(durations=list(range(12))), ValueError, "logits: expected at least 2 token columns"),
        (dict(blank=9), ValueError, r"blank: expected an int in \[-9, 9\) \(the token columns"),
        (dict(blank=-10), ValueError, r"blank: expected an int in \[-9, 9\) \(the token columns"),
        (dict(omega=1.0), ValueError, r"omega: expected a number in \[0, 1\)"),
        (dict(sigma="a"), TypeError, "sigma: expected a number"),
        (dict(sigma=math.nan), ValueError, "sigma: expected a number, not NaN"),
        (dict(sigma=math.inf), ValueError, "sigma: expected a finite number"),
        (dict(omega="0.1"), TypeError, "omega: expected a number"),
        (dict(durations=3), ValueError, "durations: expected a sequence of ints"),
        (dict(durations=[0, 1.5]), ValueError, r"durations: expected a sequence of ints, got \[0, 1.5\]"),
        (dict(durations=[0, 1, 2.0]), ValueError, r"durations: expected a sequence of ints, got \[0, 1, 2.0\]"),
        (dict(durations=[0, True, 2]), ValueError, r"durations: expected a sequence of ints, got \[0, True, 2\]"),
        (dict(durations=[0, 1, 65536]), ValueError, "durations: expected durations of at most 65535 frames, got 65536"),
        (dict(durations=None), ValueError, r"durations: the TDT loss needs its durations"),
        (dict(fastemit_lambda=math.inf), ValueError, r"fastemit_lambda: expected a number in \[0, 65503\]"),
        (
            dict(duration_logits=torch.zeros(5, 7, 4, 4, dtype=torch.float32)),
            TypeError,
            "duration_logits: expected dtype",
        ),
        (dict(duration_logits=[0.0]), TypeError, "duration_logits: expected a torch.Tensor"),
        (
            dict(duration_logits=torch.zeros(5, 7, 4, 3, dtype=torch.float64)),
            ValueError,
            "duration_logits: expected shape",
        ),
        (dict(reduction="avg"), ValueError, "reduction: expected one of"),
        (dict(target_lengths=torch.tensor([3, 0, 0, 1, 9])), ValueError, "target_lengths: U_b = 9 exceeds"),
        (dict(targets=torch.full((5, 3), 9)), ValueError, "targets: .* outside"),
    ],
)
def test_bad_input(change, error, match):
    with pytest.raises(error, match=match):
        _bad(**change)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(durations=[1, 1]), ValueError, "durations: expected distinct ints >= 0"),
        (dict(sigma="x"), TypeError, "sigma: expected a number"),
        (dict(sigma=math.nan), ValueError, "sigma: expected a number, not NaN"),
        (dict(omega=5), ValueError, r"omega: expected a number in \[0, 1\)"),
        (dict(omega="x"), TypeError, "omega: expected a number"),
        (dict(blank=1.5), TypeError, "blank: expected an int"),
        (dict(reduction="avg"), ValueError, "reduction: expected one of"),
        (dict(clamp="x"), TypeError, "clamp: expected a number"),
        (dict(durations=None), ValueError, "durations: the TDT loss needs its durations"),
    ],
)
def test_module_bad_options(kwargs, error, match):
    """TDTLoss checks its options when built, with the messages of tdt_loss."""
    kwargs = dict(dict(durations=[0, 1, 2]), **kwargs)
    with pytest.raises(error, match=match):
        TDTLoss(**kwargs)


@pytest.mark.cuda
def test_at_most_16_durations_on_cuda():
    gen = torch.Generator().manual_seed(670)
    logits, targets, T, U = random_batch(gen, 5, 7, 3, 5, 0, scale=1.5, edges=True, extra=17)
    with pytest.raises(ValueError, match="durations: at most 16 on CUDA, got 17"):
        tdt_loss(logits.cuda(), targets.cuda(), T.cuda(), U.cuda(), list(range(17)))
