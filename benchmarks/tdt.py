#!/usr/bin/env python
"""TDT loss benchmarks: the loss alone against NeMo's TDTLossNumba and the bandwidth floor, a Protocol A
training step (its batches and shapes; 3 warm-up and 4 timed batches where bench.py times 20; each timed step
follows an untimed one on the same batch) against NeMo and this library's RNN-T step, unfused and fused, and
the CPU loss against the RNN-T CPU loss. Prints one table; benchmarks/RESULTS.md keeps the figures.

    python benchmarks/tdt.py            # CUDA (NeMo's loss when importable: benchmarks/README.md)
    python benchmarks/tdt.py --cpu-only
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import transducer  # noqa: E402

DURATIONS = [0, 1, 2, 3, 4]


def cuda_ms(fn, warmup=3, reps=10):
    """Median ms of fn (CUDA events) and the peak memory over what was allocated before, MB."""
    for _ in range(warmup):
        fn()
    times, extra = [], 0
    for _ in range(reps):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
        extra = max(extra, torch.cuda.max_memory_allocated() - base)
    return statistics.median(times), extra / 2**20


def nemo_loss():
    try:
        if not hasattr(np, "row_stack"):
            np.row_stack = np.vstack
        from nemo.collections.asr.parts.numba.rnnt_loss import TDTLossNumba
        return TDTLossNumba
    except Exception as e:  # noqa: BLE001
        print(f"NeMo TDT: not importable ({type(e).__name__}: {str(e)[:80]})")
        return None


def loss_alone(B=16, T=400, U=100, V=1024):
    gen = torch.Generator(device="cuda").manual_seed(0)
    D = len(DURATIONS)
    Ts, Us = torch.full((B,), T, device="cuda"), torch.full((B,), U, device="cuda")
    y = torch.randint(1, V, (B, U), device="cuda", generator=gen)
    padded = torch.randn(B, T, U + 1, V + D, device="cuda", generator=gen)
    rows = padded.view(-1, V + D)
    copy = torch.empty_like(rows)
    t_copy, _ = cuda_ms(lambda: copy.copy_(rows))
    floor = 3 * rows.numel() * 4 / (2 * rows.numel() * 4 / (t_copy * 1e-3)) * 1e3
    del copy
    case = f"TDT loss alone ({B},{T},{U},{V}+{D}) fp32"
    out = [(case, "bandwidth floor (3 passes)", floor, None)]
    for name, x in (("ours compact", rows), ("ours padded", padded)):
        x = x.detach().requires_grad_()

        def step():  # the gradient freed after the step: the extra memory counts it
            transducer.tdt_loss(x, y, Ts, Us, DURATIONS, sigma=0.05, reduction="sum").backward()
            x.grad = None
        ms, mb = cuda_ms(step)
        out.append((case, name, ms, mb))
    TDTLossNumba = nemo_loss()
    if TDTLossNumba is not None:
        fn = TDTLossNumba(blank=0, durations=DURATIONS, reduction="sum", sigma=0.05)
        x = padded.detach().requires_grad_()

        def step():
            fn(acts=x, labels=y, act_lens=Ts, label_lens=Us).backward()
            x.grad = None
        ms, mb = cuda_ms(step)
        out.append((case, "NeMo TDTLossNumba", ms, mb))
    print(f"  (gradient size {rows.numel() * 4 / 2**20:.0f} MB)")
    return out


def protocol_a(batches=4, width=512, vocab=500):
    rows = np.loadtxt(HERE / "data" / "librispeech_train_clean_100_TU.csv", delimiter=",", skiprows=1,
                      dtype=np.int64)
    out = []
    TDTLossNumba = nemo_loss()
    for prec in ("fp32", "bf16"):
        dtype = torch.float32 if prec == "fp32" else torch.bfloat16
        torch.manual_seed(0)
        joiner_tdt = torch.nn.Linear(width, vocab + len(DURATIONS)).cuda()
        joiner_rnnt = torch.nn.Linear(width, vocab).cuda()
        # the joint padded to a multiple of 8 columns (cuBLAS's fast kernels want 16-byte rows), the heads
        # read as views: tokens [0, vocab), durations the last D columns
        joiner_tdt8 = torch.nn.Linear(width, -(-(vocab + len(DURATIONS)) // 8) * 8).cuda()
        recs = {}
        for i in range(3 + batches):
            r = rows[i * 30:(i + 1) * 30]
            T, U = torch.tensor(r[:, 0], device="cuda"), torch.tensor(r[:, 1], device="cuda")
            y = torch.randint(1, vocab, (30, int(U.max())), device="cuda")
            enc = torch.randn(30, int(T.max()), width, device="cuda", dtype=dtype, requires_grad=True)
            pred = torch.randn(30, int(U.max()) + 1, width, device="cuda", dtype=dtype, requires_grad=True)
            contenders = {
                "ours RNN-T compact (scale)": lambda: transducer.transducer_loss(
                    joiner_rnnt(torch.tanh(transducer.pack(enc, pred, T, U))), y, T, U, reduction="sum"),
                "ours TDT compact": lambda: transducer.tdt_loss(
                    joiner_tdt(torch.tanh(transducer.pack(enc, pred, T, U))), y, T, U, DURATIONS, sigma=0.05,
                    reduction="sum"),
                "ours TDT compact, joint padded to x8 (views)": lambda: (lambda z: transducer.tdt_loss(
                    z[:, :vocab], y, T, U, DURATIONS, sigma=0.05, reduction="sum",
                    duration_logits=z[:, -len(DURATIONS):]))(joiner_tdt8(torch.tanh(transducer.pack(enc, pred, T, U)))),
                "ours RNN-T fused (scale)": lambda: transducer.fused_joiner_loss(
                    enc, pred, joiner_rnnt.weight, joiner_rnnt.bias, y, T, U, reduction="sum"),
                "ours TDT fused": lambda: transducer.fused_joiner_loss(
                    enc, pred, joiner_tdt.weight, joiner_tdt.bias, y, T, U, durations=DURATIONS, sigma=0.05,
                    reduction="sum"),
            }
            if TDTLossNumba is not None:
                nemo = TDTLossNumba(blank=0, durations=DURATIONS, reduction="sum", sigma=0.05)
                contenders["NeMo TDTLossNumba (padded, fp32 logits)"] = lambda: nemo(
                    acts=joiner_tdt(torch.tanh(enc[:, :, None] + pred[:, None])).float(), labels=y, act_lens=T,
                    label_lens=U)
            for name, loss_fn in contenders.items():
                def step():
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=prec == "bf16"):
                        loss = loss_fn()
                    loss.backward()
                    enc.grad = pred.grad = None
                    joiner_tdt.zero_grad(set_to_none=True)
                    joiner_rnnt.zero_grad(set_to_none=True)
                    joiner_tdt8.zero_grad(set_to_none=True)
                # one untimed step on the batch first: a contender's first step on new shapes pays the
                # allocator's new segments (synchronous cudaMalloc), which made single steps vary 2x
                ms, _ = cuda_ms(step, warmup=1, reps=1)  # resets the peak counter before the timed step
                peak = torch.cuda.max_memory_allocated() / 2**20
                if i >= 3:
                    recs.setdefault(name, []).append((ms, peak))
            del enc, pred
        for name, v in recs.items():
            out.append((f"Protocol A step {prec} (30 utts, 512 -> 500 (+5))", name,
                        statistics.fmean(m for m, _ in v), max(p for _, p in v)))
    return out


def cpu(B=8, T=100, U=30, V=256, reps=11):
    """The CPU losses, fwd + bwd, RNN-T and TDT steps alternating (a loaded machine slows both alike): the
    median of each and the median of the per-pair ratios."""
    gen = torch.Generator().manual_seed(0)
    Ts, Us = torch.full((B,), T), torch.full((B,), U)
    y = torch.randint(1, V, (B, U), generator=gen)
    steps = []
    for width, fn in ((V, lambda x: transducer.transducer_loss(x, y, Ts, Us, reduction="sum")),
                      (V + len(DURATIONS), lambda x: transducer.tdt_loss(x, y, Ts, Us, DURATIONS, reduction="sum"))):
        x = torch.randn(B * T * (U + 1), width, generator=gen).requires_grad_()

        def step(x=x, fn=fn):
            x.grad = None
            t0 = time.perf_counter()
            fn(x).backward()
            return (time.perf_counter() - t0) * 1e3
        step()
        steps.append(step)
    times = [[], []]
    for _ in range(reps):
        for k, step in enumerate(steps):
            times[k].append(step())
    case = f"CPU loss alone ({B},{T},{U},{V}) fp32"
    ratio = statistics.median(b / a for a, b in zip(*times))
    print(f"  CPU TDT / RNN-T: {ratio:.2f}x (median of {reps} alternating pairs)")
    return [(case, "RNN-T", statistics.median(times[0]), None), (case, "TDT", statistics.median(times[1]), None)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-only", action="store_true")
    a = p.parse_args()
    results = []
    if torch.cuda.is_available() and not a.cpu_only:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        results += loss_alone()
        results += protocol_a()
    results += cpu()
    print(f"{'case':<52} {'contender':<42} {'ms':>9} {'MB':>9}")
    for case, name, ms, mb in results:
        print(f"{case:<52} {name:<42} {ms:9.2f} {'' if mb is None else f'{mb:9.0f}'}")


if __name__ == "__main__":
    main()
