#!/usr/bin/env python
"""The fused joiner + loss step against its floor, the four GEMMs it cannot avoid, and NeMo's Flash RNN-T.

    python benchmarks/fused_step.py                       # every case
    python benchmarks/fused_step.py --cases protocol-a     # some of them (protocol-a, flash, parakeet-tdt)
    python benchmarks/fused_step.py --profile             # and the kernels of one step of ours
    python benchmarks/fused_step.py --json F.json         # the figures as json too (bench.py's section F)

NeMo's Flash RNN-T joins where it imports (its folder first on PYTHONPATH, in a process of its own: it shadows
NeMo's numba losses; benchmarks/README.md).

The floor of a fused step over N = sum_b T_b (U_b + 1) rows, J -> V: the logits GEMM H W^T in forward and again in
backward's recompute, dH = G W and dW = G^T H, each timed alone with torch at the sizes the step runs (V padded as the
step pads it, the GEMMs' dtype). Where the step can run on the Hopper kernels (transducer/fused_hopper.py,
TRANSDUCER_HOPPER=1), it is timed there too, beside the default path, and its first step's time (the kernels'
compilation) is printed; --profile then profiles a step on the Hopper kernels. Floor and steps are timed in turns,
several rounds, and each one's minimum is kept: a GPU that heats up (an H100's SM clock falls from about 1.9 GHz to
under 1 GHz after a long run of GEMMs) slows both alike, and the clock is printed. A step is forward under the
precision's autocast and backward, on new tensors of the batch's shape; peak is the memory allocated during
it beyond its inputs.

Cases (bf16: autocast, the encoder and predictor outputs in bf16 or fp32; fp32: no autocast):
    protocol-a     LibriSpeech train-clean-100 batches of 30 (benchmarks/data), 512 -> 500, tanh
    flash          Flash RNN-T's own benchmark shape: B 32, T <= 400, U <= 128, 640 -> 1024, tanh
    parakeet-tdt   Parakeet-TDT-0.6B's joint: B 16, T 375, U 100, 640 -> 8193 + 5 durations, relu
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from common import cuda_call, gpu_clock  # first: common puts the repository root on sys.path
from transducer import fused_joiner_loss
from transducer.fused_hopper import use_hopper
from transducer.lattices import kind_of
from transducer.options import LossOptions

HERE = Path(__file__).resolve().parent
ROUNDS = 5


def padded_rows(rows):
    """The projection's rows as the fused step pads them (transducer/fused.py: _projection)."""
    return rows + next(p for p in (-rows % m for m in (128, 8)) if p <= 0.03 * rows or p < 8)


def floor_gemms(N, J, rows, dtype):
    """The four GEMMs of a fused step over N rows, J -> rows (padded as the step pads them), in ``dtype``."""
    Vp = padded_rows(rows)
    g = torch.Generator(device="cuda").manual_seed(0)
    H = torch.randn(N, J, device="cuda", dtype=dtype, generator=g)
    W = torch.randn(Vp, J, device="cuda", dtype=dtype, generator=g)
    G = torch.randn(N, Vp, device="cuda", dtype=dtype, generator=g)

    def run():
        torch.mm(H, W.t())
        torch.mm(H, W.t())
        torch.mm(G, W)
        torch.mm(G.t(), H)
    return run


class NemoLikeJoint(torch.nn.Module):
    """What Flash RNN-T reads of NeMo's RNNTJoint: identity projections, joint_net[-1] the output Linear."""

    def __init__(self, linear, activation):
        super().__init__()
        self.joint_net = torch.nn.ModuleList([linear])
        self.activation, self.dropout, self.masking_prob, self.num_extra_outputs = activation, 0.0, 0.0, 0
        self.num_classes_with_blank, self.log_softmax, self.temperature = linear.out_features, False, 1.0

    def project_encoder(self, x):
        return x

    def project_prednet(self, x):
        return x

    def is_adapter_available(self):
        return False


def flash_loss():
    """NeMo's Flash RNN-T (benchmarks/README.md, Peers), or None."""
    try:
        from nemo.collections.asr.losses.flash_rnnt import FlashRNNTLoss
        return FlashRNNTLoss
    except Exception as e:  # noqa: BLE001
        print(f"Flash RNN-T: not importable ({type(e).__name__}: {str(e)[:100]})")
        return None


def batches(case, count, seed=0):
    """(T, U) lists of ``count`` batches of the case."""
    rng = np.random.default_rng(seed)
    if case == "protocol-a":
        rows = np.loadtxt(HERE / "data" / "librispeech_train_clean_100_TU.csv", delimiter=",", skiprows=1,
                          dtype=np.int64)
        return [(rows[i * 30:(i + 1) * 30, 0], rows[i * 30:(i + 1) * 30, 1]) for i in range(count)]
    if case == "flash":
        return [(rng.integers(200, 401, 32), rng.integers(64, 129, 32)) for _ in range(count)]
    return [(np.full(16, 375), np.full(16, 100)) for _ in range(count)]


