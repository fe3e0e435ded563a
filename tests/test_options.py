"""Every loss option on every backend, walked from the declarations (transducer/options.py: SUPPORTED): an option a
lattice's stages take is honoured (the loss and its gradient equal the float64 reference's with that option),
one they do not take is refused with a ValueError naming the option and the loss, before any kernel runs.
LossOptions travels flat through the ops: flat and from_flat are inverses."""

import pytest
import torch
from _batches import random_batch

from transducer import multiblank_loss_reference, tdt_loss_reference, transducer_loss_reference
from transducer.custom_ops import loss_call
from transducer.lattices import KINDS, MULTIBLANK, RNNT, TDT, check_supported, kind_of
from transducer.options import SUPPORTED, LossOptions

V = 7  # token columns
# a value other than the default for each option
VALUES = dict(
    blank=2,
    one_sym_per_frame=True,
    from_log_softmax=True,
    clamp=0.02,
    fastemit_lambda=0.3,
    delay_penalty=0.2,
    durations=(0, 1, 3),
    sigma=0.05,
    omega=0.3,
    big_blank_durations=(2, 3),
)
# what makes each lattice what it is
BASE = {
    RNNT.name: LossOptions(),
    TDT.name: LossOptions(durations=(0, 1, 3)),
    MULTIBLANK.name: LossOptions(blank=V - 1, big_blank_durations=(2, 3)),
}
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# the fields that pick the lattice are not its options: durations make it TDT, big blanks (without durations)
# multi-blank; TDT's big_blank_durations stays, a real mistake (both given)
PICKS = {
    RNNT.name: ("durations", "big_blank_durations"),
    TDT.name: ("durations",),
    MULTIBLANK.name: ("durations", "big_blank_durations"),
}
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
        return tdt_loss_reference(
            logits, targets, T, U, o.durations, o.blank, o.sigma, o.omega, o.fastemit_lambda, o.delay_penalty
        )
    if o.big_blank_durations:
        return multiblank_loss_reference(
            logits, targets, T, U, o.big_blank_durations, o.blank, o.sigma, o.fastemit_lambda, o.delay_penalty
        )
    return transducer_loss_reference(
        logits, targets, T, U, o.blank, o.one_sym_per_frame, o.from_log_softmax, o.fastemit_lambda, o.delay_penalty
    )


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("kind_name, name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_every_option_on_every_backend(kind_name, name, device):
    options = options_of(kind_name, name)
    kind = kind_of(options)
    assert kind.name == kind_name
    gen = torch.Generator().manual_seed(hash((kind_name, name)) % 1000)
    blanks = list(range(options.blank - len(options.big_blank_durations), options.blank + 1))
    logits, targets, T, U = random_batch(
        gen, 4, 6, 3, V, blanks, rna=options.one_sym_per_frame, edges=True, extra=len(options.durations)
    )
    if options.from_log_softmax:
        logits = logits.log_softmax(-1)
    x = logits.to(device).requires_grad_()
    args = (targets.to(device), T.to(device), U.to(device))
    if device not in SUPPORTED[kind_name].get(name, ()):
        with pytest.raises(ValueError, match=f"{name}: the {kind_name} loss does not take this option"):
            loss_call((x, None), *args, V, options, True)
        return
    loss = loss_call((x, None), *args, V, options, True)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    ref_x = logits.clone().requires_grad_()
    want = reference(ref_x, targets, T, U, options)
    (want_grad,) = torch.autograd.grad(want[torch.isfinite(want)].sum(), ref_x)
    if options.clamp > 0:  # TDT: the token scores' gradient alone (NeMo's)
        tokens = want_grad.size(-1) - len(options.durations)
        want_grad[..., :tokens] = want_grad[..., :tokens].clamp(-options.clamp, options.clamp)
    torch.testing.assert_close(loss.cpu(), want.detach(), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad.cpu(), want_grad, rtol=1e-8, atol=1e-10)
    # the option changes the loss or its gradient (an option no stage reads would pass the comparison above with a
    # reference that ignores it too)
    if name != "blank":  # its labels exclude the blank it gives
        default = loss_call((x, None), *args, V, options._replace(**{name: getattr(BASE[kind_name], name)}), True)
        (default_grad,) = torch.autograd.grad(default.sum(), x)
        assert not (torch.allclose(loss, default) and torch.allclose(grad, default_grad))


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
        m.setattr("transducer.options.SUPPORTED", table)
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


# ------------------------------------------------------------------- every public entry against the declarations

# every public function and module that takes the losses' options, by name
ENTRIES = (
    "transducer_loss",
    "TransducerLoss",
    "rnnt_loss",
    "RNNTLoss",
    "tdt_loss",
    "TDTLoss",
    "multiblank_loss",
    "MultiblankLoss",
    "fused_joiner_loss",
    "FusedJoinerLoss",
)
# a value other than the default for each option of the call (the loss's options: VALUES above)
CALL_VALUES = dict(
    reduction="sum",
    zero_infinity=True,
    check_inputs=False,
    inplace_grad=True,
    fused_log_softmax=False,
    activation="relu",
    dropout=0.25,
    max_rows=5,
)


def _takes(entry, option):
    """Whether a public entry takes ``option``, by the rule the declarations state (transducer/options.py)."""
    if option.name in entry.exclude:
        return False
    if option.entries is not None:
        return entry.name in option.entries
    return option.reads is None or any(lattice in option.reads for lattice in entry.lattices)


def test_every_public_entry_is_declared():
    import transducer
    from transducer.entries import DECLARED

    assert set(DECLARED) == set(ENTRIES) and set(ENTRIES) <= set(transducer.__all__)


def _args_section(doc):
    """The ``Args:`` section of a docstring: its lines up to the first blank one."""
    lines = doc.split("\n    Args:\n", 1)[1].split("\n")
    blank = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
    return "\n".join(lines[:blank])


@pytest.mark.parametrize("name", ENTRIES)
def test_written_signature_and_docstring_are_the_declared_ones(name):
    """Every public function's and module's written signature is its declaration's (transducer/entries.py over the
    options of transducer/options.py): the same arguments in the same order, positional or keyword-only, with the
    declared type and default, and its docstring's ``Args`` section is the declared lines, one per argument.
    ``python -m transducer NAME`` prints both as the source must spell them."""
    import inspect

    import transducer
    from transducer.entries import DECLARED, REQUIRED, annotation, args_section, arguments, signature_source

    entry, public = DECLARED[name], getattr(transducer, name)
    module = name[0].isupper()
    params = list(inspect.signature(public.__init__ if module else public).parameters.values())[module:]
    expected = arguments(entry)
    how = f"write it as `python -m transducer {name}` prints it:\n{signature_source(entry, module)}"
    assert [p.name for p in params] == [a.name for a in expected], how
    for p, a in zip(params, expected):
        kind = inspect.Parameter.KEYWORD_ONLY if a.keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = inspect.Parameter.empty if a.default is REQUIRED else a.default
        assert p.kind == kind, how
        assert type(p.default) is type(default) and p.default == default, how
        assert p.annotation == annotation(a.annotation, a.default), how
    assert _args_section(public.__doc__) == args_section(entry), f"its docstring's Args section:\n{args_section(entry)}"


def test_the_declarations_reach_every_option():
    """Each entry takes every option the declarations give it (an option of its lattices, or its own)."""
    from transducer.entries import DECLARED
    from transducer.options import OPTIONS

    for name, entry in DECLARED.items():
        named, rest = entry.options()
        assert set(named + rest) == {o.name for o in OPTIONS if _takes(entry, o)}, name


def _entry_call(name, options, gen, lattice):
    """Calls the public entry ``name`` on a small batch of ``lattice`` with ``options`` (a module's go to the
    module)."""
    import transducer

    public = getattr(transducer, name)
    base = {}
    if lattice == TDT.name:
        base["durations"] = (0, 1, 3)
    if lattice == MULTIBLANK.name:
        base.update(big_blank_durations=(2, 3), blank=V - 1)
    options = {**base, **options}
    blank = options.get("blank", -1 if "rnnt" in name.lower() else 0) % V
    blanks = list(range(blank - len(options.get("big_blank_durations") or ()), blank + 1))
    D = len(options.get("durations") or ())
    logits, targets, T, U = random_batch(gen, 3, 5, 2, V, blanks, rna=True, extra=D)
    if name.startswith(("fused", "Fused")):
        J = 4
        enc, pred = torch.randn(3, 5, J, dtype=torch.float64), torch.randn(3, int(U.max()) + 1, J, dtype=torch.float64)
        if name == "FusedJoinerLoss":
            module = public(J, V, **options).double()
            return module(enc, pred, targets, T, U)
        weight = torch.randn(V + D, J, dtype=torch.float64)
        return public(enc, pred, weight, None, targets, T, U, **options)
    logits = logits * 1  # not a leaf: inplace_grad takes it
    if name[0].isupper():
        kind_args = [options.pop(k) for k in ("durations", "big_blank_durations") if k in base]
        if "blank" in base:
            kind_args.append(options.pop("blank"))
        return public(*kind_args, **options)(logits, targets, T, U)
    return public(logits, targets, T, U, **options)


def _walk_cases():
    from transducer.entries import DECLARED
    from transducer.options import OPTIONS

    cases = []
    for name in ENTRIES:
        entry = DECLARED[name]
        cases += [(name, o.name) for o in OPTIONS if _takes(entry, o) and o.name != "generator"]
    return cases


@pytest.mark.parametrize("name, option", _walk_cases(), ids=[f"{n}-{o}" for n, o in _walk_cases()])
def test_every_public_entry_passes_every_option_on(name, option, monkeypatch):
    """Each option given to a public function or module (other than its default) reaches the op as given: a
    LossOptions field in the options the op gets, a call option in the op's arguments or in the reduction's."""
    from transducer import custom_ops, multiblank, tdt
    from transducer import loss as loss_module
    from transducer.fused import loss as fused

    seen, reductions = [], []
    for module, attribute in ((custom_ops, "loss"), (fused, "fused")):
        op = getattr(module, attribute)
        monkeypatch.setattr(module, attribute, lambda *a, _op=op, _name=attribute: seen.append((_name, a)) or _op(*a))
    for module in (loss_module, tdt, multiblank, fused):
        monkeypatch.setattr(module, "reduce_losses", lambda nll, *a: reductions.append(a) or nll)
    value = CALL_VALUES.get(option, VALUES.get(option))
    if option == "blank":
        value = V - 2 if "ultiblank" in name else 2
    from transducer.entries import DECLARED
    from transducer.options import BY_NAME

    reads = BY_NAME[option].reads or {}
    entry = DECLARED[name]
    lattice = next((lattice for lattice in entry.lattices if lattice in reads), entry.lattices[0])
    _entry_call(name, {option: value}, torch.Generator().manual_seed(7), lattice)
    ((op_name, args),) = seen
    fused_op = op_name == "fused"
    ints, floats = args[7:9] if fused_op else args[6:8]
    options = LossOptions.from_flat(ints, floats)
    if option == "fused_log_softmax":
        assert options.from_log_softmax
    elif option in LossOptions._fields:
        assert getattr(options, option) == (tuple(value) if isinstance(value, tuple) else value)
    elif option == "reduction":
        assert reductions == [("sum", False)]
    elif option == "zero_infinity":
        assert reductions == [("mean", True)]
    elif option == "check_inputs":
        assert args[12 if fused_op else 8] is False
    elif option == "inplace_grad":
        assert args[9] is True
    elif option == "activation":
        assert args[9] == "relu"
    elif option == "dropout":
        assert args[10] == 0.25 and int(args[11]) != 0
    elif option == "max_rows":
        assert args[14] == 5
    else:
        raise AssertionError(f"{option}: no check here; give it one")


def test_the_cuda_stages_limits_are_checked_for_cuda_tensors_alone():
    """Every loss checks them through one function, before any kernel: TDT's durations and multi-blank's big blanks
    beyond what the CUDA stages' Durations struct holds."""
    from transducer.layout import MAX_DURATIONS
    from transducer.options import check_device_limits

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    many = LossOptions(durations=tuple(range(MAX_DURATIONS + 1)))
    big = LossOptions(blank=MAX_DURATIONS, big_blank_durations=tuple(range(2, MAX_DURATIONS + 1)))
    check_device_limits(many, cpu), check_device_limits(big, cpu)
    check_device_limits(LossOptions(durations=tuple(range(MAX_DURATIONS))), cuda)
    with pytest.raises(ValueError, match=f"durations: at most {MAX_DURATIONS} on CUDA, got {MAX_DURATIONS + 1}"):
        check_device_limits(many, cuda)
    with pytest.raises(ValueError, match=f"big_blank_durations: at most {MAX_DURATIONS - 2} big blanks on CUDA"):
        check_device_limits(big, cuda)


# a value each option refuses, and the error's type
BAD = dict(
    blank=(1.5, TypeError),
    reduction=("avg", ValueError),
    one_sym_per_frame=("yes", TypeError),
    from_log_softmax=(2, TypeError),
    fused_log_softmax=(None, TypeError),
    zero_infinity=("no", TypeError),
    check_inputs=(0.5, TypeError),
    inplace_grad=([], TypeError),
    clamp=("1", TypeError),
    fastemit_lambda=(-0.1, ValueError),
    delay_penalty=(float("inf"), ValueError),
    durations=([0, 0], ValueError),
    sigma=(float("nan"), ValueError),
    omega=(1.0, ValueError),
    big_blank_durations=([1], ValueError),
    activation=("no such activation", ValueError),
    dropout=(1.0, ValueError),
    generator=(3, TypeError),
    max_rows=(0, ValueError),
)


@pytest.mark.parametrize("name", list(BAD))
def test_every_option_refuses_a_bad_value_by_name(name):
    from transducer.options import BY_NAME

    value, error = BAD[name]
    with pytest.raises(error, match=f"^{name}: "):
        BY_NAME[name].check(value)


@pytest.mark.parametrize("name", ["durations", "big_blank_durations"])
def test_durations_in_an_unordered_collection_are_refused(name):
    """The durations' order is their columns': a set (or a dict's keys) would put them in its own order."""
    from transducer.options import BY_NAME

    for unordered in ({3, 1, 2}, frozenset({2, 3}), {2: "a", 3: "b"}):
        with pytest.raises(ValueError, match=f"^{name}: expected a sequence of ints in their columns' order"):
            BY_NAME[name].check(unordered)
    assert BY_NAME[name].check([3, 2]) == (3, 2)
    assert BY_NAME[name].check(torch.tensor([3, 2])) == (3, 2)


def test_every_option_has_a_bad_value():
    from transducer.options import OPTIONS

    assert set(BAD) == {o.name for o in OPTIONS}


def test_check_supported_takes_options_of_unhashable_values():
    """lattices.check_supported caches the options it has passed; options holding a list (a hand-made LossOptions)
    are checked as they are, with the same answer."""
    from transducer.lattices import check_supported, kind_of

    for durations in ((0, 1, 2), [0, 1, 2]):
        good = LossOptions(durations=durations, sigma=0.05)
        check_supported(good, kind_of(good), "cuda")
        bad = LossOptions(durations=durations, from_log_softmax=True)
        for _ in range(2):  # raised again once cached
            with pytest.raises(ValueError, match="from_log_softmax: the TDT loss does not take this option at all"):
                check_supported(bad, kind_of(bad), "cpu")
