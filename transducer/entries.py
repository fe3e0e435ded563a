"""The public functions and modules, declared: each entry names its tensors, the order of the arguments it takes
positionally and the lattices whose options it takes; every other option of those lattices follows as a keyword-only
argument (the option declarations: transducer/options.py). The signatures and docstrings are written out in the
source, where editors and type checkers read them; ``signature_source`` and ``args_section`` give what they must be,
and tests/test_options.py holds every written signature, default and ``Args`` line to them.

``python -m transducer NAME`` prints an entry's signature and ``Args`` section as the source must spell them.
"""

import re
import textwrap
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from .options import BY_NAME, OPTIONS, REQUIRED

__all__ = [
    "Param",
    "Entry",
    "Argument",
    "DECLARED",
    "declare",
    "arguments",
    "annotation",
    "args_section",
    "signature_source",
    "check_options",
    "LossModule",
]

_WIDTH = 116


class Param(NamedTuple):
    """An argument that is not an option: a tensor, or a module's own (its sizes, device)."""

    name: str
    annotation: str
    doc: str
    default: Any = REQUIRED


class Entry(NamedTuple):
    """A public function or module: its leading arguments (``params``: Params, and option names in the order it
    takes them positionally), the lattices whose options it takes, and what it changes of a declaration."""

    name: str
    lattices: Tuple[str, ...]
    params: Tuple[Any, ...]  # Param or an option's name, in signature order
    exclude: Tuple[str, ...] = ()  # options of its lattices it does not take
    defaults: dict = {}  # option name -> its default here
    docs: dict = {}  # option name -> its documentation here

    def options(self):
        """The options this entry takes, in signature order: those named in ``params``, then the others of its
        lattices (keyword-only)."""
        named = [p for p in self.params if isinstance(p, str)]
        rest = [o.name for o in OPTIONS if o.name not in named and o.name not in self.exclude and self.takes(o)]
        return named, rest

    def takes(self, option):
        if option.entries is not None:
            return self.name in option.entries
        if option.reads is None:
            return True
        return any(lattice in option.reads for lattice in self.lattices)


#: Every public entry that takes options, by name (``declare`` adds one).
DECLARED: Dict[str, Entry] = {}


def declare(entry: Entry) -> Entry:
    """Adds ``entry`` to ``DECLARED``, and returns it."""
    DECLARED[entry.name] = entry
    return entry


class Argument(NamedTuple):
    """One argument of an entry's signature, in order."""

    name: str
    annotation: str  # as the docstring shows it
    doc: str
    default: Any  # REQUIRED: none
    is_option: bool
    keyword_only: bool


_TYPES = {
    "Tensor or None": Optional[torch.Tensor],
    "int": int,
    "str": str,
    "bool": bool,
    "float": float,
    "list of int": Sequence[int],
    "Tensor": torch.Tensor,
    "torch.Generator": torch.Generator,
    "torch.device": torch.device,
    "torch.dtype": torch.dtype,
}
_SPELLED = {"list of int": "Sequence[int]", "Tensor or None": "Optional[Tensor]"}


def annotation(text, default):
    """The type of an argument whose docstring type is ``text``: Optional where its default is None."""
    kind = _TYPES[text]
    return Optional[kind] if default is None else kind


def _spelled(text, default):
    name = _SPELLED.get(text, text)
    return f"Optional[{name}]" if default is None else name


def arguments(entry):
    """The Arguments of ``entry``, in signature order."""
    _, rest = entry.options()
    out = []
    for p in entry.params:
        if isinstance(p, Param):
            out.append(Argument(p.name, p.annotation, p.doc, p.default, False, False))
        else:
            out.append(_option_argument(entry, p, False))
    return out + [_option_argument(entry, name, True) for name in rest]


def _option_argument(entry, name, keyword_only):
    o = BY_NAME[name]
    return Argument(
        name, o.annotation, entry.docs.get(name, o.doc), entry.defaults.get(name, o.default), True, keyword_only
    )


