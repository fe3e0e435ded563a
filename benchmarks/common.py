"""What the benchmarks (tdt.py, multiblank.py, fused_vocab.py, fused_step.py and the integrations' step scripts)
share: CUDA-event timing with the peak extra memory, steps timed in interleaved rounds over batches, the GPU's
clock, NeMo's numba losses when importable, the copy-bandwidth floor and the fused step's GEMM floor, Protocol A's
batches and timed steps, CPU losses timed in alternating pairs, and the printed table."""

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def cuda_call(fn):
    """(ms, peak MB beyond what was allocated before) of one call of fn on the current stream (CUDA events)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1), max(0, torch.cuda.max_memory_allocated() - base) / 2**20


def cuda_ms(fn, warmup=3, reps=10):
    """Median ms of fn (CUDA events) and the peak memory over what was allocated before, MB."""
    for _ in range(warmup):
        fn()
    runs = [cuda_call(fn) for _ in range(reps)]
    return statistics.median(ms for ms, _ in runs), max(mb for _, mb in runs)


class Timing(NamedTuple):
    """One contender's figures from ``interleaved``."""

    ms: float | None  # the mean over the batches of its minimum time on each; None if it failed
    peak_mib: float  # the largest peak, MiB beyond what was allocated before the step
    batches: int  # the batches it was timed on
    first_s: float  # wall seconds of its first step (compilation, the allocator's first segments)
    failed: str | None  # why it stopped ("out of memory", or the exception), or None


def attempt(fn, *args):
    """(fn(*args), None), or (None, why it raised): out of memory, or another exception (a peer failing on this
    machine: numba's CUDA target and numpy, say)."""
    try:
        return fn(*args), None
    except torch.cuda.OutOfMemoryError:
        return None, "out of memory"
    except Exception as e:  # noqa: BLE001
        return None, f"failed: {type(e).__name__}: {str(e)[:100]}"


def _step_and_sync(step):
    """step(), waited for."""
    step()
    torch.cuda.synchronize()


def interleaved(batches, steps, rounds=3):
    """Each contender's step over ``batches``, in interleaved rounds. ``steps(batch)`` gives {name: step()} on a batch,
    which every contender shares. On each batch every contender's step runs once untimed (compilation, the
    allocator's segments for the new shapes), then ``rounds`` rounds in which each runs once in turn (cuda_call), the
    turn's first contender rotating, so that a GPU whose clock drifts or falls under a long run of GEMMs slows all
    alike; per batch a contender's minimum time and largest peak are kept. A contender whose step raises (out of
    memory, or a peer failing on this machine) is dropped from the rounds that follow, its reason kept. Returns
    {name: Timing}, in the order the contenders first came."""
    minima, peaks, first_s, failed = {}, {}, {}, {}
    for batch in batches:
        named = {name: step for name, step in steps(batch).items() if failed.get(name) is None}
        for name, step in named.items():
            start = time.perf_counter()
            _, failed[name] = attempt(_step_and_sync, step)
            first_s.setdefault(name, time.perf_counter() - start)
            minima.setdefault(name, [])
        best = {}
        for r in range(rounds):
            live = [name for name in named if failed[name] is None]
            turn = r % max(len(live), 1)
            for name in live[turn:] + live[:turn]:
                timed, failed[name] = attempt(cuda_call, named[name])
                if timed is not None:
                    best[name] = min(best.get(name, math.inf), timed[0])
                    peaks[name] = max(peaks.get(name, 0.0), timed[1])
        for name, ms in best.items():
            if failed[name] is None:
                minima[name].append(ms)
        del named, batch
    return {
        name: Timing(
            statistics.fmean(ms) if ms and failed[name] is None else None,
            peaks.get(name, 0.0),
            len(ms),
            first_s[name],
            failed[name],
        )
        for name, ms in minima.items()
    }


def padded_rows(rows):
    """The projection's rows as the fused step pads them (transducer.fused.tiles.projection)."""
    return rows + next(p for p in (-rows % m for m in (128, 8)) if p <= 0.03 * rows or p < 8)


def floor_gemms(N, J, rows, dtype):
    """The four GEMMs a fused step over N rows, J -> ``rows`` (padded as the step pads them), cannot avoid, in the
    GEMMs' ``dtype``: the logits H W^T in forward and again in backward's recompute, dH = G W and dW = G^T H.
    Returns a function running them on operands made once."""
    Vp = padded_rows(rows)
    g = torch.Generator(device="cuda").manual_seed(0)
    H = torch.randn(N, J, device="cuda", dtype=dtype, generator=g)
    W = torch.randn(Vp, J, device="cuda", dtype=dtype, generator=g)
    G = torch.randn(N, Vp, device="cuda", dtype=dtype, generator=g)

    def run():
        torch.mm(H, W.t())
        torch.mm(H, W.t())
        torch.mm(G, W)
        torch.mm(G.t(), H)

    return run


