"""Every option of the losses, declared once: name, type, default, check, one line of documentation, and which
lattices' stages read it on which backends. From the declarations follow ``LossOptions`` (the options the stages
read, carried flat through the registered ops), the option table ``SUPPORTED``, the checks, and what every public
function's and module's written signature and docstring must say (transducer/entries.py; a test holds them to it).

Adding an option: its ``Option`` line in ``OPTIONS`` below, a line in the signature and docstring of each public
entry that takes it (``python -m transducer NAME`` prints them), the stages that read it (both backends: the CPU
stage and, on CUDA, the term function of transducer/cuda/terms.cuh with a field of its ``Terms`` struct), the float64
reference (transducer/reference.py) and the test values (tests/test_options.py: ``VALUES`` and ``reference()``;
tests/test_terms.py for a per-row term).
"""

import math
import operator
from typing import Any, Callable, NamedTuple, Optional, Tuple

import torch

from .checks import (
    REDUCTIONS,
    check_big_blank_durations,
    check_blank_type,
    check_durations,
    is_flag,
    is_index,
    is_number,
)
from .joiner import ACTIVATIONS, check_activation, check_dropout
from .layout import MAX_DURATIONS

__all__ = [
    "Option",
    "OPTIONS",
    "BY_NAME",
    "LossOptions",
    "SUPPORTED",
    "LATTICES",
    "joint_checks",
    "check_device_limits",
]

#: The lattices, by the names their losses' errors use (transducer/lattices.py: Kind.name).
LATTICES = ("RNN-T", "TDT", "multi-blank RNN-T")
RNNT, TDT, MULTIBLANK = LATTICES
_BOTH = ("cpu", "cuda")
#: A required argument's default.
REQUIRED = object()


class Option(NamedTuple):
    """One option of the losses.

    ``reads`` names the lattices whose stages read it and, for each, the backends: such an option is a field of
    ``LossOptions`` (``field_type`` says how it travels flat), taken by every public entry of those lattices.
    An option with ``reads`` None is the entry's own (the reduction, the fused loss's joiner): ``entries`` names
    the entries that take it (None: every loss)."""

    name: str
    annotation: str  # the type as the signature and the docstring show it
    default: Any  # the public default (REQUIRED: none)
    doc: str  # what it does, one sentence or two
    check: Callable[[Any], Any]  # the value -> the value the loss uses; TypeError / ValueError naming the option
    reads: Optional[dict] = None  # lattice name -> backends whose stages read it
    field_type: str = ""  # "int", "bool", "float" or "tuple": its form in LossOptions
    entries: Optional[Tuple[str, ...]] = None  # for an entry's own option: the entries that take it (None: every loss)

    @property
    def field_default(self):
        """The value LossOptions holds when the option is not given (its default, checked)."""
        return self.check(self.default)


# ------------------------------------------------------------------------------------------------- checks


def _number(name, value):
    if not is_number(value):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    if value != value:  # NaN; math.isnan, which torch.compile cannot trace on a dynamic float
        raise ValueError(f"{name}: expected a number, not NaN")
    return float(value)


def _flag(name):
    def check(value):
        if not is_flag(value):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
        return bool(value)

    return check


def _finite(name):
    def check(value):
        value = _number(name, value)
        if abs(value) == math.inf:
            raise ValueError(f"{name}: expected a finite number, got {value!r}")
        return value

    return check


def _reduction(value):
    if value not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {value!r}")
    return value


def _clamp(value):
    return _number("clamp", value)


#: The largest FastEmit lambda: a gradient entry reaches 1 + fastemit_lambda in magnitude, which must be finite
#: in the gradient's narrowest dtype (float16's largest value is 65504).
FASTEMIT_LAMBDA_MAX = 65503.0


def _fastemit_lambda(value):
    value = _number("fastemit_lambda", value)
    if not 0 <= value <= FASTEMIT_LAMBDA_MAX:
        raise ValueError(
            f"fastemit_lambda: expected a number in [0, {FASTEMIT_LAMBDA_MAX:g}] (1 + fastemit_lambda "
            f"bounds the gradient's entries, finite in float16), got {value!r}"
        )
    return value


