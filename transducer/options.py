"""What a loss computes besides its tensors: ``LossOptions``, carried flat through the registered ops."""

from typing import NamedTuple, Tuple


class LossOptions(NamedTuple):
    """What a loss computes besides its tensors (the public functions check them; transducer/checks.py).

    A registered op takes them flat (torch.library's types): ``flat()`` gives (ints, floats) in field order,
    ``from_flat`` the options back; a new field needs nothing more here than its line."""
    blank: int = 0                   # the blank's column, in [0, V) (TDT: among the token columns)
    one_sym_per_frame: bool = False  # RNA: a label consumes a frame too, (t, u) -> (t+1, u+1)
    from_log_softmax: bool = False   # the logits are already log-probabilities
    clamp: float = 0.0               # > 0: each gradient element, for a unit incoming gradient, in [-clamp, clamp]
    fastemit_lambda: float = 0.0     # FastEmit: the label log-probs' gradient times 1 + fastemit_lambda
    delay_penalty: float = 0.0       # k2's delay penalty on the label log-probs
    durations: Tuple[int, ...] = ()  # TDT: the durations (empty: RNN-T or RNA)
    sigma: float = 0.0               # TDT, multi-blank: logit under-normalisation, subtracted from the log-probs
    omega: float = 0.0               # TDT: weight of the plain RNN-T loss of the token scores
    big_blank_durations: Tuple[int, ...] = ()  # multi-blank: big blank i, in column blank - 1 - i, spans d_i frames

    def flat(self):
        """(ints, floats): bools and ints as ints, a tuple as its length then its ints, floats as floats."""
        ints, floats = [], []
        for name, kind in _OPTION_KINDS:
            value = getattr(self, name)
            if kind == "float":
                floats.append(float(value))
            elif kind == "tuple":
                ints += [len(value), *map(int, value)]
            else:
                ints.append(int(value))
        return ints, floats

    @classmethod
    def from_flat(cls, ints, floats):
        """The options that ``flat()`` gave (ints, floats); each distinct one is built once (an op's forward
        and backward rebuild them every call)."""
        key = (tuple(ints), tuple(floats))
        options = _FROM_FLAT.get(key)
        if options is None:
            if len(_FROM_FLAT) >= _FROM_FLAT_SIZE:  # options that change every step (a schedule) stay bounded
                _FROM_FLAT.clear()
            options = _FROM_FLAT.setdefault(key, cls._build(ints, floats))
        return options

    @classmethod
    def _build(cls, ints, floats):
        ints, floats, values = list(ints), list(floats), {}
        for name, kind in _OPTION_KINDS:
            if kind == "float":
                values[name] = floats.pop(0)
            elif kind == "tuple":
                n = ints.pop(0)
                values[name], ints = tuple(ints[:n]), ints[n:]
            else:
                values[name] = bool(ints.pop(0)) if kind == "bool" else ints.pop(0)
        return cls(**values)


_FROM_FLAT = {}  # (ints, floats) -> LossOptions: a training run meets a handful
_FROM_FLAT_SIZE = 256

# LossOptions' fields and their kinds as plain strings, which torch.compile traces (it does not trace
# typing's Tuple[int, ...])
_OPTION_KINDS = tuple((name, {float: "float", int: "int", bool: "bool"}.get(kind, "tuple"))
                      for name, kind in LossOptions.__annotations__.items())
