#!/usr/bin/env python
"""The fused loss's pack passes alone, a tile at a time (a tool for optimising their kernels; fused_step.py is the
benchmark of the step they serve).

    python benchmarks/pack_passes.py                      # this tree
    python benchmarks/pack_passes.py --tree ../other      # another checkout's transducer, for runs in turns

At Protocol A's first batch (30 LibriSpeech utterances, J = 512) and Flash RNN-T's shape (B 32, T 200-400, U 64-128,
J = 640), the tanh joiner: pack_forward into a tile's GEMM operand (J + 8 columns: the bias's ones) for bf16 inputs
into bf16, fp32 inputs into bf16 (autocast's operand) and fp32 into fp32, and pack's backward (pack_backward_add:
act' and the sums over u and over t) of a bf16 tile. Tiles of 131,032 rows (65,496 in fp32) over the batch's rows,
the minimum over 20 timings of all its tiles between two CUDA events, given a tile; pack_forward's figure also as
the rate at which it writes the tile.
"""

import argparse
import bisect
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def batch(case):
    """(T, U, J) of the case."""
    if case == "protocol-a":
        rows = np.loadtxt(
            HERE / "data" / "librispeech_train_clean_100_TU.csv", delimiter=",", skiprows=1, dtype=np.int64
        )
        return rows[:30, 0], rows[:30, 1], 512
    rng = np.random.default_rng(0)
    return rng.integers(200, 401, 32), rng.integers(64, 129, 32), 640


def gpu_us(fn, count):
    """The minimum over 20 timings of fn() (count tiles) between two events, a tile, in us."""
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=Path, default=HERE.parent, help="the checkout whose transducer is timed")
    a = p.parse_args()
    sys.path.insert(0, str(a.tree.resolve()))
    from transducer.cuda import stages

    print(f"{torch.cuda.get_device_name()}, {a.tree}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in ("protocol-a", "flash"):
        T, U, J = batch(case)
        B, N = len(T), int((T * (U + 1)).sum())
        lengths = torch.tensor(T, device="cuda"), torch.tensor(U, device="cuda")
        row_splits = [0] + np.cumsum(T * (U + 1)).tolist()
        for inputs, operand in ((torch.bfloat16,) * 2, (torch.float32, torch.bfloat16), (torch.float32,) * 2):
            enc = torch.randn(B, int(T.max()), J, device="cuda", generator=gen).to(inputs)
            pred = torch.randn(B, int(U.max()) + 1, J, device="cuda", generator=gen).to(inputs)
            layout = stages.layout(*lengths, pred.size(1))
            rows = (131072 if operand == torch.bfloat16 else 65536) - 40
            starts = range(0, N - rows, rows)
            out = torch.empty(rows, J + 8, device="cuda", dtype=operand)

            def forward():
                for s in starts:
                    stages.pack_forward(enc, pred, layout, rows, s, "tanh", out)

            us = gpu_us(forward, len(starts))
            rate = rows * (J + 8) * out.element_size() / us / 1e6
            name = f"{str(inputs)[6:]} -> {str(operand)[6:]}"
            print(f"{case:<10} pack_forward {name:<19} {rows} rows  {us:7.1f} us  {rate:5.2f} TB/s written")
            if inputs != operand:
                continue
            grads = torch.zeros_like(enc, dtype=torch.float32), torch.zeros_like(pred, dtype=torch.float32)
            dh = torch.randn(rows, J, device="cuda", generator=gen).to(operand)

            def backward():
                for s in starts:
                    e = s + rows
                    utterances = bisect.bisect_right(row_splits, s) - 1, bisect.bisect_left(row_splits, e, lo=1)
                    stages.pack_backward_add(dh, layout, s, utterances, grads, (enc, pred), "tanh")

            us = gpu_us(backward, len(starts))
            name = f"{str(operand)[6:]} dh"
            print(f"{case:<10} pack backward {name:<18} {rows} rows  {us:7.1f} us")


if __name__ == "__main__":
    main()