def _durations(value):
    return () if value is None else check_durations(value)


def _omega(value):
    value = _number("omega", value)
    if not 0 <= value < 1:
        raise ValueError(f"omega: expected a number in [0, 1), got {value!r}")
    return value


def _big_blank_durations(value):
    return () if value is None else check_big_blank_durations(value, None)


def _activation(value):
    check_activation(value)
    return value


def _dropout(value):
    check_dropout(value)
    return float(value)


def _generator(value):
    if value is not None and (not isinstance(value, torch.Generator) or value.device.type != "cpu"):
        raise TypeError(f"generator: expected a CPU torch.Generator (dropout's seed), got {value!r}")
    return value


def _max_rows(value):
    if value is not None and (not is_index(value) or operator.index(value) < 1):
        raise ValueError(f"max_rows: expected an int >= 1, got {value!r}")
    return None if value is None else operator.index(value)


# ------------------------------------------------------------------------------------------- the declarations

_FUSED = ("fused_joiner_loss", "FusedJoinerLoss")

#: Every option, in the order LossOptions' fields and the signatures' keyword-only tails follow.
OPTIONS = (
    Option(
        "blank",
        "int",
        0,
        "the blank's column, in ``[-V, V)``; negative counts from the end.",
        check_blank_type,
        {RNNT: _BOTH, TDT: _BOTH, MULTIBLANK: _BOTH},
        "int",
    ),
    Option(
        "reduction",
        "str",
        "mean",
        '``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as torchaudio).',
        _reduction,
    ),
    Option(
        "one_sym_per_frame",
        "bool",
        False,
        "RNA: a label moves (t, u) -> (t+1, u+1); an utterance with "
        "``U_b > T_b - 1`` has no alignment and loss ``+inf``.",
        _flag("one_sym_per_frame"),
        {RNNT: _BOTH},
        "bool",
    ),
    Option(
        "from_log_softmax",
        "bool",
        False,
        "the logits are log-probabilities already; the gradient is w.r.t. them.",
        _flag("from_log_softmax"),
        {RNNT: _BOTH},
        "bool",
    ),
    Option(
        "fused_log_softmax",
        "bool",
        True,
        "``False``: the logits are log-probabilities (torchaudio's spelling of ``not from_log_softmax``).",
        _flag("fused_log_softmax"),
        entries=("rnnt_loss", "RNNTLoss"),
    ),
    Option(
        "zero_infinity",
        "bool",
        False,
        "infinite losses become 0 (their gradient is zero either way); NaN losses stay NaN.",
        _flag("zero_infinity"),
    ),
    Option(
        "check_inputs",
        "bool",
        True,
        "check lengths and labels against the tensors (on CUDA one small "
        "device-to-host read, overlapping the first pass); ``False``: no host synchronisation (CUDA graphs), "
        "out-of-range values give undefined results.",
        _flag("check_inputs"),
    ),
    Option(
        "inplace_grad",
        "bool",
        False,
        "write the gradient over the logits in backward, saving a logits-sized "
        "buffer; for logits an op produced that nothing else needs (a joiner ``Linear``'s output). A leaf that "
        "requires grad (or a view of one) is refused with a ValueError.",
        _flag("inplace_grad"),
        entries=("transducer_loss", "TransducerLoss"),
    ),
    Option(
        "clamp",
        "float",
        -1.0,
        "if > 0, each gradient element for a unit incoming gradient is clamped to "
        "``[-clamp, clamp]`` before the incoming gradient scales it (torchaudio's; TDT: the token scores' "
        "gradient alone, as NeMo's).",
        _clamp,
        {RNNT: _BOTH, TDT: _BOTH, MULTIBLANK: _BOTH},
        "float",
    ),
    Option(
        "fastemit_lambda",
        "float",
        0.0,
        "FastEmit (Yu et al. 2021): the gradient w.r.t. every label log-prob "
        "times ``1 + fastemit_lambda``; the loss value is unchanged. In ``[0, 65503]``: the gradient's entries "
        "reach ``1 + fastemit_lambda``, which stays finite in float16.",
        _fastemit_lambda,
        {RNNT: _BOTH, TDT: _BOTH, MULTIBLANK: _BOTH},
        "float",
    ),
    Option(
        "delay_penalty",
        "float",
        0.0,
        "k2's delay penalty: the label log-prob of cell (t, u) of utterance b "
        "gets ``delay_penalty * ((T_b - 1) / 2 - t)`` before the recursion.",
        _finite("delay_penalty"),
        {RNNT: _BOTH, TDT: _BOTH, MULTIBLANK: _BOTH},
        "float",
    ),
    Option(
        "durations",
        "list of int",
        None,
        "TDT's durations (frames a symbol covers): distinct ints in "
        "[0, 65535], at least one >= 1, at most 16 (``layout.MAX_DURATIONS``) on CUDA; the last D = len(durations) "
        "score columns are theirs.",
        _durations,
        {TDT: _BOTH},
        "tuple",
    ),
    Option(
        "sigma",
        "float",
        0.0,
        "logit under-normalisation: token log-probs are ``log_softmax - sigma``.",
        _finite("sigma"),
        {TDT: _BOTH, MULTIBLANK: _BOTH},
        "float",
    ),
    Option(
        "omega",
        "float",
        0.0,
        "in ``[0, 1)``; the loss is ``(1 - omega) * tdt + omega * rnnt``, rnnt the plain "
        "RNN-T loss of the token scores without sigma (the expectation of NeMo's sampling it).",
        _omega,
        {TDT: _BOTH},
        "float",
    ),
    Option(
        "big_blank_durations",
        "list of int",
        None,
        "the multi-blank loss's K big blanks' durations, distinct "
        "ints in [2, 65535] (at most 14 on CUDA); big blank i is the column ``blank - 1 - i``.",
        _big_blank_durations,
        {MULTIBLANK: _BOTH},
        "tuple",
    ),
    Option(
        "activation",
        "str",
        "tanh",
        f"the joiner's activation, one of {', '.join(map(repr, ACTIVATIONS))} (transducer/joiner.py).",
        _activation,
        entries=_FUSED,
    ),
    Option(
        "dropout",
        "float",
        0.0,
        "the rate of dropout on the joiner's hidden, in [0, 1 - 2^-10], after the activation (NeMo's "
        "joint); its mask is a hash of a seed drawn from ``generator`` and of each element's (row, column), the "
        "same in backward's recompute (``transducer.joiner.dropout_mask``); 0 draws nothing.",
        _dropout,
        entries=_FUSED,
    ),
    Option(
        "generator",
        "torch.Generator",
        None,
        "a CPU generator for dropout's seed (None: torch's default one).",
        _generator,
        entries=("fused_joiner_loss",),
    ),
    Option(
        "max_rows",
        "int",
        None,
        "rows per tile (None: tile buffers of about 256 MiB on CUDA, 16 MiB on the "
        "CPU); forward's on the Hopper kernels, which hold no logits, take the same bytes.",
        _max_rows,
        entries=_FUSED,
    ),
)
BY_NAME = {option.name: option for option in OPTIONS}
_FIELDS = tuple(option for option in OPTIONS if option.reads is not None)


