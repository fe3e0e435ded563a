"""The kernels' parameter structs and constants, defined once in the CUDA sources and mirrored in Python
(transducer/cuda/stages.py, transducer/layout.py): both sides list the same fields, in the same order, of the same
types, and the same values; the launch bounds are named constants; threads_per_row picks only what the row kernels
take; every kernel under transducer/ (found in the .cu files) that forms a per-row term does so with
transducer/cuda/terms.cuh's functions, passing them its Terms whole, and reads no option nor spells a term itself
(tests/test_terms.py checks those functions' values); and every option the option table (transducer/options.py:
SUPPORTED) marks as supported on CUDA is one that a kernel of its lattice reads. Read from the sources: no GPU or
compiler needed."""

import itertools
import os
import re
import types

import pytest
import torch

import ops
from ops import gather_cuda, reduce_cuda
from ops.params import struct
from ragged import ragged_cuda
from transducer import layout
from transducer.cuda import stages as cuda
from transducer.custom_ops import make_layout
from transducer.joiner import ACTIVATIONS
from transducer.lattices import Lattice
from transducer.options import SUPPORTED, LossOptions

ROOT = ops.cuda_include_dir()
SOURCES = [
    "ops/fast_divmod.cuh",
    "transducer/cuda/layout.cuh",
    "transducer/cuda/params.cuh",
    "transducer/cuda/row_pass.cuh",
    "transducer/cuda/terms.cuh",
    "transducer/cuda/arcs.cuh",
    "transducer/cuda/stages.cu",
    "transducer/cuda/tdt.cu",
    "transducer/cuda/pack.cu",
    "ops/gather.cu",
    "ops/reduce.cu",
    "ragged/ragged.cu",
]
PARAMS = [
    cuda.TERMS,
    cuda.LAYOUT_PARAMS,
    cuda.LOG_PROBS_PARAMS,
    cuda.ALPHA_BETA_PARAMS,
    cuda.GRADIENT_PARAMS,
    cuda.TDT_LOG_PROBS_PARAMS,
    cuda.TDT_WALK_PARAMS,
    cuda.TDT_GRADIENT_PARAMS,
    cuda.PACK_FORWARD_PARAMS,
    cuda.PACK_GRAD_PARAMS,
    cuda.ROW_LABELS_PARAMS,
    cuda.ROW_LOG_PROBS_PARAMS,
    cuda.ROW_COEFFICIENTS_PARAMS,
    cuda.TDT_ROW_LOG_PROBS_PARAMS,
    cuda.TDT_ROW_COEFFICIENTS_PARAMS,
    gather_cuda.GATHER_PARAMS,
    reduce_cuda.REDUCE_PARAMS,
    reduce_cuda.FINALIZE_PARAMS,
    ragged_cuda.ROW_IDS_PARAMS,
    ragged_cuda.ROW_SPLITS_PARAMS,
]
_SCALARS = {
    "int": "int",
    "long long": "long long",
    "bool": "bool",
    "double": "double",
    "float": "float",
    "uint32_t": "unsigned int",
    "unsigned int": "unsigned int",
}


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
    return text[start : i - 1]


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
        name.title().replace("_", ""): a.code for name, a in ACTIVATIONS.items()
    }  # leaky_relu: kLeakyRelu
    stat = re.search(r"enum Stat : int \{([^}]*)\}", TEXT).group(1)
    names = [n.strip() for n in stat.split(",")]
    assert names[-1] == "kNumStats" and len(names) - 1 == layout.NUM_STATS
    assert [re.sub(r"(?<!^)([A-Z])", r"_\1", n[1:]).lower() for n in names[:-1]] == list(layout.Stats._fields)


