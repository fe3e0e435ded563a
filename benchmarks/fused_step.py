#!/usr/bin/env python
"""The fused joiner + loss step against its floor, the four GEMMs it cannot avoid, and NeMo's Flash RNN-T.

    python benchmarks/fused_step.py                       # every case
    python benchmarks/fused_step.py --cases protocol-a     # some of them (protocol-a, flash, parakeet-tdt, wide-rnnt,
                                                          # wide-multiblank)
    python benchmarks/fused_step.py --profile             # and the kernels of one step of ours, by group
    python benchmarks/fused_step.py --host                # and the host's part of our steps against the GPU's
    python benchmarks/fused_step.py --gaps                # and where the GPU waits in our steps
    python benchmarks/fused_step.py --calls               # and the host time of each call of our steps
    python benchmarks/fused_step.py --json F.json         # the figures as json too (bench.py's section F)
    python benchmarks/fused_step.py --changing-shapes     # shapes that change every step, as in training

NeMo's Flash RNN-T joins where it imports (its folder first on PYTHONPATH, in a process of its own: it shadows
NeMo's numba losses; benchmarks/README.md).

The floor of a fused step over N = sum_b T_b (U_b + 1) rows, J -> V: the logits GEMM H W^T in forward and again in
backward's recompute, dH = G W and dW = G^T H, each timed alone with torch at the sizes the step runs (V padded as
the step pads it, the GEMMs' dtype; common.floor_gemms). Where the step can run on the Hopper kernels
(transducer/fused/hopper_tiles.py: the default there), it is timed there and on the other path (TRANSDUCER_HOPPER=0), and
its first step's time (the kernels' compilation) is printed; --profile then profiles a step on each path, its kernels
summed by what they do (KERNEL_GROUPS).
Floor and steps are timed in interleaved rounds on each batch (common.interleaved), and each one's minimum is kept:
a GPU that heats up (an H100's SM clock falls from about 1.9 GHz to under 1 GHz after a long run of GEMMs) slows all
alike, and the clock is printed; the figure is the mean over the batches of those minima. A step is forward under
the precision's autocast and backward, on new tensors of the batch's shape; peak is the memory allocated during it
beyond its inputs.

--changing-shapes measures what a training run sees, where every step has new shapes: for a case and precision,
each contender (ours on cuBLAS, ours on the Hopper kernels where they run, Flash RNN-T where importable) takes --steps of
the case's batches in order, none repeated (protocol-a: consecutive LibriSpeech batches of 30; flash: random
lengths), each contender the next --steps batches (shapes no contender before it met: cuBLAS, Triton and the
allocator keep what a shape cost them for the whole process), one after another from an empty allocator cache, and on each batch runs one step on the new shapes, then
--repeats more on the same shapes, whose minimum is the repeated-shape figure. It prints the mean new-shape step
after the first --skip steps, the mean repeated-shape step over the same batches, their ratio (what new shapes
cost: the allocator's blocks, a kernel compiled or tuned per shape), and the first three steps' times (compilation
and the allocator's first segments, of whatever the process has not yet run). Each time is one step's CUDA-event
time (common.cuda_call), which takes in the host's time where the GPU waits for it. A contender is stopped after
--time-limit seconds (Flash RNN-T's Triton kernels compile for new shapes) and the steps it ran are given.
Parakeet-TDT's and the wide joints' batches all have one shape: the mode takes protocol-a and flash.

Cases (bf16: autocast, the encoder and predictor outputs in bf16 or fp32; fp32: no autocast):
    protocol-a     LibriSpeech train-clean-100 batches of 30 (benchmarks/data), 512 -> 500, tanh
    flash          Flash RNN-T's own benchmark shape: B 32, T <= 400, U <= 128, 640 -> 1024, tanh
    parakeet-tdt   Parakeet-TDT-0.6B's joint: B 16, T 375, U 100, 640 -> 8193 + 5 durations, relu
    wide-rnnt      the same joint for RNN-T (no durations): 640 -> 8193, relu (the Hopper kernels' wide tiles)
    wide-multiblank  the same joint for the multi-blank loss: big blanks of durations 2, 4, 8 before the blank
"""

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