# ------------------------------------------------------------------------------------ what the stages read


def _flat(self):
    """(ints, floats): bools and ints as ints, a tuple as its length then its ints, floats as floats (new lists,
    each distinct options' made once)."""
    if torch.compiler.is_compiling():
        return _make_flat(self)
    flat = _FLAT.get(self)
    if flat is None:
        if len(_FLAT) >= _FROM_FLAT_SIZE:
            _FLAT.clear()
        flat = _FLAT.setdefault(self, _make_flat(self))
    return list(flat[0]), list(flat[1])


def _make_flat(self):
    ints, floats = [], []
    for name, kind in _FLAT_KINDS:
        value = getattr(self, name)
        if kind == "float":
            floats.append(float(value))
        elif kind == "tuple":
            ints += [len(value), *map(int, value)]
        else:
            ints.append(int(value))
    return ints, floats


def _from_flat(cls, ints, floats):
    """The options that ``flat()`` gave (ints, floats); each distinct one is built once (an op's forward and
    backward rebuild them every call)."""
    key = (tuple(ints), tuple(floats))
    try:
        options = _FROM_FLAT.get(key)
    except TypeError:  # torch.compile's symbolic ints (dynamic shapes: a blank counted from the end) do not hash
        return _build(cls, ints, floats)
    if options is None:
        if len(_FROM_FLAT) >= _FROM_FLAT_SIZE:  # options that change every step (a schedule) stay bounded
            _FROM_FLAT.clear()
        options = _FROM_FLAT.setdefault(key, _build(cls, ints, floats))
    return options