def test_launch_bounds_are_named_constants():
    # a block size written as a number would escape test_constants_agree; the blocks an SM holds may depend on the
    # kernel's types (pack.cu's kSumMinBlocks<T, TE, TP>)
    bounds = re.findall(r"__launch_bounds__\(([^)]*)\)", TEXT)
    assert bounds
    named = r"\w+::k\w+(\s*,\s*\w+::k\w+(<[\w\s,]*>)?)?"
    assert [b for b in bounds if not re.fullmatch(named, b.strip())] == []


def test_alpha_beta_buffers_hold_every_u_a_block_takes():
    # stages.cu's Walk::run_shared takes an utterance where U + 1 <= cap and <= the block's threads: the buffers must
    # hold a block's u's (whatever the batch's longest U) and fit the default dynamic shared memory
    for max_u1 in list(range(1, 2100)) + list(range(2100, 20000, 7)) + [3072, 3073, 6144, 6145, 1 << 20]:
        threads = cuda._walk(torch.empty(0, 2), types.SimpleNamespace(max_u1=max_u1, batch_size=0))[1]
        for itemsize in (4, 8):
            cap = cuda._alpha_beta_smem_entries(max_u1, itemsize)
            assert min(max_u1, threads) <= cap <= max_u1, (max_u1, itemsize, cap)
            assert 2 * cap * itemsize <= ops.cuda.DEFAULT_SHARED_MEM, (max_u1, itemsize, cap)
    assert cuda._alpha_beta_smem_entries(6144, 4) == 6144 and cuda._alpha_beta_smem_entries(6145, 4) == 1024


def test_threads_per_row_picks_what_the_row_kernels_take(monkeypatch):
    # RowGeometry<TPR> (row_pass.cuh) takes 8, 16 or 32 lanes or a block a row; cuda.threads_per_row picks TPR
    allowed = re.search(r"static_assert\(TPR == 8 \|\| TPR == 16 \|\| TPR == 32 \|\| TPR == (\w+),", TEXT).group(1)
    assert allowed == "kThreads" and _constants(TEXT)["kThreads"] == cuda.THREADS
    monkeypatch.setattr(cuda, "num_sms", lambda device: 132)
    sizes = [
        (rows, row_bytes) for rows in (1, 1000, 10**6) for row_bytes in (2, 1000, 2048, 4096, 16384, 16385, 1 << 20)
    ]
    lanes = (cuda.LOG_PROBS_LANE_BYTES, cuda.GRADIENT_LANE_BYTES)
    assert {cuda.threads_per_row(r, n, None, per) for r, n in sizes for per in lanes} == {8, 16, 32, cuda.THREADS}
    assert {cuda.threads_per_row(r, n, None) for r, n in sizes} == {32, cuda.THREADS}  # TDT's: a warp at least
    # each lane of a short row reads at most bytes_per_lane, and no fewer lanes would do
    for per in lanes:
        for row_bytes in (2, 256, 257, 1000, 1024, 1025, 2048, 2049, 4095):
            tpr = cuda.threads_per_row(10**6, row_bytes, None, per)
            assert tpr == 32 or row_bytes <= tpr * per
            assert tpr == 8 or row_bytes > tpr // 2 * per