# common first: it puts the repository root on sys.path
from common import attempt, cuda_call, floor_gemms, gpu_clock, interleaved

from transducer import fused_joiner_loss
from transducer.fused.hopper_tiles import use_hopper
from transducer.lattices import kind_of
from transducer.options import LossOptions

HERE = Path(__file__).resolve().parent
ROUNDS = 5


class NemoLikeJoint(torch.nn.Module):
    """What Flash RNN-T reads of NeMo's RNNTJoint: identity projections, joint_net[-1] the output Linear."""

    def __init__(self, linear, activation):
        super().__init__()
        self.joint_net = torch.nn.ModuleList([linear])
        self.activation, self.dropout, self.masking_prob, self.num_extra_outputs = activation, 0.0, 0.0, 0
        self.num_classes_with_blank, self.log_softmax, self.temperature = linear.out_features, False, 1.0

    def project_encoder(self, x):
        return x

    def project_prednet(self, x):
        return x

    def is_adapter_available(self):
        return False


def flash_loss():
    """NeMo's Flash RNN-T (benchmarks/README.md, Peers), or None."""
    try:
        from nemo.collections.asr.losses.flash_rnnt import FlashRNNTLoss

        return FlashRNNTLoss
    except Exception as e:  # noqa: BLE001
        print(f"Flash RNN-T: not importable ({type(e).__name__}: {str(e)[:100]})")
        return None


def batches(case, count, seed=0):
    """(T, U) lists of ``count`` batches of the case."""
    rng = np.random.default_rng(seed)
    if case == "protocol-a":
        rows = np.loadtxt(
            HERE / "data" / "librispeech_train_clean_100_TU.csv", delimiter=",", skiprows=1, dtype=np.int64
        )
        return [(rows[i * 30 : (i + 1) * 30, 0], rows[i * 30 : (i + 1) * 30, 1]) for i in range(count)]
    if case == "flash":
        return [(rng.integers(200, 401, 32), rng.integers(64, 129, 32)) for _ in range(count)]
    return [(np.full(16, 375), np.full(16, 100)) for _ in range(count)]


CASES = {  # J, token columns, durations, activation, precisions
    "protocol-a": (512, 500, None, "tanh", ("bf16", "bf16-fp32in", "fp32")),
    "flash": (640, 1024, None, "tanh", ("bf16", "fp32")),
    "parakeet-tdt": (640, 8193, [0, 1, 2, 3, 4], "relu", ("bf16",)),
    "wide-rnnt": (640, 8193, None, "relu", ("bf16",)),
    "wide-multiblank": (640, 8193, None, "relu", ("bf16",)),
}
BIG_BLANKS = {"wide-multiblank": [2, 4, 8]}  # the multi-blank cases' big blanks, in the columns before the blank


FLOOR, DEFAULT, HOPPER, FLASH = "floor (4 GEMMs)", "ours fused", "ours fused, Hopper kernels", "Flash RNN-T"


def gemm_dtype(prec):
    """The GEMMs' dtype at a precision: bf16 under autocast, else fp32."""
    return torch.float32 if prec == "fp32" else torch.bfloat16


