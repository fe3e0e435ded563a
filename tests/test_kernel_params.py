"""The kernels' parameter structs and constants, defined once in the CUDA sources and mirrored in Python
(transducer/cuda/stages.py, transducer/layout.py): both sides list the same fields, in the same order, of the same
types, and the same values; the launch bounds are named constants; warps_per_row picks only what the row kernels
take; and every option the option table (transducer/options.py: SUPPORTED) marks as supported on CUDA is a field
that a kernel of its lattice reads. Read from the sources: no GPU or compiler needed."""

import os
import re

import pytest

import ops
from ops import gather_cuda, reduce_cuda
from ops.params import struct
from ragged import ragged_cuda
from transducer import layout
from transducer.cuda import stages as cuda
from transducer.joiner import ACTIVATIONS
from transducer.options import SUPPORTED

ROOT = ops.cuda_include_dir()
SOURCES = ["ops/fast_divmod.cuh", "transducer/cuda/layout.cuh", "transducer/cuda/params.cuh", "transducer/cuda/row_pass.cuh",
           "transducer/cuda/arcs.cuh", "transducer/cuda/stages.cu", "transducer/cuda/tdt.cu", "transducer/cuda/pack.cu", "ops/gather.cu",
           "ops/reduce.cu", "ragged/ragged.cu"]
PARAMS = [cuda.LAYOUT_PARAMS, cuda.LOG_PROBS_PARAMS, cuda.ALPHA_BETA_PARAMS, cuda.GRADIENT_PARAMS,
          cuda.TDT_LOG_PROBS_PARAMS, cuda.TDT_WALK_PARAMS, cuda.TDT_GRADIENT_PARAMS, cuda.PACK_FORWARD_PARAMS,
          cuda.PACK_GRAD_PARAMS, cuda.ROW_LABELS_PARAMS, cuda.ROW_LOG_PROBS_PARAMS, cuda.ROW_COEFFICIENTS_PARAMS,
          cuda.TDT_ROW_LOG_PROBS_PARAMS, cuda.TDT_ROW_COEFFICIENTS_PARAMS, gather_cuda.GATHER_PARAMS,
          reduce_cuda.REDUCE_PARAMS, reduce_cuda.FINALIZE_PARAMS, ragged_cuda.ROW_IDS_PARAMS,
          ragged_cuda.ROW_SPLITS_PARAMS]
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


def _braced(text, start):
    """The text between the brace that opens just before ``start`` and the brace that closes it."""
    depth, i = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[start:i - 1]


def _structs(text):
    """{name: [(field, C type or struct name or (C type, length))]} of every struct with data members."""
    constants = _constants(text)
    structs = {}
    for m in re.finditer(r"\bstruct\s+(?:alignas\([^)]*\)\s+)?(\w+)\s*\{", text):
        body = _braced(text, m.end())
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
    assert c["kMaxBlockThreads"] == cuda.MAX_BLOCK_THREADS
    assert c["kPackRows"] == cuda.PACK_ROWS
    assert c["kSumFrames"] == cuda.PACK_FRAMES and c["kSumLanes"] == cuda.PACK_LANES
    assert c["kSumThreads"] == cuda.PACK_SUM_THREADS and c["kPredParts"] == cuda.PACK_PRED_PARTS
    assert cuda.PACK_U_CHUNK > 0 and cuda.PACK_U_CHUNK % c["kSumSteps"] == 0  # a chunk of u: whole steps of u
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


def test_launch_bounds_are_named_constants():
    # a block size written as a number would escape test_constants_agree
    bounds = re.findall(r"__launch_bounds__\(([^)]*)\)", TEXT)
    assert bounds
    assert [b for b in bounds if not re.fullmatch(r"\w+::k\w+(\s*,\s*\w+::k\w+)?", b.strip())] == []


