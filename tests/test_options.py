"""Every loss option on every backend, walked from the one table (transducer/lattices.py: SUPPORTED): an option a
lattice's stages take is honoured (the loss and its gradient equal the float64 reference's with that option),
one they do not take is refused with a ValueError naming the option and the loss, before any kernel runs.
LossOptions travels flat through the ops: flat and from_flat are inverses."""

import pytest
import torch

from _batches import random_batch
from transducer import multiblank_loss_reference, tdt_loss_reference, transducer_loss_reference
from transducer.lattices import KINDS, MULTIBLANK, RNNT, SUPPORTED, TDT, check_supported, kind_of
from transducer.options import LossOptions
from transducer.custom_ops import loss_call

V = 7  # token columns
# a value other than the default for each option
VALUES = dict(blank=2, one_sym_per_frame=True, from_log_softmax=True, clamp=0.02, fastemit_lambda=0.3,
              delay_penalty=0.2, durations=(0, 1, 3), sigma=0.05, omega=0.3, big_blank_durations=(2, 3))
# what makes each lattice what it is
BASE = {RNNT.name: LossOptions(), TDT.name: LossOptions(durations=(0, 1, 3)),
        MULTIBLANK.name: LossOptions(blank=V - 1, big_blank_durations=(2, 3))}
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# the fields that pick the lattice are not its options: durations make it TDT, big blanks (without durations)
# multi-blank; TDT's big_blank_durations stays, a real mistake (both given)
PICKS = {RNNT.name: ("durations", "big_blank_durations"), TDT.name: ("durations",),
         MULTIBLANK.name: ("durations", "big_blank_durations")}
CASES = [(kind.name, name) for kind in KINDS for name in LossOptions._fields if name not in PICKS[kind.name]]


def options_of(kind_name, name):
    options = BASE[kind_name]
    value = VALUES[name]
    if name == "blank" and kind_name == MULTIBLANK.name:
        value = V - 2  # room for the big blanks before it
    return options._replace(**{name: value})


def reference(logits, targets, T, U, options):
    """The float64 reference loss (B,) of ``options``' lattice."""
    o = options
    if o.durations:
        return tdt_loss_reference(logits, targets, T, U, o.durations, o.blank, o.sigma, o.omega, o.fastemit_lambda,
                                  o.delay_penalty)
    if o.big_blank_durations:
        return multiblank_loss_reference(logits, targets, T, U, o.big_blank_durations, o.blank, o.sigma,
                                         o.fastemit_lambda, o.delay_penalty)
    return transducer_loss_reference(logits, targets, T, U, o.blank, o.one_sym_per_frame, o.from_log_softmax,
                                     o.fastemit_lambda, o.delay_penalty)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("kind_name, name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_every_option_on_every_backend(kind_name, name, device):
    options = options_of(kind_name, name)
    kind = kind_of(options)
    assert kind.name == kind_name
    gen = torch.Generator().manual_seed(hash((kind_name, name)) % 1000)
    blanks = list(range(options.blank - len(options.big_blank_durations), options.blank + 1))
    logits, targets, T, U = random_batch(gen, 4, 6, 3, V, blanks, rna=options.one_sym_per_frame, edges=True,
                                         extra=len(options.durations))
    if options.from_log_softmax:
        logits = logits.log_softmax(-1)
    x = logits.to(device).requires_grad_()
    args = (targets.to(device), T.to(device), U.to(device))
    if device not in SUPPORTED[kind_name].get(name, ()):
        with pytest.raises(ValueError, match=f"{name}: the {kind_name} loss does not take this option"):
            loss_call(x, None, *args, V, options, True)
        return
    loss = loss_call(x, None, *args, V, options, True)
    grad, = torch.autograd.grad(loss.sum(), x)
    ref_x = logits.clone().requires_grad_()
    want = reference(ref_x, targets, T, U, options)
    want_grad, = torch.autograd.grad(want[torch.isfinite(want)].sum(), ref_x)
    if options.clamp > 0:  # TDT: the token scores' gradient alone (NeMo's)
        tokens = want_grad.size(-1) - len(options.durations)
        want_grad[..., :tokens] = want_grad[..., :tokens].clamp(-options.clamp, options.clamp)
    torch.testing.assert_close(loss.cpu(), want.detach(), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad.cpu(), want_grad, rtol=1e-8, atol=1e-10)


def test_the_table_names_real_options_and_lattices():
    assert set(SUPPORTED) == {kind.name for kind in KINDS}
    for table in SUPPORTED.values():
        assert set(table) <= set(LossOptions._fields)
        for backends in table.values():
            assert set(backends) <= {"cpu", "cuda"}


def test_check_supported_names_the_backend():
    table = {name: dict(backends) for name, backends in SUPPORTED.items()}
    table[TDT.name]["delay_penalty"] = ("cpu",)  # as if the CUDA stage did not read it
    options = LossOptions(durations=(0, 1), delay_penalty=0.5)
    with pytest.MonkeyPatch.context() as m:
        m.setattr("transducer.lattices.SUPPORTED", table)
        check_supported(options, TDT, "cpu")
        with pytest.raises(ValueError, match="delay_penalty: the TDT loss does not take this option on cuda"):
            check_supported(options, TDT, "cuda")


@pytest.mark.parametrize("options", [LossOptions(), LossOptions(**{k: VALUES[k] for k in VALUES})])
def test_flat_and_back(options):
    ints, floats = options.flat()
    assert all(type(i) is int for i in ints) and all(type(f) is float for f in floats)
    assert LossOptions.from_flat(ints, floats) == options



def test_flat_and_back_for_options_that_change_every_step():
    """from_flat keeps the options it built, a bounded number of them: options that change every step (a
    schedule) come back right before and after the oldest are dropped."""
    for step in range(1000):
        options = LossOptions(delay_penalty=step / 1000, durations=(0, 1, step % 5 + 2))
        assert LossOptions.from_flat(*options.flat()) == options
    assert LossOptions.from_flat(*LossOptions(delay_penalty=0.5).flat()) == LossOptions(delay_penalty=0.5)
