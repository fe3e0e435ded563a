"""Kernel parameter structs: a kernel takes one struct by value, filled on the host by name (CUTLASS's
Params pattern), instead of a long list of positional arguments.

``struct(name, fields)`` describes a C struct: ``fields`` lists ``(field, type)`` in declaration order, the
type being a C scalar type of ``C_TYPES``, ``(C type, length)`` for an array, or another struct made here.
It returns a namedtuple class, so a value names every field (a missing or unknown one is a TypeError) and
reads back by name::

    Rows = struct("Rows", [("data", "ptr"), ("ld", "long long"), ("row_start", "int"), ("num_rows", "int")])
    rows = Rows(data=logits, ld=logits.stride(0), row_start=0, num_rows=logits.size(0))

``ops.cuda.launch`` packs such a value in the C layout (each field at its alignment, the struct padded to
its widest field's): a ``"ptr"`` field takes a tensor (its data pointer) or None (NULL), the others
Python or numpy numbers, a nested struct a value of its type. The C definition lives in the kernel's
header; tests/test_kernel_params.py checks that both list the same fields, in the same order, of the
same types.
"""

from __future__ import annotations

import collections
import struct as _struct

__all__ = ["struct", "C_TYPES", "FAST_DIVMOD"]

#: C scalar types a field may have: (struct module code, size in bytes = alignment). "ptr" is any pointer.
C_TYPES = {
    "ptr": ("Q", 8),
    "bool": ("?", 1),
    "int": ("i", 4),
    "unsigned int": ("I", 4),
    "long long": ("q", 8),
    "float": ("f", 4),
    "double": ("d", 8),
}


def struct(name: str, fields):
    """A namedtuple class for the C struct ``name`` with ``fields`` = [(field, C type or struct class)].
    Class attributes: ``c_fields`` (the fields as given), ``c_format`` (the struct module's format of its
    bytes, without a byte-order prefix: explicit padding), ``c_size`` and ``c_align`` (its C size and
    alignment)."""
    fmt, offset, align = "", 0, 1
    for field, ctype in fields:
        count = 1
        if isinstance(ctype, tuple):  # an array: (C type, length)
            ctype, count = ctype
        if isinstance(ctype, type) and hasattr(ctype, "c_format") and count == 1:
            code, size, field_align = ctype.c_format, ctype.c_size, ctype.c_align
        elif ctype in C_TYPES:
            code, size = C_TYPES[ctype]
            field_align = size
            code, size = f"{count}{code}" if count > 1 else code, size * count
        else:
            raise TypeError(
                f"struct {name}: field {field} has type {ctype!r}; expected one of {list(C_TYPES)}, "
                f"(one of them, length) for an array, or a struct made by ops.params.struct"
            )
        pad = -offset % field_align
        fmt += f"{pad}x" * (pad > 0) + code
        offset += pad + size
        align = max(align, field_align)
    tail = -offset % align
    fmt += f"{tail}x" * (tail > 0)
    cls = collections.namedtuple(name, [field for field, _ in fields])
    cls.c_fields = tuple(fields)
    cls.c_format = fmt
    cls.c_size = offset + tail
    cls.c_align = align
    cls.c_flatten = _flattener(cls)
    assert _struct.calcsize("<" + fmt) == cls.c_size
    return cls


def _flattener(cls):
    """The function ``flatten(value, out)`` that appends a value's fields, as the struct module packs them, to the
    list ``out``: made from the fields as source (nested structs inlined), as dataclasses makes ``__init__``, since
    a launch packs one per call and a loop over the fields costs several times more host time."""
    checks, values, scope = [], [], {}

    def visit(struct_cls, path):
        name = f"_{len(scope)}"
        scope[name] = struct_cls
        checks.append(
            f"if type({path}) is not {name}: raise TypeError('expected a {struct_cls.__name__} "
            f"(ops.params.struct), got ' + type({path}).__name__)"
        )
        for i, (field, ctype) in enumerate(struct_cls.c_fields):
            x = f"{path}[{i}]"
            if ctype == "ptr":
                values.append(f"(0 if {x} is None else {x}.data_ptr())")
            elif isinstance(ctype, type):
                visit(ctype, x)
            elif isinstance(ctype, tuple):
                checks.append(
                    f"if len({x}) != {ctype[1]}: raise ValueError('{struct_cls.__name__}.{field}: expected "
                    f"{ctype[1]} values, got ' + str(len({x})))"
                )
                values.append(f"*{x}")
            else:
                values.append(x)

    visit(cls, "value")
    body = "\n    ".join(checks + [f"out.extend(({', '.join(values)},))", "return out"])
    exec(f"def flatten(value, out):\n    {body}\n", scope)
    return scope["flatten"]


#: ops/fast_divmod.cuh's ``struct FastDivmod`` (``FastDivmod(d).params()`` fills it).
FAST_DIVMOD = struct("FastDivmod", [("d", "unsigned int"), ("m", "unsigned int"), ("l", "unsigned int")])
