"""Per-stage timing of the CUDA loss (a tool for optimising the kernels; bench.py is the benchmark).

    python benchmarks/stages.py [--dtypes fp32,fp16,bf16]

For each Protocol B size (full lengths) and dtype: GPU time of log_probs, alpha_beta and gradient
(20 back-to-back launches between two events), their effective bandwidth, the host time of one eager
fwd+bwd (check_inputs on and off), its wall time between events, and a CUDA-graph replay of the same
step (no host overhead); all against the floor of 3 passes over the logits at the measured copy rate.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transducer import cuda, transducer_loss  # noqa: E402
from transducer.loss import make_layout  # noqa: E402

SIZES = [(32, 150, 40, 500), (16, 400, 100, 1024), (8, 800, 100, 4096)]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def gpu_ms(fn, n=20, reps=5):
    """Median over reps of the mean GPU time of n back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    return sorted(times)[reps // 2]


def host_ms(fn, n=20):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = (time.perf_counter() - t) / n * 1e3
    torch.cuda.synchronize()
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    args = parser.parse_args()
    print("size dtype | copy GB/s | log_probs ms (GB/s) | alpha_beta ms | gradient ms (GB/s) | "
          "host ms check/no-check | eager ms check/no-check | graph ms | floor ms | graph/floor eager/floor")
    for B, T, U, V in SIZES:
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            lengths_t = torch.full((B,), T, device="cuda")
            lengths_u = torch.full((B,), U, device="cuda")
            N = B * T * (U + 1)
            logits = torch.randn(N, V, device="cuda").to(dtype)
            targets = torch.randint(1, V, (B, U), device="cuda")
            nbytes = N * V * logits.element_size()
            grad = torch.empty_like(logits)
            copy_gbps = 2 * nbytes / (gpu_ms(lambda: grad.copy_(logits), n=5) * 1e-3) / 1e9
            layout = make_layout(logits, lengths_t, lengths_u, U + 1)
            lp, den = cuda.log_probs(logits, targets, layout, 0, False)
            alpha, beta, loss = cuda.alpha_beta(lp, layout, False)
            scale = torch.ones(B, device="cuda")
            t_lp = gpu_ms(lambda: cuda.log_probs(logits, targets, layout, 0, False))
            t_ab = gpu_ms(lambda: cuda.alpha_beta(lp, layout, False))
            t_gr = gpu_ms(lambda: cuda.gradient(logits, targets, layout, lp, den, alpha, beta, loss, scale, 0,
                                                False, False, grad))
            x = logits.clone().requires_grad_()

            def step(check):
                x.grad = None
                transducer_loss(x, targets, lengths_t, lengths_u, reduction="sum", check_inputs=check).backward()

            hosts = [host_ms(lambda: step(c), n=5) for c in (True, False)]
            eagers = [gpu_ms(lambda: step(c), n=1, reps=7) for c in (True, False)]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step(False)
                step(False)
            torch.cuda.current_stream().wait_stream(side)
            x.grad = None
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                transducer_loss(x, targets, lengths_t, lengths_u, reduction="sum", check_inputs=False).backward()
            t_graph = gpu_ms(graph.replay, n=5)
            floor = 3 * nbytes / (copy_gbps * 1e9) * 1e3
            print(f"{(B, T, U, V)} {name} | {copy_gbps:.0f} | {t_lp:.3f} ({nbytes / t_lp / 1e6:.0f}) | {t_ab:.3f} | "
                  f"{t_gr:.3f} ({2 * nbytes / t_gr / 1e6:.0f}) | {hosts[0]:.3f}/{hosts[1]:.3f} | "
                  f"{eagers[0]:.3f}/{eagers[1]:.3f} | {t_graph:.3f} | {floor:.3f} | "
                  f"{t_graph / floor:.2f}x {eagers[0] / floor:.2f}x", flush=True)
            del logits, grad, x, lp, den, alpha, beta, graph
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