def contenders(case, prec, flash):
    """steps(batch) for a batch (T, U) of the case: {name: step()} of ours on cuBLAS, on the Hopper kernels where
    they run (use_hopper) and Flash RNN-T's where ``flash`` is its loss class and the case is RNN-T's. Each
    batch's tensors are made once, shared by the steps."""
    J, V, durations, activation, _ = CASES[case]
    big_blanks = BIG_BLANKS.get(case, [])
    in_dtype = torch.float32 if prec != "bf16" else torch.bfloat16
    autocast = prec != "fp32"
    blank = V - 1  # Flash RNN-T's blank is the last token column
    torch.manual_seed(0)
    linear = torch.nn.Linear(J, V + len(durations or []), device="cuda")
    joint = NemoLikeJoint(linear, activation)
    flash_mod = flash(blank=blank) if flash and not durations and not big_blanks else None
    options = (
        dict(durations=durations, sigma=0.05)
        if durations
        else dict(big_blank_durations=big_blanks, sigma=0.05)
        if big_blanks
        else {}
    )
    os.environ["TRANSDUCER_HOPPER"] = "1"
    hopper = use_hopper(
        kind_of(LossOptions(durations=tuple(durations or ()), big_blank_durations=tuple(big_blanks))),
        gemm_dtype(prec),
        torch.device("cuda"),
        J,
    )
    os.environ["TRANSDUCER_HOPPER"] = "0"

    def steps(batch):
        T, U = batch
        B = len(T)
        Tt, Ut = torch.tensor(T, device="cuda"), torch.tensor(U, device="cuda")
        y = torch.randint(0, V - 1 - len(big_blanks), (B, int(U.max())), device="cuda")  # no blank, no big blank
        enc = torch.randn(B, int(T.max()), J, device="cuda", dtype=in_dtype, requires_grad=True)
        pred = torch.randn(B, int(U.max()) + 1, J, device="cuda", dtype=in_dtype, requires_grad=True)

        def clear():
            enc.grad = pred.grad = linear.weight.grad = linear.bias.grad = None

        def ours(hopper_path, marks=None):
            clear()
            os.environ["TRANSDUCER_HOPPER"] = hopper_path
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = fused_joiner_loss(
                        enc,
                        pred,
                        linear.weight,
                        linear.bias,
                        y,
                        Tt,
                        Ut,
                        activation=activation,
                        blank=blank,
                        reduction="sum",
                        **options,
                    )
                if marks is not None:
                    marks.append(time.perf_counter())  # the forward call has returned
                loss.backward()
            finally:
                os.environ["TRANSDUCER_HOPPER"] = "0"
            clear()

        def flash_step():
            clear()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = flash_mod(joint, enc, pred, y, Tt, Ut).sum()
            loss.backward()
            clear()

        out = {DEFAULT: functools.partial(ours, "0")}
        if hopper:
            out[HOPPER] = functools.partial(ours, "1")
        if flash_mod is not None:
            out[FLASH] = flash_step
        return out

    return steps


def host_split(case, prec, name, step, count=20):
    """--host: the host's part of one of our steps (the batch's first) against the GPU's, printed: the host time until
    the loss call returns and until backward returns, and the step's wall time (CUDA-synchronised), each the
    minimum over ``count`` steps, and the kernels' time a step (torch.profiler over 3 steps, their sum)."""
    step()
    forward, backward, wall = [], [], []
    for _ in range(count):
        marks = []
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(marks=marks)
        end = time.perf_counter()
        torch.cuda.synchronize()
        forward.append(marks[0] - start)
        backward.append(end - marks[0])
        wall.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 3 / 1e3
    print(
        f"--- {case} {prec}, {name}: host until the loss returns {min(forward) * 1e3:.2f} ms, until backward "
        f"returns {min(backward) * 1e3:.2f} more; the step {min(wall) * 1e3:.2f} ms; kernels {busy:.2f} ms a step "
        f"({len(kernels) / 3:.0f} of them)"
    )