def _build(cls, ints, floats):
    ints, floats, values = list(ints), list(floats), {}
    for name, kind in _FLAT_KINDS:
        if kind == "float":
            values[name] = floats.pop(0)
        elif kind == "tuple":
            n = ints.pop(0)
            values[name], ints = tuple(ints[:n]), ints[n:]
        else:
            values[name] = bool(ints.pop(0)) if kind == "bool" else ints.pop(0)
    return cls(**values)


_TYPES = {"int": int, "bool": bool, "float": float, "tuple": Tuple[int, ...]}

#: What a loss computes besides its tensors: the options some lattice's stages read, checked, in the form the
#: stages take (a blank in [0, V), tuples of durations, () for none). A registered op takes them flat
#: (torch.library's types): ``flat()`` gives (ints, floats) in field order, ``from_flat`` the options back.
LossOptions = NamedTuple("LossOptions", [(option.name, _TYPES[option.field_type]) for option in _FIELDS])
LossOptions.__new__.__defaults__ = tuple(option.field_default for option in _FIELDS)
LossOptions._field_defaults = {option.name: option.field_default for option in _FIELDS}
LossOptions.__module__ = __name__
LossOptions.flat = _flat
LossOptions.from_flat = classmethod(_from_flat)

_FROM_FLAT = {}  # (ints, floats) -> LossOptions: a training run meets a handful
_FLAT = {}  # LossOptions -> (ints, floats)
_FROM_FLAT_SIZE = 256
# the fields and their kinds as plain strings, which torch.compile traces
_FLAT_KINDS = tuple((option.name, option.field_type) for option in _FIELDS)

#: The LossOptions fields each lattice's stages take, and the backends that take each (from ``OPTIONS``). A
#: field set to other than its default for a lattice or backend not listed is refused
#: (lattices.check_supported); the tests walk every field and backend from it (tests/test_options.py).
SUPPORTED = {
    lattice: {option.name: option.reads[lattice] for option in _FIELDS if lattice in option.reads}
    for lattice in LATTICES
}


# ------------------------------------------------------------------------------- checks of several options


def _big_blanks_fit(options):
    """Big blank i sits in column blank - 1 - i: all of them before the blank's column."""
    if options.big_blank_durations:
        check_big_blank_durations(options.big_blank_durations, options.blank)


#: Checks that involve several options, run on the LossOptions of every call once the blank's column is known.
JOINT_CHECKS = (_big_blanks_fit,)


def joint_checks(options):
    """Every check of ``JOINT_CHECKS`` on ``options`` (a LossOptions with the blank's column resolved)."""
    for check in JOINT_CHECKS:
        check(options)


def check_device_limits(options, device):
    """The limits of the CUDA stages (their Durations struct holds MAX_DURATIONS arcs by value): at most
    MAX_DURATIONS durations and MAX_DURATIONS - 2 big blanks for tensors on ``device``."""
    if device.type != "cuda":
        return
    if len(options.durations) > MAX_DURATIONS:
        raise ValueError(f"durations: at most {MAX_DURATIONS} on CUDA, got {len(options.durations)}")
    if len(options.big_blank_durations) > MAX_DURATIONS - 2:
        raise ValueError(
            f"big_blank_durations: at most {MAX_DURATIONS - 2} big blanks on CUDA, got "
            f"{len(options.big_blank_durations)}"
        )