def _arg_line(argument):
    """``name (type[, optional]): doc (Default: ``x``)``, wrapped as the docstrings are."""
    a = argument
    if a.default is REQUIRED:
        text = f"{a.name} ({a.annotation}): {a.doc}"
    else:
        text = f"{a.name} ({a.annotation}, optional): {a.doc} (Default: ``{a.default!r}``)"
    # a ``code span`` stays on one line: its spaces are held as NO-BREAK SPACEs while wrapping
    text = re.sub(r"``.*?``", lambda m: m.group(0).replace(" ", "\u00a0"), text)
    text = textwrap.fill(
        text, _WIDTH, initial_indent=" " * 8, subsequent_indent=" " * 12, break_on_hyphens=False, break_long_words=False
    )
    return text.replace("\u00a0", " ")


def args_section(entry):
    """The lines of ``entry``'s docstring ``Args:`` section, one per argument, as the source spells them."""
    return "\n".join(_arg_line(a) for a in arguments(entry))


def _default(value):
    """A default as the source spells it (strings in double quotes)."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def signature_source(entry, method=False):
    """``entry``'s signature as the source spells it (``def name(...) -> Tensor:``; a module's ``__init__`` with
    ``method``)."""
    parts, star = (["self"] if method else []), False
    for a in arguments(entry):
        if a.keyword_only and not star:
            parts.append("*")
            star = True
        spelled = f"{a.name}: {_spelled(a.annotation, a.default)}"
        parts.append(spelled if a.default is REQUIRED else f"{spelled} = {_default(a.default)}")
    name, result = ("__init__", "None") if method else (entry.name, "Tensor")
    indent = "    " if method else ""
    line = f"{indent}def {name}({', '.join(parts)}) -> {result}:"
    if len(line) <= 120:
        return line
    # one argument a line, as ruff format writes a signature that does not fit on one
    body = "".join(f"{indent}    {part},\n" for part in parts)
    return f"{indent}def {name}(\n{body}{indent}) -> {result}:"


def check_options(values):
    """Each option of ``values`` (a dict of given values) checked, in the form the loss uses: a new dict. The
    checked options of plain values (numbers, strings, None, sequences of ints) are kept, a bounded number, so
    that the steps of a training run check theirs once."""
    key = _cache_key(values)
    checked = _CHECKED.get(key) if key is not None else None
    if checked is None:
        checked = {name: BY_NAME[name].check(value) for name, value in values.items()}
        if key is not None and not torch.compiler.is_compiling():
            if len(_CHECKED) >= _CHECKED_SIZE:  # options that change every step (a schedule) stay bounded
                _CHECKED.clear()
            _CHECKED[key] = checked
    return dict(checked)


_CHECKED: dict = {}  # the given options as a key -> the checked ones
_CHECKED_SIZE = 256
_PLAIN = frozenset((bool, int, float, str, type(None), tuple, list))


def _cache_key(values):
    """A key of the given options (their names, values and types: True and 1 differ), or None where one is not a
    plain value (a tensor, a generator, a sequence of other than ints)."""
    given = tuple(values.values())
    types = tuple(map(type, given))
    if not _PLAIN.issuperset(types):
        return None
    if tuple in types or list in types:
        if not all(type(d) is int for v in given if type(v) in (tuple, list) for d in v):
            return None
        given = tuple(tuple(v) if type(v) is list else v for v in given)
    return tuple(values), given, types


class LossModule(torch.nn.Module):
    """The module form of a public function: ``__init__`` takes the function's options, checks them (``check``:
    more checks of a subclass) and keeps them as given in ``self.options`` for ``forward`` to pass on; the repr
    lists them."""

    def __init__(self, options: Dict[str, Any]) -> None:
        super().__init__()
        self.check(check_options(options))  # the errors come at construction; the function takes the values as given
        self.options = options

    def check(self, options):
        """Checks of the checked options (a dict) that need no tensor, beyond each option's own (none here)."""

    def extra_repr(self):
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