# --calls: the functions timed, by module: the stages (both backends'), the launch path, the public call's work, the
# fused op's eager forward and backward (its autograd Function's) and their parts, the tile paths, the Hopper
# kernels' entries, torch's GEMMs and autograd's backward
CALLS = {
    "transducer.cuda.stages": (
        "layout",
        "row_labels",
        "row_log_probs",
        "row_coefficients",
        "tdt_row_log_probs",
        "tdt_row_coefficients",
        "alpha_beta",
        "pack_forward",
        "pack_backward_add",
    ),
    "transducer.cpu.stages": ("layout", "alpha_beta", "pack_forward", "pack_backward_add"),
    "ops.cuda": ("launch",),
    "transducer.fused.loss": ("_fused_joiner_loss",),
    "transducer.fused.op": ("fused.eager.forward", "fused.eager.backward", "_backward", "_add_product", "tile_path"),
    "transducer.fused.tiles": ("hidden", "hidden_buffer"),
    "transducer.fused.cublas_tiles": ("CublasTiles.forward", "CublasTiles._gradient_tile", "hidden"),
    "transducer.fused.hopper_tiles": ("HopperTiles.forward", "HopperTiles._gradient_tile", "hidden"),
    "transducer.hopper": ("projection", "statistics_tile", "gradient_tile"),
    "torch": ("mm", "addmm"),
    "torch.Tensor": ("backward",),
}


class CallTimers:
    """While entered, each function of CALLS (that exists) wrapped in a time.perf_counter_ns timer: ``totals`` and
    ``counts`` by "module.name" (inclusive times, from every thread: autograd's runs the backward)."""

    def __init__(self):
        self.totals, self.counts, self._undo = {}, {}, []

    def __enter__(self):
        import importlib

        for module_name, names in CALLS.items():
            try:
                module = importlib.import_module(module_name) if module_name != "torch.Tensor" else torch.Tensor
            except ImportError:
                continue
            for name in names:
                *owners, attr = name.split(".")
                holder = functools.reduce(getattr, owners, module)
                original = holder.__dict__.get(attr) if isinstance(holder, type) else getattr(holder, attr, None)
                if original is None or not callable(original):
                    continue
                self._undo.append((holder, attr, original))
                setattr(holder, attr, self._timed(f"{module_name.removeprefix('transducer.')}.{name}", original))
        return self

    def _timed(self, label, fn):
        totals, counts = self.totals, self.counts

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0) + time.perf_counter_ns() - start
                counts[label] = counts.get(label, 0) + 1

        return timed

    def __exit__(self, *exc):
        for holder, attr, original in reversed(self._undo):
            setattr(holder, attr, original)
        self._undo.clear()


def host_calls(case, prec, name, step, count=20, synchronize=torch.cuda.synchronize):
    """--calls: each timed call of one of our steps (the batch's first), printed: its host time a step (inclusive, the
    mean over ``count`` synchronised steps), its calls a step and its time a call; the rows as a list of dicts."""
    step()
    synchronize()
    with CallTimers() as timers:
        for _ in range(count):
            step()
            synchronize()
    rows = sorted(
        (
            dict(
                call=k,
                us_a_step=t / count / 1e3,
                calls_a_step=timers.counts[k] / count,
                us_a_call=t / timers.counts[k] / 1e3,
            )
            for k, t in timers.totals.items()
        ),
        key=lambda r: -r["us_a_step"],
    )
    print(f"--- {case} {prec}, {name}: the host time of each call, the mean of {count} steps")
    for r in rows:
        print(
            f"  {r['call']:<40} {r['us_a_step']:9.1f} us a step {r['calls_a_step']:6.1f} calls {r['us_a_call']:9.1f} us a call"
        )
    return rows


def step_gaps(work):
    """(span, gaps, count) of a step from ``work``, its GPU events (start, end, name) in order of start, the first
    named spin_kernel marking the step's call: the span from the marker's end to the last event's, the gaps (idle
    time, the name of the event that ended before it or "the step's call", the name of the one after) where no
    event ran, and the count of events after the marker."""
    marker = next((i for i, w in enumerate(work) if "spin_kernel" in w[2]), None)
    if marker is None:
        raise RuntimeError("--gaps: the profile holds no spin_kernel (torch.cuda._sleep) to mark the step's call")
    start = end = work[marker][1]
    gaps, before = [], "the step's call"
    for s, e, n in work[marker + 1 :]:
        if s > end:
            gaps.append((s - end, before, n))
        if e > end:
            end, before = e, n
    return end - start, gaps, len(work) - marker - 1