@pytest.mark.parametrize("K", [1, 7, 8, 9, 16])
def test_the_multiblank_row_kernels_ask_for_their_lanes(monkeypatch, K):
    # log_probs_kernel loads big blank i on lane 1 + i of the row, gradient_kernel forms its arc on lane i: their
    # launchers ask _row_pass for K + 1 and K lanes (caught here as the pass is planned, before any launch)
    asked = []

    class Planned(Exception):
        pass

    def plan(*args, lanes=0, **kwargs):
        asked.append(lanes)
        raise Planned

    monkeypatch.setattr(cuda, "_row_pass", plan)
    V, T, U = 64, torch.tensor([5]), torch.tensor([1])
    x, targets = torch.zeros(10, V), torch.ones(1, 1, dtype=torch.int64)
    o = LossOptions(blank=V - 1, big_blank_durations=tuple(range(2, 2 + K)))
    layout = make_layout(x, targets, T, U)
    with pytest.raises(Planned):
        cuda.multiblank_log_probs(x, targets, layout, o)
    zeros = torch.zeros(10)
    lattice = Lattice(layout, torch.zeros(10, 2), zeros, zeros, zeros, torch.zeros(1), torch.zeros(10, K))
    with pytest.raises(Planned):
        cuda.gradient(x, targets, lattice, torch.ones(1), o, torch.empty_like(x))
    assert asked == [K + 1, K]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(
    "V, ld, offset",
    [
        (5, 5, 0),
        (64, 64, 0),
        (500, 500, 0),
        (500, 512, 0),
        (500, 513, 0),
        (500, 512, 1),
        (1021, 1024, 0),
        (505, 512, 0),
    ],
)
@pytest.mark.parametrize("lanes", [0, 1, 3, 7, 8, 16, 17])
def test_a_row_pass_gets_the_lanes_its_access_needs(monkeypatch, dtype, V, ld, offset, lanes):
    # the unaligned pass gives its head and tail scalars one lane each (RowPass::begin: lanes < head + tail), the
    # multi-blank kernels lanes 1 ... K (log-probs) or 0 ... K - 1 (gradient) of the row: every one must exist
    monkeypatch.setattr(cuda, "num_sms", lambda device: 132)
    # offset: rows whose stride keeps 16-byte boundaries but whose base does not start on one
    rows = torch.zeros(64 * ld + 8, dtype=dtype)[offset : offset + 64 * ld].view(64, ld)[:, :V]
    passes = (((), False), ((rows,), True), ((torch.zeros(64, -(-V // 8) * 8, dtype=dtype)[:, :V],), True))
    for per_lane, (outs, staging) in itertools.product((cuda.LOG_PROBS_LANE_BYTES, cuda.GRADIENT_LANE_BYTES), passes):
        tpr, vec, aligned, staged = cuda._row_pass(10**6, V, rows.element_size(), rows, per_lane, outs, staging, lanes)
        assert (vec, aligned, staged) == cuda.row_access(rows.element_size(), V, rows, outs, 8 if staging else 0)
        assert tpr in (8, 16, 32)
        assert tpr >= lanes or tpr == 32  # K < 32: the launcher's check (multiblank), not the pass's
        if not aligned and not staged:
            assert tpr >= _scalars_a_row(rows, vec)
            # and no more lanes than a bound of them asks: a tail alone (fewer than vec) where every row starts on a
            # vector boundary (the fused loss's tiles), else a head and a tail (at most 2 vec - 2, and V)
            starts = rows.data_ptr() % 16 == 0 and ld * rows.element_size() % 16 == 0
            bound = V % vec if starts else min(V, 2 * vec - 2)
            least = max(cuda.threads_per_row(10**6, V * rows.element_size(), None, per_lane), lanes)
            assert tpr == next(g for g in (8, 16, 32) if g >= max(least, bound) or g == 32)
        if staged:
            assert tpr == 32  # its shared rows are sized for 8 rows a block


def _scalars_a_row(rows, vec):
    """The most scalars of a row of ``rows`` in the unaligned pass (RowPass::begin's head and tail), row by row."""
    start, ld, V = rows.data_ptr() // rows.element_size(), rows.stride(0), rows.size(1)
    heads = [min(-(start + r * ld) % vec, V) for r in range(rows.size(0))]
    return max(h + (V - h) % vec for h in heads)


def _kernel(text, name):
    """(the name of its parameter struct, its body) of the __global__ function ``name``."""
    m = re.search(rf"__global__[^;{{}}]*?\b{name}\(\s*const (\w+)<.*?> p\)\s*\{{", text, re.S)
    assert m is not None, f"no kernel {name} taking a parameter struct p"
    return m.group(1), _braced(text, m.end())


def _field_paths(structs, name):
    """The fields of struct ``name`` and, through those of struct type, of its parts: ("labels", "blank"), ..."""
    for field, ctype in structs[name]:
        yield (field,)
        if isinstance(ctype, str) and ctype in structs:
            yield from ((field, *path) for path in _field_paths(structs, ctype))


# ----------------------------------------------------------------------------------------------- the terms
# terms.cuh writes each per-row term once, in functions that read the options struct Terms; a kernel that forms a
# term has a Terms field, passes it whole (p.<field>) and calls the functions.

TERMS_HEADER = "transducer/cuda/terms.cuh"
TERMS = "Terms"
MATH = r"\b(?:exp_acc|exp_fast|log_acc|log_fast|log1p_exp|expf|logf|exp|log|__expf|__logf)\s*\("


def _uncommented(path):
    with open(os.path.join(ROOT, path)) as f:
        return re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", f.read()), flags=re.S)


def _term_functions(text):
    """{name: the Terms fields it reads (o.<field>), also through the term functions it calls} of the functions
    terms.cuh defines (TD_TERM)."""
    bodies = {}
    for m in re.finditer(r"\bTD_TERM\s+[^;{}()]*?\b(\w+)\s*\([^;{}]*\)\s*(?:const\s*)?\{", text):
        bodies[m.group(1)] = _braced(text, m.end())
    reads = {name: set(re.findall(r"\bo\.(\w+)", body)) for name, body in bodies.items()}
    for _ in bodies:  # the closure over calls
        for name, body in bodies.items():
            for other in bodies:
                if other != name and re.search(rf"\b{other}\s*[<(]", body):
                    reads[name] |= reads[other]
    return reads


def _device_functions(text):
    """{name: body} of the __device__ functions and methods of the sources (the helpers a kernel calls)."""
    out = {}
    for m in re.finditer(r"__device__\s+[^;{}()]*?\b(\w+)\s*\([^;{}]*\)\s*(?:const\s*)?\{", text):
        out.setdefault(m.group(1), []).append(_braced(text, m.end()))
    return out


def _kernels_under_transducer():
    """[(file, kernel, its parameter struct, its body)] of every __global__ function of every .cu file under
    transducer/, found in the files (every __global__ must take a parameter struct p)."""
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "transducer")):
        for name in sorted(files):
            if not name.endswith(".cu"):
                continue
            path = os.path.relpath(os.path.join(folder, name), ROOT)
            text = _uncommented(path)
            matches = list(
                re.finditer(
                    r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\(\s*"
                    r"const\s+(\w+)<.*?>\s+p\)\s*\{",
                    text,
                    re.S,
                )
            )
            assert len(matches) == text.count("__global__"), f"{path}: a kernel not taking a parameter struct p"
            found += [(path, m.group(1), m.group(2), _braced(text, m.end())) for m in matches]
    return found


# What a kernel that writes these fields of its parameter struct must compute with the term functions: the
# functions (one of them) for each output. A field of type Lattice: a gradient (its arcs' posteriors and the terms
# of its token scores' gradient).
TERM_OUTPUTS = {
    "lp": ({"token_log_probs"},),
    "lp_arcs": ({"big_blank_log_prob", "duration_log_prob"},),
    "Lattice": ({"rnnt_arcs", "tdt_arcs"}, {"rnnt_token_terms", "tdt_token_terms"}),
    "big_blank_durations": ({"big_blank_arc"},),
    "out": ({"token_gradient"},),
    "out_tokens": ({"token_gradient"},),
    "out_duration_scores": ({"duration_gradient"},),
    "duration_gradient": ({"duration_gradient"},),
}


def _term_outputs(text, structs, params):
    """The TERM_OUTPUTS keys that the parameter struct ``params`` has: pointers it writes (not const), a Lattice,
    and with a Lattice the fields of the gradient's."""
    match = re.search(rf"\bstruct\s+{params}\s*\{{", text)
    body = _braced(text, match.end())
    fields = dict(structs[params])
    declarations = [" ".join(d.split()) for d in body.split(";")]
    writes = {f for f in fields for d in declarations if re.search(rf"\*\s*{f}$", d) and not d.startswith("const ")}
    lattice = any(c == "Lattice" for c in fields.values())
    keys = {f for f in writes if f in ("lp", "lp_arcs")}
    if lattice:
        keys |= {"Lattice"} | {f for f in fields if f in TERM_OUTPUTS and f not in ("lp", "lp_arcs")}
    return keys


def _term_problems(text, structs, kernels):
    """What the kernels get wrong about the terms: a kernel body or a device function outside terms.cuh that names a
    field of Terms, a kernel body that calls exp or log or reads the fields of an RnntArcs (a term spelled in the
    kernel), or one that forms a term without its Terms field passed whole or without the term functions its outputs
    need (TERM_OUTPUTS; a call of a helper of the sources that calls them counts)."""
    terms = _term_functions(text)
    options = [f for f, _ in structs[TERMS]]
    header = _uncommented(TERMS_HEADER)
    functions = _device_functions(text.replace(header, ""))
    helpers = {
        name: set().union(*({t for t in terms if re.search(rf"\b{t}\s*[<(]", b)} for b in bodies))
        for name, bodies in functions.items()
    }
    problems = []
    for name, bodies in functions.items():
        named = sorted({o for b in bodies for o in re.findall(r"\.(" + "|".join(options) + r")\b", b)})
        if named:
            problems.append(f"{name} names {named}: options are read in {TERMS_HEADER} only")
    for path, name, params, body in kernels:
        named = sorted(set(re.findall(r"\b(" + "|".join(options) + r")\b", body)))
        if named:
            problems.append(f"{name} ({path}) names {named}: options are read in {TERMS_HEADER} only")
        keys = _term_outputs(text, structs, params)
        if not keys:
            continue
        if re.search(MATH, body):
            problems.append(f"{name} ({path}) calls exp or log itself: a term belongs in {TERMS_HEADER}")
        arcs = re.findall(r"\bRnntArcs<[^>]*>\s+(\w+)", body)
        if any(re.search(rf"\b{a}\.", body) for a in arcs):
            problems.append(f"{name} ({path}) reads an RnntArcs itself: the terms formed from it are {TERMS_HEADER}'s")
        fields = [f for f, c in structs[params] if c == TERMS]
        if (
            len(fields) != 1
            or not re.search(rf"\bp\.{fields[0]}\b(?!\.)", body)
            or re.search(rf"\b{TERMS}\s*[{{(]", body)
        ):
            problems.append(f"{name} ({path}) forms terms without passing its {TERMS} field whole")
        called = {t for t in terms if re.search(rf"\b{t}\s*[<(]", body)}
        called |= set().union(*(helpers[h] for h in helpers if re.search(rf"[.\s(]{h}\s*\(", body)))
        for key in sorted(keys):
            for need in TERM_OUTPUTS[key]:
                if not called & need:
                    problems.append(f"{name} ({path}) writes {key} without calling {' or '.join(sorted(need))}")
    return problems


KERNELS = _kernels_under_transducer()


def test_the_kernels_are_found_in_the_files():
    names = {name for _, name, _, _ in KERNELS}
    assert {
        "log_probs_kernel",
        "gradient_kernel",
        "row_log_probs_kernel",
        "row_coefficients_kernel",
        "tdt_log_probs_kernel",
        "tdt_gradient_kernel",
        "tdt_row_log_probs_kernel",
        "tdt_row_coefficients_kernel",
        "pack_forward_kernel",
    } <= names
    forming = {name for _, name, params, _ in KERNELS if _term_outputs(TEXT, STRUCTS, params)}
    assert forming == {
        "log_probs_kernel",
        "gradient_kernel",
        "row_log_probs_kernel",
        "row_coefficients_kernel",
        "tdt_log_probs_kernel",
        "tdt_gradient_kernel",
        "tdt_row_log_probs_kernel",
        "tdt_row_coefficients_kernel",
    }


def test_every_term_is_formed_by_the_term_functions():
    assert _term_problems(TEXT, STRUCTS, KERNELS) == []


def test_every_terms_field_is_an_option_a_term_function_reads():
    terms = _term_functions(TEXT)
    fields = [f for f, _ in STRUCTS[TERMS]]
    assert set(fields) <= {option for options in SUPPORTED.values() for option in options}
    assert set(fields) == set().union(*terms.values())


def _mutated(kernel, old, new):
    """KERNELS with ``old`` replaced by ``new`` in the body of ``kernel``."""
    out = []
    for path, name, params, body in KERNELS:
        if name == kernel:
            assert old in body, f"{old!r} not in {kernel}"
            body = body.replace(old, new)
        out.append((path, name, params, body))
    return out


@pytest.mark.parametrize(
    "kernel,old,new,problem",
    [
        # an option read in the kernel, or zeroed there
        (
            "gradient_kernel",
            "p.terms,",
            "Terms{p.terms.sigma, p.terms.delay_penalty, 0.0, 0.0, p.terms.clamp},",
            "names ['clamp', 'delay_penalty', 'sigma']",
        ),
        (
            "row_log_probs_kernel",
            "picks.store(p.lp, r, ri, d, p.terms)",
            "picks.store(p.lp, r, ri, d, Terms{})",
            "without passing its Terms field whole",
        ),
        # a term spelled in the kernel, or dropped
        ("row_coefficients_kernel", "c[n] = terms.factor;", "c[n] = exp_acc(arcs.log_gamma);", "calls exp or log"),
        ("row_coefficients_kernel", "c[3ll * n] = terms.sub_label;", "c[3ll * n] = arcs.label;", "reads an RnntArcs"),
        (
            "log_probs_kernel",
            "big_blank_log_prob(p.terms, x_big, d)",
            "x_big - d",
            "without calling big_blank_log_prob",
        ),
        (
            "tdt_row_coefficients_kernel",
            "duration_gradient(p.terms,",
            "(0.0f * (",
            "writes duration_gradient without calling duration_gradient",
        ),
        (
            "tdt_gradient_kernel",
            "token_gradient<Acc, true, CLAMP>(",
            "TokenGradient<Acc, true, CLAMP>{",
            "writes out_tokens without calling token_gradient",
        ),
    ],
)
def test_a_kernel_that_reads_an_option_or_spells_a_term_is_found(kernel, old, new, problem):
    problems = _term_problems(TEXT, STRUCTS, _mutated(kernel, old, new))
    assert len(problems) >= 1 and all(kernel in p for p in problems) and any(problem in p for p in problems), problems


def test_a_helper_that_reads_an_option_is_found():
    # BlankAndLabel::store (arcs.cuh) with the delay penalty zeroed
    old = "token_log_probs(terms, x_blank"
    assert old in TEXT
    text = TEXT.replace(old, "token_log_probs(Terms{terms.sigma, 0.0, 0.0, 0.0, 0.0}, x_blank")
    assert _term_problems(text, STRUCTS, KERNELS) == [
        "store names ['sigma']: options are read in " + TERMS_HEADER + " only"
    ]


# The kernels of each lattice's stages (transducer/lattices.py's objects call the stages, transducer/cuda/stages.py
# launches these): TDT with omega > 0 walks the plain RNN-T loss too, and the multi-blank loss walks TDT's walk.
LATTICE_KERNELS = {
    "RNN-T": ("log_probs_kernel", "alpha_beta_kernel", "gradient_kernel"),
    "TDT": (
        "tdt_log_probs_kernel",
        "tdt_walk_kernel",
        "tdt_alpha_beta_kernel",
        "tdt_gradient_kernel",
        "alpha_beta_kernel",
    ),
    "multi-blank RNN-T": ("log_probs_kernel", "tdt_walk_kernel", "tdt_alpha_beta_kernel", "gradient_kernel"),
}

# The options that the host resolves before a launch, so that no kernel has them as a field: (lattice, option)
# and what the host does with it instead.
HOST_RESOLVED = {
    ("RNN-T", "one_sym_per_frame"): "picks the RNA instantiation of alpha_beta_kernel and gradient_kernel",
}


def _reads(structs, text, params, body):
    """The options a kernel reads: the fields of its parameter struct (or of its parts) that its body reads
    (p.<field>, p.labels.blank, ...), and the fields of Terms that the term functions it calls read, when it passes
    its Terms field whole."""
    read = {path[-1] for path in _field_paths(structs, params) if re.search(r"\bp\." + r"\.".join(path) + r"\b", body)}
    fields = [f for f, c in structs[params] if c == TERMS]
    if fields and re.search(rf"\bp\.{fields[0]}\b(?!\.)", body):
        terms = _term_functions(text)
        helpers = _device_functions(text)
        called = [t for t in terms if re.search(rf"\b{t}\s*[<(]", body)]
        for h, bodies in helpers.items():
            if re.search(rf"[.\s(]{h}\s*\(", body):
                called += [t for t in terms for b in bodies if re.search(rf"\b{t}\s*[<(]", b)]
        read |= set().union(*(terms[t] for t in called))
    return read


def _unread_cuda_options(structs, text):
    """(lattice, option) of each option that SUPPORTED marks as supported on CUDA for a lattice, and that no kernel
    of that lattice reads (_reads), unless the host resolves it (HOST_RESOLVED)."""
    unread = []
    for lattice, options in SUPPORTED.items():
        kernels = [_kernel(text, name) for name in LATTICE_KERNELS[lattice]]
        read = set().union(*(_reads(structs, text, params, body) for params, body in kernels))
        for option, backends in options.items():
            if "cuda" not in backends or (lattice, option) in HOST_RESOLVED:
                continue
            if option not in read:
                unread.append((lattice, option))
    return unread


def test_every_cuda_option_is_a_field_a_kernel_of_its_lattice_reads():
    assert _unread_cuda_options(STRUCTS, TEXT) == []


def test_host_resolved_options_are_cuda_options_no_kernel_has():
    host_source = open(cuda.__file__).read()
    for (lattice, option), reason in HOST_RESOLVED.items():
        assert "cuda" in SUPPORTED[lattice][option] and reason
        assert f"options.{option}" in host_source
        fields = {
            path[-1] for name in LATTICE_KERNELS[lattice] for path in _field_paths(STRUCTS, _kernel(TEXT, name)[0])
        }
        assert option not in fields, f"{option} is a field of a {lattice} kernel: not resolved on the host"


def test_an_option_without_its_field_or_its_read_is_found():
    # GradientParams without its Terms: the RNN-T and multi-blank losses' clamp and FastEmit are read by no kernel
    structs = dict(STRUCTS, GradientParams=[f for f in STRUCTS["GradientParams"] if f[1] != TERMS])
    assert _unread_cuda_options(structs, TEXT) == [
        ("RNN-T", "clamp"),
        ("RNN-T", "fastemit_lambda"),
        ("multi-blank RNN-T", "clamp"),
        ("multi-blank RNN-T", "fastemit_lambda"),
    ]
    # a field of Terms that no term function reads: the terms' omega
    terms_text = _uncommented(TERMS_HEADER)
    assert "o.omega" in terms_text
    assert terms_text in TEXT
    text = TEXT.replace(terms_text, terms_text.replace("o.omega", "0.0"))
    assert _unread_cuda_options(STRUCTS, text) == [("TDT", "omega")]
    # the Terms kept but not passed: tdt_gradient_kernel's
    name, body = _kernel(TEXT, "tdt_gradient_kernel")
    text = TEXT.replace(body, body.replace("p.terms", "Terms{}"))
    assert _unread_cuda_options(STRUCTS, text) == [("TDT", "clamp"), ("TDT", "fastemit_lambda"), ("TDT", "omega")]
