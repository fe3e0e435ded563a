#!/usr/bin/env python
"""Peak memory and time of one CPU training step (joiner + loss + backward), fused against unfused.

    python benchmarks/fused_cpu.py                  # V = 500, 4000 (add 32000: --vocab 500 4000 32000)

Each measurement runs in its own process: after the inputs exist and a tiny warm-up step has run,
the kernel's peak resident-set counter (VmHWM) is reset and one step at (B, T, U, J) = (8, 200, 40, 256)
runs; the peak above the resident set before the step is the step's extra memory (large buffers are
mmap'ed and returned to the system when freed, so the counter sees the real peak). Linux only.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status_mb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def one(variant, V, threads):
    """Runs in the child: prints 'peak_mb time_ms loss'."""
    import torch

    sys.path.insert(0, str(ROOT))
    import transducer

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    B, T, U, J = 8, 200, 40, 256
    enc = torch.randn(B, T, J, requires_grad=True)
    pred = torch.randn(B, U + 1, J, requires_grad=True)
    lin = torch.nn.Linear(J, V)
    y = torch.randint(1, V, (B, U))
    lengths = torch.full((B,), T), torch.full((B,), U)

    def step(e, p, yy, t, u):
        if variant == "fused":
            loss = transducer.fused_joiner_loss(e, p, lin.weight, lin.bias, yy, t, u)
        else:
            loss = transducer.transducer_loss(lin(torch.tanh(transducer.pack(e, p, t, u))), yy, t, u)
        loss.backward()
        return loss.item()

    step(enc[:1, :5], pred[:1, :3], y[:1, :2], torch.tensor([5]), torch.tensor([2]))
    enc.grad = pred.grad = None
    lin.zero_grad(set_to_none=True)
    before = _status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    t0 = time.perf_counter()
    loss = step(enc, pred, y, *lengths)
    ms = (time.perf_counter() - t0) * 1e3
    print(_status_mb("VmHWM") - before, ms, loss)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[500, 4000])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return one(a.child[0], int(a.child[1]), a.threads)
    print(f"{'V':>6} {'unfused MB':>11} {'fused MB':>9} {'ratio':>6} {'unfused ms':>11} {'fused ms':>9}  loss equal")
    for V in a.vocab:
        out = {}
        for variant in ("unfused", "fused"):
            r = subprocess.run(
                [sys.executable, __file__, "--child", variant, str(V), "--threads", str(a.threads)],
                capture_output=True,
                text=True,
                check=True,
            )
            out[variant] = [float(x) for x in r.stdout.split()]
        (um, ut, ul), (fm, ft, fl) = out["unfused"], out["fused"]
        print(f"{V:6d} {um:11.1f} {fm:9.1f} {fm / um:6.3f} {ut:11.0f} {ft:9.0f}  {abs(ul - fl) <= 1e-4 * abs(ul)}")


if __name__ == "__main__":
    main()