def idle_gaps(case, prec, name, step, count=5, shown=8):
    """--gaps: where the GPU waits in one of our steps (torch.profiler over CUDA's activity, a step synchronised
    before and after): from the step's call (the end of a spin kernel launched just before it) to its first kernel,
    between its kernels and memcopies (the longest gaps shown with the work either side), and their sum against the
    step's span; the step of the median span of ``count``."""
    step()
    spans = []
    for _ in range(count):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.cuda._sleep(1)  # spin_kernel: where the step's call begins on the GPU's clock
            step()
            torch.cuda.synchronize()
        work = sorted(
            (e.time_range.start, e.time_range.end, e.name)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        )
        spans.append(step_gaps(work))
    span, gaps, launches = sorted(spans, key=lambda x: x[0])[count // 2]
    idle = sum(g for g, _, _ in gaps)
    first = gaps[0][0] if gaps and gaps[0][1] == "the step's call" else 0.0
    print(
        f"--- {case} {prec}, {name}: a step of {span / 1e3:.2f} ms ({launches} kernels and copies), the GPU idle "
        f"{idle / 1e3:.2f} ms of it: {first / 1e3:.2f} before the first kernel, {(idle - first) / 1e3:.2f} in "
        f"{len(gaps) - (first > 0)} gaps between"
    )
    for g, a, b in sorted(gaps, reverse=True)[:shown]:
        print(f"  {g:7.1f} us  after {a[:60]:<60}  before {b[:60]}")
    return dict(span_ms=span / 1e3, idle_ms=idle / 1e3, first_ms=first / 1e3, gaps=len(gaps))


# --profile's groups of a step's kernels: (group, the names' substrings), the first group a name matches
KERNEL_GROUPS = (
    ("the statistics and gradient kernels (transducer.hopper)", ("transducerhopper",)),
    ("pack_forward (the hidden, forward and again in backward)", ("pack_forward",)),
    ("pack's backward (act' and the sums over u and t)", ("pack_grad",)),
    ("the row kernels (labels, log-probs and coefficients of rows)", ("row_labels", "row_log_probs", "row_coeff")),
    ("the log-probs stage (the logits' den)", ("log_probs_kernel",)),
    ("the gradient stage (the logits' gradient)", ("gradient_kernel",)),
    ("alpha and beta (the lattice's walks)", ("alpha_beta", "walk_kernel")),
    ("cuBLAS's GEMMs (with split-K's reductions)", ("nvjet", "gemm", "splitkreduce", "cublas", "xmma")),
)
OTHER_KERNELS = "the rest (fills, casts, copies, the layout)"


def kernel_group(name):
    """--profile's group of a kernel of this name (KERNEL_GROUPS; OTHER_KERNELS where none matches)."""
    low = name.lower()
    return next((group for group, keys in KERNEL_GROUPS if any(k in low for k in keys)), OTHER_KERNELS)


def grouped_kernels(events):
    """(group, ms, launches) of ``events``, (kernel name, us, launches) triples, summed by kernel_group, in
    KERNEL_GROUPS's order then the rest; groups without a kernel left out."""
    ms, launches = {}, {}
    for name, us, count in events:
        group = kernel_group(name)
        ms[group] = ms.get(group, 0.0) + us / 1e3
        launches[group] = launches.get(group, 0) + count
    order = [group for group, _ in KERNEL_GROUPS] + [OTHER_KERNELS]
    return [(group, ms[group], launches[group]) for group in order if group in ms]


def profile_step(case, prec, name, step, rows, floor_ms):
    """--profile: the kernels of one of our steps (torch.profiler), printed by group (grouped_kernels) against the
    floor, then the longest kernels by name; the groups as a list of dicts."""
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [(e.name, e.device_time, 1) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    groups = grouped_kernels(events)
    total = sum(ms for _, ms, _ in groups)
    print(f"--- {case} {prec}, {name}: the kernels of one step, N = {rows} rows; floor {floor_ms:.2f} ms")
    for group, ms, count in groups:
        print(f"  {group:<62} {ms:7.3f} ms {count:5d} launches")
    print(
        f"  {'all kernels':<62} {total:7.3f} ms {sum(c for _, _, c in groups):5d} launches ({total / floor_ms:.2f}x floor)"
    )
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    return [dict(group=group, ms=ms, launches=count) for group, ms, count in groups]


def run_case(case, prec, count, profile, flash, host=False, calls=False, gaps=False):
    """The case's steps against their floor on ``count`` batches, printed; the figures as a dict."""
    J, V, durations, _, _ = CASES[case]
    rows = V + len(durations or [])
    steps = contenders(case, prec, flash)

    def with_floor(batch):
        T, U = batch
        return {FLOOR: floor_gemms(int((T * (U + 1)).sum()), J, rows, gemm_dtype(prec)), **steps(batch)}

    shapes = batches(case, count)
    timings = interleaved(shapes, with_floor, ROUNDS)
    if HOPPER in timings:
        print(
            f"{case} {prec}: the first step on the Hopper kernels took {timings[HOPPER].first_s:.1f} s (they compile)"
        )
    if profile:
        T, U = shapes[0]
        for name in (DEFAULT, HOPPER):
            if name in timings:
                profile_step(case, prec, name, steps(shapes[0])[name], int((T * (U + 1)).sum()), timings[FLOOR].ms)
    if host:
        for name in (DEFAULT, HOPPER):
            if name in timings:
                host_split(case, prec, name, steps(shapes[0])[name])
    if calls:
        for name in (DEFAULT, HOPPER):
            if name in timings:
                host_calls(case, prec, name, steps(shapes[0])[name])
    idle = {}
    if gaps:
        for name in (DEFAULT, HOPPER):
            if name in timings:
                idle[name] = idle_gaps(case, prec, name, steps(shapes[0])[name])
    floor = timings[FLOOR].ms
    rows_avg = sum(int((T * (U + 1)).sum()) for T, U in shapes) // count
    clock = gpu_clock()
    print(
        f"\n{case} {prec} ({count} batches, {rows_avg} rows a batch on average; the mean over the batches of the "
        f"minimum of {ROUNDS} interleaved rounds; clock {clock})"
    )
    for name, t in timings.items():
        if t.failed:
            print(f"  {name:<36} {t.failed}")
        else:
            print(f"  {name:<36} {t.ms:8.2f} ms  {t.ms / floor:5.2f}x floor  {t.peak_mib:8.0f} MB")
    return dict(
        case=case,
        precision=prec,
        batches=count,
        rows=rows_avg,
        clock=clock,
        J=J,
        V=V,
        durations=durations,
        contenders={name: dict(time_ms=t.ms, peak_mb=t.peak_mib) for name, t in timings.items() if not t.failed},
        failed={name: t.failed for name, t in timings.items() if t.failed},
        **({"gaps": idle} if idle else {}),
    )


def run_changing_shapes(case, prec, count, skip, repeats, time_limit, flash):
    """--changing-shapes (the module docstring) for a case and precision: printed; the figures as a dict."""
    steps = contenders(case, prec, flash)
    names = list(steps(batches(case, 1)[0]))
    every = batches(case, count * len(names))

    def new_and_repeated(step):
        new_ms = cuda_call(step)[0]
        return new_ms, min(cuda_call(step)[0] for _ in range(repeats))

    out = {}
    for k, name in enumerate(names):
        shapes = every[k * count : (k + 1) * count]  # batches of its own: no shape another contender met first
        torch.cuda.empty_cache()
        new, repeated, failed = [], [], None
        start = time.perf_counter()
        for batch in shapes:
            if time.perf_counter() - start > time_limit:
                break
            timed, failed = attempt(new_and_repeated, steps(batch)[name])
            if failed:
                break
            new.append(timed[0])
            repeated.append(timed[1])
        mean_new = statistics.fmean(new[skip:]) if len(new) > skip else None
        mean_repeated = statistics.fmean(repeated[skip:]) if len(repeated) > skip else None
        out[name] = dict(
            new_shape_ms=mean_new,
            repeated_shape_ms=mean_repeated,
            ratio=mean_new / mean_repeated if mean_new is not None else None,
            first_ms=new[:3],
            steps=len(new),
            seconds=time.perf_counter() - start,
            failed=failed,
        )
    clock = gpu_clock()
    print(
        f"\n{case} {prec}: {count} batches of new shapes, one step each then {repeats} on the same shapes; means "
        f"after the first {skip} steps (clock {clock})"
    )
    print(f"  {'contender':<28} {'new shapes':>10} {'repeated':>10} {'ratio':>6}  {'first 3 steps (ms)':<26} steps")
    for name, r in out.items():
        means = (
            f"{r['new_shape_ms']:7.2f} ms {r['repeated_shape_ms']:7.2f} ms {r['ratio']:5.2f}x"
            if r["ratio"] is not None
            else f"{'-':>10} {'-':>10} {'-':>6}"
        )
        first = " ".join(f"{ms:.1f}" for ms in r["first_ms"])
        ran = f"{r['steps']} in {r['seconds']:.0f} s" + (f" ({r['failed']})" if r["failed"] else "")
        print(f"  {name:<28} {means}  {first:<26} {ran}")
    return dict(
        case=case,
        precision=prec,
        batches=count,
        skip=skip,
        repeats=repeats,
        time_limit_s=time_limit,
        clock=clock,
        contenders=out,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cases",
        nargs="*",
        choices=list(CASES),
        help="default: every case; with --changing-shapes, protocol-a and flash",
    )
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--host", action="store_true", help="and the host's part of our steps against the GPU's")
    p.add_argument("--calls", action="store_true", help="and the host time of each call of our steps")
    p.add_argument("--gaps", action="store_true", help="and where the GPU waits in our steps")
    p.add_argument("--no-flash", action="store_true")
    p.add_argument("--precisions", nargs="*", default=None, help="of each case's: bf16, bf16-fp32in, fp32")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--changing-shapes", action="store_true", help="shapes that change every step (the docstring)")
    p.add_argument("--steps", type=int, default=40, help="--changing-shapes: batches, one step each on new shapes")
    p.add_argument("--skip", type=int, default=8, help="--changing-shapes: first steps left out of the means")
    p.add_argument("--repeats", type=int, default=3, help="--changing-shapes: steps repeated on a batch's shapes")
    p.add_argument("--time-limit", type=float, default=60.0, help="--changing-shapes: seconds a contender runs")
    a = p.parse_args()
    if a.changing_shapes and {"parakeet-tdt", "wide-rnnt", "wide-multiblank"} & set(a.cases or []):
        p.error("--changing-shapes: parakeet-tdt's and the wide joints' batches all have one shape")
    cases = a.cases or (["protocol-a", "flash"] if a.changing_shapes else list(CASES))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, clock {gpu_clock()}")
    flash = None if a.no_flash else flash_loss()
    out = []
    for case in cases:
        for prec in CASES[case][4]:
            if a.precisions and prec not in a.precisions:
                continue
            if a.changing_shapes:
                out.append(run_changing_shapes(case, prec, a.steps, a.skip, a.repeats, a.time_limit, flash))
            else:
                out.append(run_case(case, prec, a.batches, a.profile, flash, a.host, a.calls, a.gaps))
    if a.json:
        key = "changing_shapes" if a.changing_shapes else "cases"
        a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), key: out}, indent=1))


if __name__ == "__main__":
    main()