def gpu_clock():
    """The SM clock and temperature nvidia-smi reads now, as text ("SM 1980 MHz, 54 C"), or "?"."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return f"SM {out} C" if out else "?"
    except Exception:  # noqa: BLE001
        return "?"


def write_results(path, results):
    """Writes a step benchmark's ``results`` (a list of dicts) to ``path`` as JSON, with the device, torch's version
    and the SM clock now."""
    with open(path, "w") as f:
        json.dump(
            dict(device=torch.cuda.get_device_name(), torch=torch.__version__, clock=gpu_clock(), results=results),
            f,
            indent=1,
        )


def nemo_class(name):
    """NeMo's numba loss class ``name`` (TDTLossNumba, MultiblankRNNTLossNumba), or None with a printed
    reason."""
    try:
        if not hasattr(np, "row_stack"):  # NeMo 3.0's numba losses still call it
            np.row_stack = np.vstack
        from nemo.collections.asr.parts.numba import rnnt_loss

        return getattr(rnnt_loss, name)
    except Exception as e:  # noqa: BLE001
        print(f"NeMo {name}: not importable ({type(e).__name__}: {str(e)[:80]})")
        return None


def three_pass_floor_ms(rows):
    """The loss's floor: three passes over ``rows`` at the rate of one device-to-device copy of them."""
    copy = torch.empty_like(rows)
    t_copy, _ = cuda_ms(lambda: copy.copy_(rows))
    return 1.5 * t_copy  # a copy reads and writes: two passes


def protocol_a(label, make_contenders, modules, vocab=500, batches=4, width=512):
    """Protocol A's steps for each precision: batches of 30 utterances with LibriSpeech's (T, U), labels in
    [1, vocab), random encoder and predictor outputs of ``width``; ``make_contenders(enc, pred, y, T, U)``
    gives {name: a function returning the loss}; ``modules``' gradients are cleared after each step.
    3 warm-up batches, then ``batches`` timed ones, each timed step after an untimed one on the same batch
    (a contender's first step on new shapes pays the allocator's new segments). Returns rows (case, name,
    mean ms, peak MB)."""
    rows = np.loadtxt(HERE / "data" / "librispeech_train_clean_100_TU.csv", delimiter=",", skiprows=1, dtype=np.int64)
    out = []
    for prec in ("fp32", "bf16"):
        dtype = torch.float32 if prec == "fp32" else torch.bfloat16
        torch.manual_seed(0)
        recs = {}
        for i in range(3 + batches):
            r = rows[i * 30 : (i + 1) * 30]
            T, U = torch.tensor(r[:, 0], device="cuda"), torch.tensor(r[:, 1], device="cuda")
            y = torch.randint(1, vocab, (30, int(U.max())), device="cuda")
            enc = torch.randn(30, int(T.max()), width, device="cuda", dtype=dtype, requires_grad=True)
            pred = torch.randn(30, int(U.max()) + 1, width, device="cuda", dtype=dtype, requires_grad=True)
            for name, loss_fn in make_contenders(enc, pred, y, T, U).items():

                def step():
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=prec == "bf16"):
                        loss = loss_fn()
                    loss.backward()
                    enc.grad = pred.grad = None
                    for m in modules:
                        m.zero_grad(set_to_none=True)

                ms, _ = cuda_ms(step, warmup=1, reps=1)  # resets the peak counter before the timed step
                peak = torch.cuda.max_memory_allocated() / 2**20
                if i >= 3:
                    recs.setdefault(name, []).append((ms, peak))
        for name, v in recs.items():
            out.append(
                (f"Protocol A step {prec} ({label})", name, statistics.fmean(m for m, _ in v), max(p for _, p in v))
            )
    return out


def cpu_pairs(case, losses, reps=11):
    """CPU forward and backward of each loss in ``losses`` = [(name, logits, fn(logits) -> loss)], the steps
    alternating (a loaded machine slows both alike): rows (case, name, median ms, None), and the median of
    the per-pair ratios of the second to the first, printed."""
    steps = []
    for _, x, fn in losses:

        def step(x=x, fn=fn):
            x.grad = None
            t0 = time.perf_counter()
            fn(x).backward()
            return (time.perf_counter() - t0) * 1e3

        step()
        steps.append(step)
    times = [[] for _ in steps]
    for _ in range(reps):
        for k, step in enumerate(steps):
            times[k].append(step())
    ratio = statistics.median(b / a for a, b in zip(times[0], times[1]))
    print(f"  CPU {losses[1][0]} / {losses[0][0]}: {ratio:.2f}x (median of {reps} alternating pairs)")
    return [(case, name, statistics.median(t), None) for (name, _, _), t in zip(losses, times)]


def main(description, loss_alone, protocol_a_rows, cpu):
    """The scripts' command line (``--cpu-only``) and their table."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-only", action="store_true")
    a = p.parse_args()
    results = []
    if torch.cuda.is_available() and not a.cpu_only:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        results += loss_alone()
        results += protocol_a_rows()
    results += cpu()
    print(f"{'case':<52} {'contender':<42} {'ms':>9} {'MB':>9}")
    for case, name, ms, mb in results:
        print(f"{case:<52} {name:<42} {ms:9.2f} {'' if mb is None else f'{mb:9.0f}'}")
