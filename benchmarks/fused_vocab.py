#!/usr/bin/env python
"""Peak memory and time of one CUDA training step as V grows at fixed rows, fused against unfused.

    python benchmarks/fused_vocab.py

(B, T, U, J) = (8, 200, 50, 512): 81,600 rows; V = 500, 4000, 32000; fp32 and bf16 autocast (bf16 encoder
and predictor outputs). The step is joiner + loss (sum) + backward after one warm-up step; its peak
extra memory is torch.cuda.max_memory_allocated above what was allocated before it (CUDA events time it:
benchmarks/common.py's cuda_ms).
"""

import torch
from common import cuda_ms  # first: it puts the repository root on sys.path

import transducer


def main(B=8, T=200, U=50, J=512):
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; rows {B * T * (U + 1)}, J {J}")
    print(f"{'prec':<5} {'V':>6} {'contender':<8} {'ms':>9} {'extra MiB':>10}")
    for prec in ("bf16", "fp32"):
        dtype = torch.bfloat16 if prec == "bf16" else torch.float32
        for V in (500, 4000, 32000):
            enc = torch.randn(B, T, J, device="cuda", dtype=dtype, requires_grad=True)
            pred = torch.randn(B, U + 1, J, device="cuda", dtype=dtype, requires_grad=True)
            lin = torch.nn.Linear(J, V).cuda()
            y = torch.randint(1, V, (B, U), device="cuda")
            t, u = torch.full((B,), T, device="cuda"), torch.full((B,), U, device="cuda")
            contenders = {
                "fused": lambda: transducer.fused_joiner_loss(
                    enc, pred, lin.weight, lin.bias, y, t, u, reduction="sum"
                ),
                "unfused": lambda: transducer.transducer_loss(
                    lin(torch.tanh(transducer.pack(enc, pred, t, u))), y, t, u, reduction="sum"
                ),
            }
            for name, fn in contenders.items():

                def step():
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=prec == "bf16"):
                        loss = fn()
                    loss.backward()
                    enc.grad = pred.grad = None
                    lin.zero_grad(set_to_none=True)

                ms, extra = cuda_ms(step, warmup=1, reps=1)
                print(f"{prec:<5} {V:6d} {name:<8} {ms:9.2f} {extra:10.1f}", flush=True)
            enc = pred = lin = None  # freed (the closures above read them)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
