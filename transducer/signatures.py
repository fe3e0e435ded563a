"""The public functions' and modules' signatures, docstrings, checks and repr, made from the option declarations
(transducer/options.py), as dataclasses makes a class's ``__init__``: each public entry names its tensors, the
order of the arguments it has always taken positionally, and the lattices whose options it takes; every other
option of those lattices follows as a keyword-only argument. The signatures are real (``help()``,
``inspect.signature`` and torch.compile see every argument, typed, with its default) and so are the docstrings'
``Args`` sections, one typed line per argument.
"""

import re
import textwrap
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import torch

from .options import BY_NAME, OPTIONS, REQUIRED

__all__ = ["Param", "Entry", "public_function", "check_options", "LossModule"]

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
    params: Tuple[Any, ...]          # Param or an option's name, in signature order
    exclude: Tuple[str, ...] = ()    # options of its lattices it does not take
    defaults: dict = {}              # option name -> its default here
    docs: dict = {}                  # option name -> its documentation here

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


_TYPES = {"int": int, "str": str, "bool": bool, "float": float, "list of int": Sequence[int], "Tensor": torch.Tensor,
          "torch.Generator": torch.Generator, "torch.device": torch.device, "torch.dtype": torch.dtype}


def _annotation(annotation, default):
    kind = _TYPES[annotation]
    return Optional[kind] if default is None else kind


def _arg_line(name, annotation, doc, default):
    """``name (type[, optional]): doc (Default: ``x``)``, wrapped as the docstrings are."""
    if default is REQUIRED:
        text = f"{name} ({annotation}): {doc}"
    else:
        text = f"{name} ({annotation}, optional): {doc} (Default: ``{default!r}``)"
    # a ``code span`` stays on one line: its spaces are held as NO-BREAK SPACEs while wrapping
    text = re.sub(r"``.*?``", lambda m: m.group(0).replace(" ", "\u00a0"), text)
    text = textwrap.fill(text, _WIDTH, initial_indent=" " * 8, subsequent_indent=" " * 12, break_on_hyphens=False,
                         break_long_words=False)
    return text.replace("\u00a0", " ")


def _arguments(entry):
    """[(name, annotation, doc, default, is_option, keyword_only)] of ``entry``, in signature order."""
    _, rest = entry.options()
    out = []
    for p in entry.params:
        if isinstance(p, Param):
            out.append((p.name, p.annotation, p.doc, p.default, False, False))
        else:
            out.append(_option_argument(entry, p, False))
    out += [_option_argument(entry, name, True) for name in rest]
    return out


def _option_argument(entry, name, keyword_only):
    o = BY_NAME[name]
    return (name, o.annotation, entry.docs.get(name, o.doc), entry.defaults.get(name, o.default), True, keyword_only)


def _define(name, arguments, body, namespace):
    """A function ``name(arguments)`` whose body is ``body`` (source), defaults and annotations from
    ``arguments``."""
    params, defaults, annotations, star = [], {}, {}, False
    for arg_name, annotation, _, default, _, keyword_only in arguments:
        if keyword_only and not star:
            params.append("*")
            star = True
        if default is REQUIRED:
            params.append(arg_name)
        else:
            defaults[arg_name] = default
            params.append(f"{arg_name}=__defaults[{arg_name!r}]")
        if annotation:
            annotations[arg_name] = _annotation(annotation, default)
    source = f"def {name}({', '.join(params)}):\n{textwrap.indent(body, '    ')}\n"
    scope = dict(namespace, __defaults=defaults)
    exec(source, scope)  # as dataclasses makes __init__: a real signature, traced like any function
    function = scope[name]
    function.__annotations__ = annotations
    return function


def _document(template, arguments):
    """The docstring ``template`` with its ``{args}`` line replaced by one line per argument."""
    lines = "\n".join(_arg_line(n, a, doc, d) for n, a, doc, d, _, _ in arguments)
    return template.replace("        {args}", lines)


def public_function(entry, implementation):
    """The public function of ``entry``: its signature and docstring from the declarations; it calls
    ``implementation(*params, options)`` with the Params (the tensors) positionally and every option's value, as
    given, in a dict (``implementation`` checks them, see ``check_options``)."""
    arguments = _arguments(entry)
    params = [n for n, _, _, _, is_option, _ in arguments if not is_option]
    options = [n for n, _, _, _, is_option, _ in arguments if is_option]
    body = f"return __implementation({', '.join(params)}, {{{', '.join(f'{n!r}: {n}' for n in options)}}})"
    function = _define(entry.name, arguments, body, {"__implementation": implementation})
    function.__doc__ = _document(implementation.__doc__, arguments)
    function.__module__ = implementation.__module__
    function.__qualname__ = entry.name
    function.entry = entry
    return function


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


_CHECKED = {}  # the given options as a key -> the checked ones
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
    """The module form of a public function: ``__init__`` takes the function's options (and the module's own
    arguments, ``Entry.params``' Params, handed to ``build``), checks them and keeps them in ``self.options``;
    ``forward`` (written by each module) passes them on to the function; the repr lists them. A subclass names its
    entry: ``class TDTLoss(LossModule, entry=...)``."""

    entry = None

    def __init_subclass__(cls, entry=None, **kwargs):
        super().__init_subclass__(**kwargs)
        if entry is None:
            return
        cls.entry = entry
        arguments = [("self", "", "", REQUIRED, False, False)] + _arguments(entry)
        own = [n for n, _, _, _, is_option, _ in arguments[1:] if not is_option]
        options = [n for n, _, _, _, is_option, _ in arguments[1:] if is_option]
        body = (f"__init(self, {{{', '.join(f'{n!r}: {n}' for n in options)}}}, "
                f"{{{', '.join(f'{n!r}: {n}' for n in own)}}})")
        init = _define("__init__", arguments, body, {"__init": LossModule._init})
        init.__qualname__ = f"{cls.__name__}.__init__"
        cls.__init__ = init
        cls.__doc__ = _document(cls.__doc__, arguments[1:])

    def _init(self, options, own):
        torch.nn.Module.__init__(self)
        self.check(check_options(options))  # the errors come at construction; the function takes the values as given
        self.options = options
        self.build(**own)

    def check(self, options):
        """Checks of the checked options (a dict) that need no tensor, beyond each option's own (none here)."""

    def build(self):
        """The module's own arguments (none here)."""

    def extra_repr(self):
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
