"""Per-stage timing of the CUDA loss (a tool for optimising the kernels; bench.py is the benchmark).

    python benchmarks/stages.py [--dtypes fp32,fp16,bf16] [--sizes 0,1,2] [--profile]
    python benchmarks/stages.py --geometries

For each Protocol B size (full lengths) and dtype: GPU time of log_probs, alpha_beta and gradient
(20 back-to-back launches between two events), their effective bandwidth, the host time of one eager
fwd+bwd (check_inputs on and off), its wall time between events, and a CUDA-graph replay of the same
step (no host overhead); all against the floor of 3 passes over the logits at the measured copy rate.
With --profile, it also prints where the host time of an eager step goes (cProfile, check_inputs on
and off), the part that sets the step time at the smallest size. With --geometries, instead: log_probs and
gradient at each row geometry forced (8, 16 or 32 lanes or a block a row, raised where the pass needs more lanes:
transducer/cuda/stages.py's _row_pass), on GEOMETRY_CASES's rows, the minimum over 7 rounds of 20 launches, with the
share of the copy rate each pass's bytes reach, and the geometry each pass takes by default.
"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transducer import transducer_loss  # noqa: E402
from transducer.cuda import stages as cuda  # noqa: E402
from transducer.custom_ops import make_layout  # noqa: E402
from transducer.lattices import Lattice  # noqa: E402
from transducer.layout import LabelCheck  # noqa: E402
from transducer.options import LossOptions  # noqa: E402

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


def profile(step, label, n=200):
    """cProfile of n eager steps: the functions with the most own time, and the total per step."""
    step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    torch.cuda.synchronize()
    print(f"--- host profile, {label}: {(time.perf_counter() - t) / n * 1e3:.3f} ms per step (profiled)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def timeline(step, label):
    """The GPU kernels and the host's launch and copy calls of one eager step, in microseconds from its start
    (torch.profiler; the profiler adds host time of its own): where the GPU waits for the host."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        or any(k in e.name for k in ("LaunchKernel", "Memcpy", "Synchronize", "run_backward"))
    ]
    t0 = min(e.time_range.start for e in events)
    print(f"--- timeline, {label} (us: start, duration; [gpu] kernels, host calls otherwise)")
    for e in sorted(events, key=lambda e: e.time_range.start):
        gpu = e.device_type == torch.autograd.DeviceType.CUDA
        print(
            f"  {e.time_range.start - t0:8.1f} {e.time_range.elapsed_us():8.1f} {'[gpu] ' if gpu else '      '}"
            f"{e.name[:90]}"
        )


def primitives():
    """Host cost of the building blocks of a step, in microseconds per call."""
    x = torch.arange(32, device="cuda")
    y = torch.empty(6, dtype=torch.int64, device="cuda")
    lengths = torch.full((32,), 40, device="cuda")
    cases = {
        "torch.empty(6)": lambda: torch.empty(6, dtype=torch.int64, device="cuda"),
        "x * (x + 1)": lambda: x * (x + 1),
        "torch.cumsum": lambda: torch.cumsum(x, 0),
        "y.tolist() (sync)": lambda: y.tolist(),
        "cuda.layout (one launch)": lambda: cuda.layout(
            lengths, lengths, 41, 0, LabelCheck(lengths[None], 500, 0), True
        ),
    }
    for name, fn in cases.items():
        us = host_ms(fn, n=2000) * 1e3
        print(f"  {name}: {us:.1f} us")


# rows x columns (row width), dtype: compact batches of B utterances with (T, U) drawn from the ranges
GEOMETRY_CASES = [
    ("500 of 512 bf16 (the fused step's tiles)", 30, (300, 500), (40, 90), 500, 512, torch.bfloat16),
    ("500 bf16", 32, (150, 150), (40, 40), 500, 500, torch.bfloat16),
    ("500 fp32", 32, (150, 150), (40, 40), 500, 500, torch.float32),
    ("1024 bf16", 32, (200, 400), (60, 128), 1024, 1024, torch.bfloat16),
    ("128 bf16", 32, (150, 150), (40, 40), 128, 128, torch.bfloat16),
    ("256 fp32", 32, (150, 150), (40, 40), 256, 256, torch.float32),
    ("29 fp32 (characters)", 32, (300, 300), (100, 100), 29, 29, torch.float32),
    ("2048 bf16", 16, (300, 300), (80, 80), 2048, 2048, torch.bfloat16),
]


def copy_rate(time_ms):
    """GB/s of a device-to-device copy of 256 MiB (read and written), timed by ``time_ms``."""
    src, dst = (torch.empty(1 << 28, dtype=torch.uint8, device="cuda") for _ in range(2))
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src)) / 1e6


