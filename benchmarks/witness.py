#!/usr/bin/env python
"""Where torchaudio's rnnt_loss disagrees with the float64 reference (needs a CUDA GPU for its CUDA path).

    python benchmarks/witness.py [--batches 40] [--seed 0]

Draws random ragged batches (B in [2, 6], T_b in [1, 8], U_b in [0, 4], V in [3, 40], blank 0), about
one in three utterances with T_b = 1 or U_b = 0, and compares torchaudio's CPU and CUDA losses and this
library's with the float64 reference (transducer.transducer_loss_reference). Prints the batches where
a contender is off by more than 1e-4 (relative), then one count per contender. The README's section
"torchaudio's CUDA loss" quotes it.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transducer import transducer_loss, transducer_loss_reference  # noqa: E402


def batch(gen):
    B = int(torch.randint(2, 7, (1,), generator=gen))
    V = int(torch.randint(3, 41, (1,), generator=gen))
    T = torch.randint(1, 9, (B,), generator=gen)
    U = torch.randint(0, 5, (B,), generator=gen)
    logits = torch.randn(B, int(T.max()), int(U.max()) + 1, V, generator=gen, dtype=torch.float64) * 2
    targets = torch.randint(1, V, (B, max(int(U.max()), 1)), generator=gen)
    return logits, targets, T, U


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    import torchaudio.functional as ta

    gen = torch.Generator().manual_seed(a.seed)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    wrong = {f"{who} {d}": 0 for who in ("torchaudio", "transducer") for d in devices}
    for i in range(a.batches):
        logits, targets, T, U = batch(gen)
        ref = transducer_loss_reference(logits, targets, T, U)
        for d in devices:
            x, y, t, u = logits.float().to(d), targets.to(d), T.to(d), U.to(d)
            got = {
                "torchaudio": ta.rnnt_loss(
                    x, y[:, : max(int(U.max()), 1)].int().contiguous(), t.int(), u.int(), blank=0, reduction="none"
                ),
                "transducer": transducer_loss(x, y, t, u, reduction="none"),
            }
            for who, loss in got.items():
                err = ((loss.double().cpu() - ref).abs() / ref.abs()).max().item()
                if not err <= 1e-4:
                    wrong[f"{who} {d}"] += 1
                    print(
                        f"batch {i}: {who} on {d}: T={T.tolist()} U={U.tolist()}\n"
                        f"  reference {[round(v, 4) for v in ref.tolist()]}\n"
                        f"  {who:<9} {[round(v, 4) for v in loss.double().cpu().tolist()]}"
                    )
    import torchaudio

    print(f"torch {torch.__version__}, torchaudio {torchaudio.__version__}")
    for k, n in wrong.items():
        print(f"{k}: {n} of {a.batches} batches off the float64 reference by more than 1e-4")


if __name__ == "__main__":
    main()
