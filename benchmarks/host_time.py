"""Where the host time of a small loss call goes, and the step against another tree's in turns.

    python benchmarks/host_time.py                            # this tree: step time, host time, one call's profile
    python benchmarks/host_time.py --trees . ../base --rounds 4   # trees in turns, one process per tree and round

Protocol B's small case (32, 150, 40, 500), compact logits (lengths as bench.py draws them), the loss alone,
forward and backward, fp32 and fp16 (``--dtypes``). For each tree and round a process of its own imports
``transducer`` from that tree and prints, per dtype, the minimum over ``--steps`` steps of the step's wall time
(CUDA-synchronised) and of its host time (the Python calls until backward returns, the GPU still working).
The minima over rounds are printed per tree; with ``--profile``, the functions with the most own host time
in one process (cProfile over the steps), for the first tree. On a machine without CUDA it runs on the CPU,
where the step's time is the stages' arithmetic.
"""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

CASE = (32, 150, 40, 500)


def child(args):
    """One process: the step and host times of this tree, as one JSON line."""
    import cProfile
    import pstats
    import time

    import numpy as np
    import torch

    sys.path.insert(0, str(Path(args.child).resolve()))
    from transducer import transducer_loss

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B, maxT, maxU, V = CASE
    rng = np.random.default_rng(2)  # bench.py's draw_lengths
    Ts = rng.integers(math.ceil(0.7 * maxT), maxT + 1, B)
    Us = rng.integers(math.ceil(0.7 * maxU), maxU + 1, B)
    Ts[0], Us[0] = maxT, maxU
    gen = torch.Generator().manual_seed(3)
    targets = torch.randint(1, V, (B, maxU), generator=gen).to(dev)
    T, U = torch.tensor(Ts).to(dev), torch.tensor(Us).to(dev)
    N = int(sum(int(t) * (int(u) + 1) for t, u in zip(Ts, Us)))
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "tree": args.child}
    for name in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
        x = torch.randn(N, V, generator=gen).to(dev, dtype).requires_grad_()

        def step():
            transducer_loss(x, targets, T, U).backward()

        for _ in range(10):
            step()
        sync()
        walls, hosts = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            sync()
            walls.append(time.perf_counter() - t0)
            hosts.append(t1 - t0)
        out[name] = {"step_ms": min(walls) * 1e3, "host_ms": min(hosts) * 1e3}
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                step()
            prof.disable()
            sync()
            print(f"--- {name}: own host time per call, {args.steps} calls", file=sys.stderr)
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(20)
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--trees",
        nargs="+",
        default=[str(Path(__file__).resolve().parents[1])],
        help="repository roots to import transducer from, in turns",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--dtypes", default="fp32,fp16")
    ap.add_argument("--profile", action="store_true", help="cProfile the first tree's steps")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    best = {}
    for r in range(args.rounds):
        for i, tree in enumerate(args.trees):
            cmd = [sys.executable, __file__, "--child", tree, "--steps", str(args.steps), "--dtypes", args.dtypes]
            if args.profile and r == 0 and i == 0:
                cmd.append("--profile")
            line = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            result = json.loads(line.strip().splitlines()[-1])
            for name in args.dtypes.split(","):
                old = best.setdefault((tree, name), result[name])
                best[tree, name] = {k: min(old[k], result[name][k]) for k in old}
    print(
        f"{CASE} compact, the loss alone, forward and backward; minima over {args.rounds} rounds of "
        f"{args.steps} steps ({result['device']})"
    )
    print(f"{'tree':<40} {'dtype':<6} {'step ms':>8} {'host ms':>8}")
    for (tree, name), t in best.items():
        print(f"{tree:<40} {name:<6} {t['step_ms']:>8.3f} {t['host_ms']:>8.3f}")


if __name__ == "__main__":
    main()
