#!/usr/bin/env python
"""The fused step's logits GEMMs on Hopper: transducer.hopper's statistics kernel (one GEMM whose epilogue keeps
each row's logsumexp and its blank and label logits) against (a) cuBLAS's plain GEMM H W^T into the padded (N, Vp)
bf16 logits, the floor, and (b) today's forward tile, that GEMM then the log-probs stage over the logits; and its
gradient kernel (the GEMM whose epilogue writes the logits' gradient G once in bf16) against the same floor.

    python benchmarks/hopper_gemm.py                         # every case, the default kernel
    python benchmarks/hopper_gemm.py --cases protocol-a      # some of them (protocol-a, flash, parakeet-tdt)
    python benchmarks/hopper_gemm.py --configs default 256,2,1,1 128,2,1,2   # and kernels of other shapes
                                                             # (tile_n,warpgroups,cluster_m,occupancy[,pingpong]:
                                                             # hopper.Config)

Cases (bf16, uniform lengths giving the row counts of fused_step.py's cases):
    protocol-a     B 30, T 400, U 59: 720,000 rows, 512 -> 500 (GEMMs at 512)
    flash          B 32, T 400, U 95: 1,228,800 rows, 640 -> 1024
    parakeet-tdt   B 16, T 375, U 100: 606,000 rows, 640 -> 8193 token columns (the statistics' and the log-probs
                   stage's; the GEMMs at 8320, the padded 8198 rows of the joint)

Contenders run in turns, ROUNDS rounds of REPS calls each, the round's first contender rotating, and each one's
minimum over rounds is kept (a GPU that heats up slows all alike, and no contender keeps one place in the rounds);
the SM clock is printed before and after each case. The first call of each kernel shape includes its compilation,
printed as such. Exactness: the kernel's outputs on the first 8192 rows against the float32 logits.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from common import gpu_clock  # first: common puts the repository root on sys.path

from transducer import hopper
from transducer.cuda.stages import layout as make_layout
from transducer.cuda.stages import log_probs
from transducer.layout import LabelCheck
from transducer.options import LossOptions

ROUNDS = 5
REPS = 10
CASES = {  # name: (B, T, U, J, V of the statistics, rows of the GEMMs' projection)
    "protocol-a": (30, 400, 59, 512, 500, 512),
    "flash": (32, 400, 95, 640, 1024, 1024),
    "parakeet-tdt": (16, 375, 100, 640, 8193, 8320),
}


def timed(fn):
    """ms per call of fn, the mean of REPS calls between two CUDA events."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(REPS):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / REPS


def run_case(name, config_names):
    B, T, U, J, V, Vp = CASES[name]
    configs = [
        hopper.default_config(V, J) if c == "default" else hopper.Config(*map(int, c.split(","))) for c in config_names
    ]
    N = B * T * (U + 1)
    g = torch.Generator(device="cuda").manual_seed(0)
    H = torch.randn(N, J, device="cuda", generator=g).to(torch.bfloat16)
    Wp = (torch.randn(Vp, J, device="cuda", generator=g) / J**0.5).to(torch.bfloat16)
    W = Wp[:V]
    targets = torch.randint(1, V, (B, U), device="cuda", generator=g, dtype=torch.int32)
    T_b = torch.full((B,), T, device="cuda", dtype=torch.int32)
    U_b = torch.full((B,), U, device="cuda", dtype=torch.int32)
    layout = make_layout(T_b, U_b, U + 1, 0, LabelCheck(targets, V, 0), False)
    # each row's label: targets[b, u] for u < U, none (-1) on the last row of each frame
    labels = torch.cat([targets, targets.new_full((B, 1), -1)], dim=1)[:, None, :].expand(B, T, U + 1)
    labels = labels.reshape(N).contiguous()
    options = LossOptions()
    logits = torch.empty(N, Vp, device="cuda", dtype=torch.bfloat16)
    print(f"\n{name}: N {N} rows, J {J}, V {V} (GEMMs at {Vp}); {gpu_clock()}")

    contenders = {
        "cuBLAS H W^T (floor)": lambda: torch.mm(H, Wp.t(), out=logits),
        "today: GEMM + log-probs stage": lambda: log_probs(F.linear(H, Wp)[:, :V], targets, layout, options),
    }
    for config in configs:
        t0 = time.perf_counter()
        proj = hopper.projection(W, None, config)
        out = hopper.statistics_tile(proj, H, labels, 0)
        torch.cuda.synchronize()
        print(f"  {tuple(config)}: first call (compiles) {time.perf_counter() - t0:.1f} s")
        check_rows = slice(0, 8192)
        Z = H[check_rows].float() @ W.float().t()
        rows = torch.arange(Z.size(0), device="cuda")
        lab = labels[check_rows]
        want = (torch.logsumexp(Z, 1), Z[:, 0], torch.where(lab >= 0, Z[rows, lab.clamp(min=0).long()], 0.0))
        errors = [float((o[check_rows] - w).abs().max()) for o, w in zip(out, want)]
        print(f"  {tuple(config)}: max |error| den {errors[0]:.2e}, z_blank {errors[1]:.2e}, z_label {errors[2]:.2e}")
        contenders[f"ours {tuple(config)}"] = lambda proj=proj: hopper.statistics_tile(proj, H, labels, 0)
        coefficients = torch.stack(
            [
                out[0],
                torch.rand_like(out[0]),
                torch.rand_like(out[0]) * 0.1,
                torch.rand_like(out[0]) * 0.1,
                torch.ones_like(out[0]),
            ]
        )
        G = hopper.gradient_tile(proj, H, labels, 0, coefficients, 0.0)
        P = torch.softmax(Z, 1) * coefficients[1, check_rows, None]
        P[:, 0] -= coefficients[2, check_rows]
        P[rows, lab.clamp(min=0).long()] -= torch.where(lab >= 0, coefficients[3, check_rows], 0.0)
        print(
            f"  {tuple(config)}: gradient max |error| {float((G[check_rows, :V].float() - P).abs().max()):.2e} "
            f"(|G| <= {float(P.abs().max()):.2e})"
        )
        contenders[f"ours, gradient {tuple(config)}"] = lambda proj=proj, c=coefficients: hopper.gradient_tile(
            proj, H, labels, 0, c, 0.0
        )
    for fn in contenders.values():
        fn()
    best = {k: float("inf") for k in contenders}
    names = list(contenders)
    for r in range(ROUNDS):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            best[k] = min(best[k], timed(contenders[k]))
    floor = best["cuBLAS H W^T (floor)"]
    flops = 2 * N * J * Vp
    for k, ms in best.items():
        print(f"  {k:<40} {ms:8.3f} ms  {ms / floor:5.2f}x floor  {flops / ms / 1e9:6.0f} TFLOP/s at Vp")
    print(f"  after: {gpu_clock()}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument(
        "--configs",
        nargs="*",
        default=["default"],
        help="kernel shapes: default (hopper.default_config) or "
        "tile_n,warpgroups,cluster_m,occupancy[,pingpong[,vocab_groups]] (hopper.Config)",
    )
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, available: {hopper.available()}")
    for name in a.cases:
        run_case(name, a.configs)


if __name__ == "__main__":
    main()