CASES = {  # J, token columns, durations, activation, precisions
    "protocol-a": (512, 500, None, "tanh", ("bf16", "bf16-fp32in", "fp32")),
    "flash": (640, 1024, None, "tanh", ("bf16", "fp32")),
    "parakeet-tdt": (640, 8193, [0, 1, 2, 3, 4], "relu", ("bf16",)),
}


def run_case(case, prec, count, profile, flash):
    J, V, durations, activation, _ = CASES[case]
    in_dtype = torch.float32 if prec != "bf16" else torch.bfloat16
    autocast = prec != "fp32"
    gemm_dtype = torch.bfloat16 if autocast else torch.float32
    rows = V + len(durations or [])
    blank = V - 1  # Flash RNN-T's blank is the last token column
    torch.manual_seed(0)
    linear = torch.nn.Linear(J, rows, device="cuda")
    joint = NemoLikeJoint(linear, activation)
    flash_mod = flash(blank=blank) if flash and not durations else None
    results = {}
    first_step = True
    for T, U in batches(case, count):
        B = len(T)
        N = int((T * (U + 1)).sum())
        Tt, Ut = torch.tensor(T, device="cuda"), torch.tensor(U, device="cuda")
        y = torch.randint(0, V - 1, (B, int(U.max())), device="cuda")
        enc = torch.randn(B, int(T.max()), J, device="cuda", dtype=in_dtype, requires_grad=True)
        pred = torch.randn(B, int(U.max()) + 1, J, device="cuda", dtype=in_dtype, requires_grad=True)
        options = dict(durations=durations, sigma=0.05) if durations else {}

        def ours(hopper="0"):
            def step():
                os.environ["TRANSDUCER_HOPPER"] = hopper
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = fused_joiner_loss(enc, pred, linear.weight, linear.bias, y, Tt, Ut, activation=activation,
                                             blank=blank, reduction="sum", **options)
                loss.backward()
                enc.grad = pred.grad = linear.weight.grad = linear.bias.grad = None
                os.environ["TRANSDUCER_HOPPER"] = "0"
            return step

        steps = {"floor (4 GEMMs)": floor_gemms(N, J, rows, gemm_dtype), "ours fused": ours()}
        os.environ["TRANSDUCER_HOPPER"] = "1"
        if use_hopper(kind_of(LossOptions(durations=tuple(durations or ()))), gemm_dtype, torch.device("cuda"), J):
            steps["ours fused, Hopper kernels"] = ours("1")
        os.environ["TRANSDUCER_HOPPER"] = "0"
        if flash_mod is not None:
            def flash_step():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = flash_mod(joint, enc, pred, y, Tt, Ut).sum()
                loss.backward()
                enc.grad = pred.grad = linear.weight.grad = linear.bias.grad = None
            steps["Flash RNN-T"] = flash_step
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()  # compile, allocate
            torch.cuda.synchronize()
            if name == "ours fused, Hopper kernels" and first_step:
                print(f"{case} {prec}: the first step on the Hopper kernels took {time.perf_counter() - t0:.1f} s "
                      f"(they compile)")
                first_step = False
        best = {name: (float("inf"), 0.0) for name in steps}
        for _ in range(ROUNDS):
            for name, fn in steps.items():
                ms, mb = cuda_call(fn)
                best[name] = (min(best[name][0], ms), max(best[name][1], mb))
        for name, (ms, mb) in best.items():
            r = results.setdefault(name, [0.0, 0.0, 0])
            r[0] += ms
            r[1] = max(r[1], mb)
            r[2] += N
        if profile:
            profiled = "ours fused, Hopper kernels" if "ours fused, Hopper kernels" in steps else "ours fused"
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                steps[profiled]()
                torch.cuda.synchronize()
            print(f"--- {case} {prec}: the kernels of one step ({profiled}), N = {N}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
            profile = False
        del enc, pred, steps
    floor = results["floor (4 GEMMs)"][0]
    rows_avg = results["floor (4 GEMMs)"][2] // count
    clock = gpu_clock()
    print(f"\n{case} {prec} ({count} batches, {rows_avg} rows a batch on average; clock {clock})")
    for name, (ms, mb, _) in results.items():
        print(f"  {name:<36} {ms / count:8.2f} ms  {ms / floor:5.2f}x floor  {mb:8.0f} MB")
    return dict(case=case, precision=prec, batches=count, rows=rows_avg, clock=clock, J=J, V=V,
                durations=durations, contenders={name: dict(time_ms=ms / count, peak_mb=mb)
                                                 for name, (ms, mb, _) in results.items()})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-flash", action="store_true")
    p.add_argument("--precisions", nargs="*", default=None, help="of each case's: bf16, bf16-fp32in, fp32")
    p.add_argument("--json", type=Path, help="write the figures here")
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, clock {gpu_clock()}")
    flash = None if a.no_flash else flash_loss()
    out = []
    for case in a.cases:
        for prec in CASES[case][4]:
            if a.precisions and prec not in a.precisions:
                continue
            out.append(run_case(case, prec, a.batches, a.profile, flash))
    if a.json:
        a.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), cases=out), indent=1))


if __name__ == "__main__":
    main()
