#!/usr/bin/env python
"""The fused loss's pack passes alone, a tile at a time (a tool for optimising their kernels; fused_step.py is the
benchmark of the step they serve).

    python benchmarks/pack_passes.py                                   # this tree
    python benchmarks/pack_passes.py --trees . ../other --rounds 2     # trees in turns, a process each a round
    python benchmarks/pack_passes.py --activations tanh gelu           # joiners of other activations (default: tanh)

At Protocol A's first batch (30 LibriSpeech utterances, J = 512) and Flash RNN-T's shape (B 32, T 200-400, U 64-128,
J = 640), the tanh joiner (or --activations'): pack_forward into a tile's GEMM operand (J + 8 columns: the bias's
ones) for bf16 inputs into bf16, fp32 inputs into bf16 (autocast's operand) and fp32 into fp32, and pack's backward
(pack_backward_add: act' and the sums over u and over t) of each (dh in the operand's dtype). Tiles of 131,032
rows (65,496 in fp32) over the batch's whole tiles; a timing is all of them between two CUDA events, and a figure the
minimum over 20 timings and the rounds, given a tile; pack_forward's also as the rate at which it writes the tile.
"""

import argparse
import bisect
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def batch(case):
    """(T, U, J) of the case (fused_step.py's first batch of it)."""
    if case == "protocol-a":
        rows = np.loadtxt(
            HERE / "data" / "librispeech_train_clean_100_TU.csv", delimiter=",", skiprows=1, dtype=np.int64
        )
        return rows[:30, 0], rows[:30, 1], 512
    rng = np.random.default_rng(0)
    return rng.integers(200, 401, 32), rng.integers(64, 129, 32), 640


def child(tree, activations):
    """One process: every figure of ``tree``'s transducer, as one JSON line {name: (us a tile, bytes it writes or
    0)}."""
    import torch

    sys.path.insert(0, str(Path(tree).resolve()))
    from transducer.cuda import stages

    def gpu_us(fn, count):
        for _ in range(3):
            fn()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return min(times) / count * 1e3

    out = {"device": torch.cuda.get_device_name()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in ("protocol-a", "flash"):
        T, U, J = batch(case)
        B, N = len(T), int((T * (U + 1)).sum())
        lengths = torch.tensor(T, device="cuda"), torch.tensor(U, device="cuda")
        row_splits = [0] + np.cumsum(T * (U + 1)).tolist()
        for (inputs, operand), act in itertools.product(
            ((torch.bfloat16,) * 2, (torch.float32, torch.bfloat16), (torch.float32,) * 2), activations
        ):
            enc = torch.randn(B, int(T.max()), J, device="cuda", generator=gen).to(inputs)
            pred = torch.randn(B, int(U.max()) + 1, J, device="cuda", generator=gen).to(inputs)
            layout = stages.layout(*lengths, pred.size(1))
            rows = (131072 if operand == torch.bfloat16 else 65536) - 40
            starts = range(0, N - rows + 1, rows)
            assert len(starts) > 0, f"{case}: {N} rows, fewer than a tile's {rows}"
            hidden = torch.empty(rows, J + 8, device="cuda", dtype=operand)

            def forward():
                for s in starts:
                    stages.pack_forward(enc, pred, layout, rows, s, act, hidden)

            types = f"{act}, {str(inputs)[6:]} -> {str(operand)[6:]}, {rows} rows"
            out[f"{case} pack_forward {types}"] = gpu_us(forward, len(starts)), hidden.numel() * hidden.element_size()
            grads = torch.zeros_like(enc, dtype=torch.float32), torch.zeros_like(pred, dtype=torch.float32)
            dh = torch.randn(rows, J, device="cuda", generator=gen).to(operand)

            def backward():
                for s in starts:
                    utterances = bisect.bisect_right(row_splits, s) - 1, bisect.bisect_left(row_splits, s + rows, lo=1)
                    stages.pack_backward_add(dh, layout, s, utterances, grads, (enc, pred), act)

            out[f"{case} pack backward {types}"] = gpu_us(backward, len(starts)), 0
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", default=[str(HERE.parent)], help="checkouts to import transducer from")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--activations", nargs="+", default=["tanh"], help="the joiner's (transducer.joiner's names)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.activations)
    best = {}
    for _ in range(a.rounds):
        for tree in a.trees:
            line = subprocess.run(
                [sys.executable, __file__, "--child", tree, "--activations", *a.activations],
                check=True,
                stdout=subprocess.PIPE,
                text=True,
            ).stdout
            result = json.loads(line.strip().splitlines()[-1])
            device = result.pop("device")
            for name, figure in result.items():
                best[tree, name] = min(figure, best.get((tree, name), figure))
    print(f"{device}; minima over {a.rounds} rounds, a tile (us; pack_forward also TB/s written)")
    for (tree, name), (us, written) in best.items():
        rate = f"  {written / us / 1e6:5.2f} TB/s" if written else ""
        print(f"{tree:<24} {name:<64} {us:7.1f}{rate}")


if __name__ == "__main__":
    main()