def geometries():
    """The row kernels at each row geometry forced (--geometries)."""
    best = lambda fn: min(gpu_ms(fn, reps=1) for _ in range(7))  # noqa: E731
    rate = copy_rate(best)
    print(f"copy rate {rate:.0f} GB/s; us (share of the copy rate), lanes a row forced -> taken by log_probs, gradient")
    gen = torch.Generator().manual_seed(0)
    chosen = cuda.threads_per_row
    for name, B, t_range, u_range, V, width, dtype in GEOMETRY_CASES:
        T = torch.randint(t_range[0], t_range[1] + 1, (B,), generator=gen)
        U = torch.randint(u_range[0], u_range[1] + 1, (B,), generator=gen)
        N = int((T * (U + 1)).sum())
        targets = torch.randint(1, V, (B, int(U.max())), generator=gen).cuda()
        wide = (torch.randn(N, width, device="cuda") * 2).to(dtype)
        x = wide[:, :V]
        out = torch.empty_like(wide)[:, :V]  # the logits' layout, as the fused loss's in-place gradient
        layout = make_layout(x, targets, T.cuda(), U.cuda())
        o = LossOptions(blank=0)
        lp, den = cuda.log_probs(x, targets, layout, o)
        lattice = Lattice(layout, lp, den, *cuda.alpha_beta(lp, layout, o))
        scale = torch.ones(B, device="cuda")
        size = x.element_size()
        passes = lambda: (  # noqa: E731
            cuda._row_pass(N, V, size, x, cuda.LOG_PROBS_LANE_BYTES)[0],
            cuda._row_pass(N, V, size, x, cuda.GRADIENT_LANE_BYTES, [out], staging=True)[0],
        )
        row_bytes = N * V * size
        print(f"{N:,} x {name}, default lanes {passes()}")
        for forced in (8, 16, 32, cuda.THREADS):
            cuda.threads_per_row = lambda rows, row_bytes, device, bytes_per_lane=0: forced  # noqa: E731
            try:
                taken = passes()
                t1 = best(lambda: cuda.log_probs(x, targets, layout, o))
                t2 = best(lambda: cuda.gradient(x, targets, lattice, scale, o, out))
            finally:
                cuda.threads_per_row = chosen
            print(
                f"  {forced:3d} -> {taken}: log_probs {t1 * 1e3:7.1f} ({row_bytes / t1 / 1e6 / rate:.2f}), "
                f"gradient {t2 * 1e3:7.1f} ({2 * row_bytes / t2 / 1e6 / rate:.2f})"
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--sizes", default="0,1,2", help="indices into " + str(SIZES))
    parser.add_argument("--profile", action="store_true", help="cProfile the host side of an eager step")
    parser.add_argument("--geometries", action="store_true", help="the row kernels at each row geometry, forced")
    args = parser.parse_args()
    if args.geometries:
        geometries()
        return
    print(
        "size dtype | copy GB/s | log_probs ms (GB/s) | alpha_beta ms | gradient ms (GB/s) | "
        "host ms check/no-check | eager ms check/no-check | graph ms | floor ms | graph/floor eager/floor"
    )
    if args.profile:
        primitives()
    for B, T, U, V in [SIZES[int(i)] for i in args.sizes.split(",")]:
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
            layout = make_layout(logits, targets, lengths_t, lengths_u)
            options = LossOptions()
            lp, den = cuda.log_probs(logits, targets, layout, options)
            alpha, beta, loss = cuda.alpha_beta(lp, layout, options)
            lattice = Lattice(layout, lp, den, alpha, beta, loss)
            scale = torch.ones(B, device="cuda")
            t_lp = gpu_ms(lambda: cuda.log_probs(logits, targets, layout, options))
            t_ab = gpu_ms(lambda: cuda.alpha_beta(lp, layout, options))
            t_gr = gpu_ms(lambda: cuda.gradient(logits, targets, lattice, scale, options, grad))
            x = logits.clone().requires_grad_()

            def step(check):
                x.grad = None
                transducer_loss(x, targets, lengths_t, lengths_u, reduction="sum", check_inputs=check).backward()

            hosts = [host_ms(lambda: step(c), n=5) for c in (True, False)]
            if args.profile:
                for c in (True, False):
                    profile(lambda: step(c), f"{(B, T, U, V)} {name} check_inputs={c}")
                    timeline(lambda: step(c), f"{(B, T, U, V)} {name} check_inputs={c}")
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
            print(
                f"{(B, T, U, V)} {name} | {copy_gbps:.0f} | {t_lp:.3f} ({nbytes / t_lp / 1e6:.0f}) | {t_ab:.3f} | "
                f"{t_gr:.3f} ({2 * nbytes / t_gr / 1e6:.0f}) | {hosts[0]:.3f}/{hosts[1]:.3f} | "
                f"{eagers[0]:.3f}/{eagers[1]:.3f} | {t_graph:.3f} | {floor:.3f} | "
                f"{t_graph / floor:.2f}x {eagers[0] / floor:.2f}x",
                flush=True,
            )
            logits = grad = x = lp = den = alpha = beta = graph = lattice = None  # freed (the closures above read them)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
