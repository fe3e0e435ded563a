#!/usr/bin/env python
"""Multi-blank RNN-T benchmarks: the loss alone against NeMo's MultiblankRNNTLossNumba and the bandwidth floor, a
Protocol A training step (its batches and shapes, 3 warm-up and 4 timed batches, each timed step after an
untimed one on the same batch) fused and unfused against this library's RNN-T step, and the CPU loss against the
RNN-T CPU loss. Prints one table; benchmarks/RESULTS.md keeps the figures.

    python benchmarks/multiblank.py            # CUDA (NeMo's loss when importable: benchmarks/README.md)
    python benchmarks/multiblank.py --cpu-only
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
from tdt import cuda_ms  # noqa: E402

BIG = [2, 4, 8]  # big blanks of durations 2, 4, 8 in the columns before the blank, which is the last column
SIGMA = 0.05


def nemo_loss():
    try:
        if not hasattr(np, "row_stack"):  # NeMo 3.0's numba loss still calls it
            np.row_stack = np.vstack
        from nemo.collections.asr.parts.numba.rnnt_loss import MultiblankRNNTLossNumba
        return MultiblankRNNTLossNumba
    except Exception as e:  # noqa: BLE001
        print(f"NeMo multi-blank: not importable ({type(e).__name__}: {str(e)[:80]})")
        return None


def loss_alone(B=16, T=400, U=100, V=1024):
    """(B, T, U, V + 3) fp32, every length at its max: V labels then the big blanks and the blank."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    width = V + len(BIG)
    Ts, Us = torch.full((B,), T, device="cuda"), torch.full((B,), U, device="cuda")
    y = torch.randint(0, V - 1, (B, U), device="cuda", generator=gen)
    padded = torch.randn(B, T, U + 1, width, device="cuda", generator=gen)
    rows = padded.view(-1, width)
    copy = torch.empty_like(rows)
    t_copy, _ = cuda_ms(lambda: copy.copy_(rows))
    floor = 3 * rows.numel() * 4 / (2 * rows.numel() * 4 / (t_copy * 1e-3)) * 1e3
    del copy
    case = f"multi-blank loss alone ({B},{T},{U},{V}+{len(BIG)}) fp32"
    out = [(case, "bandwidth floor (3 passes)", floor, None)]
    for name, x in (("ours compact", rows), ("ours padded", padded)):
        x = x.detach().requires_grad_()

        def step():  # the gradient freed after the step: the extra memory counts it
            transducer.multiblank_loss(x, y, Ts, Us, BIG, -1, sigma=SIGMA, reduction="sum").backward()
            x.grad = None
        ms, mb = cuda_ms(step)
        out.append((case, name, ms, mb))
    loss_class = nemo_loss()
    if loss_class is not None:
        fn = loss_class(blank=width - 1, big_blank_durations=BIG, reduction="none", sigma=SIGMA)
        x = padded.detach().requires_grad_()

        def step():
            fn(x, y, Ts, Us).sum().backward()
            x.grad = None
        ms, mb = cuda_ms(step)
        out.append((case, "NeMo MultiblankRNNTLossNumba", ms, mb))
    print(f"  (gradient size {rows.numel() * 4 / 2**20:.0f} MB)")
    return out


def protocol_a(batches=4, width=512, vocab=500):
    rows = np.loadtxt(HERE / "data" / "librispeech_train_clean_100_TU.csv", delimiter=",", skiprows=1,
                      dtype=np.int64)
    out = []
    for prec in ("fp32", "bf16"):
        dtype = torch.float32 if prec == "fp32" else torch.bfloat16
        torch.manual_seed(0)
        joiner_mb = torch.nn.Linear(width, vocab + len(BIG) + 1).cuda()  # labels [1, vocab), the big blanks, the blank last
        joiner_rnnt = torch.nn.Linear(width, vocab).cuda()
        recs = {}
        for i in range(3 + batches):
            r = rows[i * 30:(i + 1) * 30]
            T, U = torch.tensor(r[:, 0], device="cuda"), torch.tensor(r[:, 1], device="cuda")
            y = torch.randint(1, vocab, (30, int(U.max())), device="cuda")
            enc = torch.randn(30, int(T.max()), width, device="cuda", dtype=dtype, requires_grad=True)
            pred = torch.randn(30, int(U.max()) + 1, width, device="cuda", dtype=dtype, requires_grad=True)
            contenders = {
                "ours RNN-T fused (scale)": lambda: transducer.fused_joiner_loss(
                    enc, pred, joiner_rnnt.weight, joiner_rnnt.bias, y, T, U, reduction="sum"),
                "ours multi-blank fused": lambda: transducer.fused_joiner_loss(
                    enc, pred, joiner_mb.weight, joiner_mb.bias, y, T, U, blank=-1, big_blank_durations=BIG,
                    sigma=SIGMA, reduction="sum"),
                "ours RNN-T compact (scale)": lambda: transducer.transducer_loss(
                    joiner_rnnt(torch.tanh(transducer.pack(enc, pred, T, U))), y, T, U, reduction="sum"),
                "ours multi-blank compact": lambda: transducer.multiblank_loss(
                    joiner_mb(torch.tanh(transducer.pack(enc, pred, T, U))), y, T, U, BIG, -1, sigma=SIGMA,
                    reduction="sum"),
            }
            for name, loss_fn in contenders.items():
                def step():
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=prec == "bf16"):
                        loss = loss_fn()
                    loss.backward()
                    enc.grad = pred.grad = None
                    joiner_mb.zero_grad(set_to_none=True)
                    joiner_rnnt.zero_grad(set_to_none=True)
                # one untimed step on the batch first: the allocator's new segments are paid there
                ms, _ = cuda_ms(step, warmup=1, reps=1)
                peak = torch.cuda.max_memory_allocated() / 2**20
                if i >= 3:
                    recs.setdefault(name, []).append((ms, peak))
            del enc, pred
        for name, v in recs.items():
            out.append((f"Protocol A step {prec} (30 utts, 512 -> 500 (+3))", name,
                        statistics.fmean(m for m, _ in v), max(p for _, p in v)))
    return out


def cpu(B=8, T=100, U=30, V=256, reps=11):
    """The CPU losses, fwd + bwd, RNN-T and multi-blank steps alternating: the median of each and the median of
    the per-pair ratios."""
    gen = torch.Generator().manual_seed(0)
    Ts, Us = torch.full((B,), T), torch.full((B,), U)
    y = torch.randint(1, V - len(BIG) - 1, (B, U), generator=gen)
    steps = []
    for fn in (lambda x: transducer.transducer_loss(x, y, Ts, Us, reduction="sum"),
               lambda x: transducer.multiblank_loss(x, y, Ts, Us, BIG, -1, sigma=SIGMA, reduction="sum")):
        x = torch.randn(B * T * (U + 1), V, generator=gen).requires_grad_()

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
    print(f"  CPU multi-blank / RNN-T: {ratio:.2f}x (median of {reps} alternating pairs)")
    return [(case, "RNN-T", statistics.median(times[0]), None), (case, "multi-blank", statistics.median(times[1]), None)]


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