def test_warps_per_row_picks_what_the_row_kernels_take(monkeypatch):
    # RowGeometry<WPR> (row_pass.cuh) takes a warp or a block a row; cuda.warps_per_row picks the kernels' WPR
    block = re.search(r"static_assert\(WPR == 1 \|\| WPR == ([^,]+),", TEXT).group(1)
    allowed = {1, int(eval(block, {}, _constants(TEXT)))}
    assert allowed == {1, cuda.THREADS // 32}
    monkeypatch.setattr(cuda, "num_sms", lambda device: 132)
    picked = {cuda.warps_per_row(rows, row_bytes, None) for rows in (1, 1000, 10**6)
              for row_bytes in (2, 1000, 4096, 16384, 16385, 1 << 20)}
    assert picked == allowed


# The kernels of each lattice's stages (transducer/lattices.py's objects call the stages, transducer/cuda/stages.py
# launches these): TDT with omega > 0 walks the plain RNN-T loss too, and the multi-blank loss walks TDT's walk.
LATTICE_KERNELS = {
    "RNN-T": ("log_probs_kernel", "alpha_beta_kernel", "gradient_kernel"),
    "TDT": ("tdt_log_probs_kernel", "tdt_walk_kernel", "tdt_alpha_beta_kernel", "tdt_gradient_kernel",
            "alpha_beta_kernel"),
    "multi-blank RNN-T": ("log_probs_kernel", "tdt_walk_kernel", "tdt_alpha_beta_kernel", "gradient_kernel"),
}

# The options that the host resolves before a launch, so that no kernel has them as a field: (lattice, option)
# and what the host does with it instead.
HOST_RESOLVED = {
    ("RNN-T", "one_sym_per_frame"): "picks the RNA instantiation of alpha_beta_kernel and gradient_kernel",
}


def _kernel(text, name):
    """(the name of its parameter struct, its body) of the __global__ function ``name``."""
    m = re.search(rf"__global__[^;{{}}]*?\b{name}\(const (\w+)<[^>]*> p\)\s*\{{", text)
    assert m is not None, f"no kernel {name} taking a parameter struct p"
    return m.group(1), _braced(text, m.end())


def _field_paths(structs, name):
    """The fields of struct ``name`` and, through those of struct type, of its parts: ("labels", "blank"), ..."""
    for field, ctype in structs[name]:
        yield (field,)
        if isinstance(ctype, str) and ctype in structs:
            yield from ((field, *path) for path in _field_paths(structs, ctype))


def _unread_cuda_options(structs, text):
    """(lattice, option) of each option that SUPPORTED marks as supported on CUDA for a lattice, and that no kernel
    of that lattice has as a field of its parameter struct (a field of one of its parts counts) and reads there
    (p.<field>, p.labels.blank, ...), unless the host resolves it (HOST_RESOLVED)."""
    unread = []
    for lattice, options in SUPPORTED.items():
        kernels = [_kernel(text, name) for name in LATTICE_KERNELS[lattice]]
        for option, backends in options.items():
            if "cuda" not in backends or (lattice, option) in HOST_RESOLVED:
                continue
            if not any(re.search(r"\bp\." + r"\.".join(path) + r"\b", body)
                       for params, body in kernels for path in _field_paths(structs, params) if path[-1] == option):
                unread.append((lattice, option))
    return unread


def test_every_cuda_option_is_a_field_a_kernel_of_its_lattice_reads():
    assert _unread_cuda_options(STRUCTS, TEXT) == []


def test_host_resolved_options_are_cuda_options_no_kernel_has():
    host_source = open(cuda.__file__).read()
    for (lattice, option), reason in HOST_RESOLVED.items():
        assert "cuda" in SUPPORTED[lattice][option] and reason
        assert f"options.{option}" in host_source
        fields = {path[-1] for name in LATTICE_KERNELS[lattice]
                  for path in _field_paths(STRUCTS, _kernel(TEXT, name)[0])}
        assert option not in fields, f"{option} is a field of a {lattice} kernel: not resolved on the host"


def test_an_option_without_its_field_or_its_read_is_found():
    # GradientParams without clamp: the RNN-T and multi-blank losses' clamp is read by no kernel of theirs
    structs = dict(STRUCTS, GradientParams=[f for f in STRUCTS["GradientParams"] if f[0] != "clamp"])
    assert _unread_cuda_options(structs, TEXT) == [("RNN-T", "clamp"), ("multi-blank RNN-T", "clamp")]
    # the field kept but unread: tdt_gradient_kernel's omega
    name, body = _kernel(TEXT, "tdt_gradient_kernel")
    assert "p.omega" in body
    text = TEXT.replace(body, body.replace("p.omega", "0.0"))
    assert _unread_cuda_options(STRUCTS, text) == [("TDT", "omega")]
