"""The kernels' parameter structs and constants, defined once in the CUDA sources and mirrored in Python
(transducer/cuda_stages.py, transducer/layout.py): both sides list the same fields, in the same order, of the same
types, and the same values. Read from the sources: no GPU or compiler needed."""

import os
import re

import pytest

import ops
from ops import gather_cuda, reduce_cuda
from ops.params import struct
from ragged import ragged_cuda
from transducer import cuda_stages as cuda, layout
from transducer.joiner import ACTIVATIONS

ROOT = ops.cuda_include_dir()
SOURCES = ["ops/fast_divmod.cuh", "transducer/common.cuh", "transducer/stages.cu", "transducer/tdt.cu",
           "transducer/pack.cu", "ops/gather.cu", "ops/reduce.cu", "ragged/ragged.cu"]
PARAMS = [cuda.LAYOUT_PARAMS, cuda.LOG_PROBS_PARAMS, cuda.ALPHA_BETA_PARAMS, cuda.GRADIENT_PARAMS,
          cuda.TDT_LOG_PROBS_PARAMS, cuda.TDT_WALK_PARAMS, cuda.TDT_GRADIENT_PARAMS, cuda.PACK_FORWARD_PARAMS,
          cuda.PACK_GRAD_PARAMS, gather_cuda.GATHER_PARAMS, reduce_cuda.REDUCE_PARAMS, reduce_cuda.FINALIZE_PARAMS,
          ragged_cuda.ROW_IDS_PARAMS, ragged_cuda.ROW_SPLITS_PARAMS]
_SCALARS = {"int": "int", "long long": "long long", "bool": "bool", "double": "double", "float": "float",
            "uint32_t": "unsigned int", "unsigned int": "unsigned int"}


def _source():
    text = ""
    for path in SOURCES:
        with open(os.path.join(ROOT, path)) as f:
            text += f.read() + "\n"
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def _constants(text):
    """constexpr ints (their expressions evaluated: 1ll << 61 and the like)."""
    out = {}
    for name, expr in re.findall(r"^\s*constexpr\s+(?:int|long long)\s+(\w+)\s*=\s*([\w\s<]+);", text, re.M):
        out[name] = eval(re.sub(r"(\d+)ll", r"\1", expr), {}, dict(out))
    return out


def _structs(text):
    """{name: [(field, C type or struct name or (C type, length))]} of every struct with data members."""
    constants = _constants(text)
    structs = {}
    for m in re.finditer(r"\bstruct\s+(?:alignas\([^)]*\)\s+)?(\w+)\s*\{", text):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        body = text[m.end():i - 1]
        while re.search(r"\{[^{}]*\}", body):  # method bodies, nested initialisers
            body = re.sub(r"\{[^{}]*\}", ";", body)
        fields = []
        for statement in body.split(";"):
            statement = " ".join(statement.split())
            if not statement or "(" in statement or statement.startswith(("static", "typedef", "using", "template")):
                continue
            statement = statement.replace("__restrict__", "").replace("const ", "")
            kind, _, names = statement.rpartition(" ") if "," not in statement else (None, None, None)
            if "," in statement:  # int a, b, c
                head = statement.split(",")[0]
                kind, first = head.rsplit(" ", 1)
                names = [first] + [n.strip() for n in statement.split(",")[1:]]
            else:
                names = [names]
            for name in names:
                pointer = "*" in kind or name.startswith("*")
                name = name.lstrip("*")
                array = re.match(r"(\w+)\[(\w+)\]", name)
                base = kind.replace("*", "").strip()
                if pointer:
                    ctype = "ptr"
                elif base in _SCALARS:
                    ctype = _SCALARS[base]
                else:
                    ctype = re.sub(r"<.*", "", base).split("::")[-1]
                if array:
                    name, length = array.groups()
                    ctype = (ctype, constants.get(length, None) if not length.isdigit() else int(length))
                fields.append((name, ctype))
        if fields:
            structs[m.group(1)] = fields
    return structs


TEXT = _source()
STRUCTS = _structs(TEXT)


def _compare(cls, seen):
    c_fields = STRUCTS.get(cls.__name__)
    assert c_fields is not None, f"no struct {cls.__name__} in {SOURCES}"
    assert [f for f, _ in c_fields] == [f for f, _ in cls.c_fields], cls.__name__
    for (field, c_type), (_, py_type) in zip(c_fields, cls.c_fields):
        if isinstance(py_type, type):
            assert c_type == py_type.__name__, f"{cls.__name__}.{field}"
            if py_type not in seen:
                seen.add(py_type)
                _compare(py_type, seen)
        else:
            assert c_type == py_type, f"{cls.__name__}.{field}: C {c_type}, Python {py_type}"


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p.__name__)
def test_python_structs_mirror_the_cuda_ones(params):
    _compare(params, set())


def test_the_comparison_sees_a_difference():
    # a struct whose fields are swapped, renamed or retyped fails the comparison
    rows = STRUCTS["Rows"]
    swapped = struct("Rows", [rows[1], rows[0]] + rows[2:])
    renamed = struct("Rows", [("pointer", "ptr")] + rows[1:])
    retyped = struct("Rows", rows[:1] + [("ld", "int")] + rows[2:])
    for bad in (swapped, renamed, retyped):
        with pytest.raises(AssertionError):
            _compare(bad, set())


def test_constants_agree():
    c = _constants(TEXT)
    assert c["kThreads"] == cuda.THREADS
    assert c["kPackRows"] == cuda.PACK_ROWS
    assert c["kMaxDurations"] == layout.MAX_DURATIONS
    assert c["kWalkMaxThreads"] == cuda.WALK_MAX_THREADS
    assert c["kWalkMaxDurations"] == cuda.WALK_MAX_DURATIONS
    assert c["kCellsCap"] == layout.CELLS_CAP
    activation = re.search(r"enum Activation : int \{([^}]*)\}", TEXT).group(1)
    assert {k: int(v) for k, v in re.findall(r"k(\w+) = (\d+)", activation)} == {
        name.title().replace("_", ""): a.code for name, a in ACTIVATIONS.items()}  # leaky_relu: kLeakyRelu
    stat = re.search(r"enum Stat : int \{([^}]*)\}", TEXT).group(1)
    names = [n.strip() for n in stat.split(",")]
    assert names[-1] == "kNumStats" and len(names) - 1 == layout.NUM_STATS
    assert [re.sub(r"(?<!^)([A-Z])", r"_\1", n[1:]).lower() for n in names[:-1]] == list(layout.Stats._fields)
