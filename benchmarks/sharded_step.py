#!/usr/bin/env python
"""The fused joiner + loss step on several GPUs, one process each, under FSDP2 or DDP, against the same step on one
GPU: weak scaling (every GPU the same batch).

    torchrun --nproc_per_node 8 benchmarks/sharded_step.py --mode fsdp --case protocol-a
    torchrun --nproc_per_node 8 benchmarks/sharded_step.py --mode ddp --case parakeet-tdt --json ddp.json
    torchrun --nproc_per_node 1 benchmarks/sharded_step.py --mode fsdp --case protocol-a   # one GPU
    torchrun --nproc_per_node 2 benchmarks/sharded_step.py --mode fsdp --device cpu        # gloo, tiny sizes

The step: the joiner's output Linear and the fused loss over it (fused_joiner_loss given the Linear's weight and
bias, reduction sum), forward under bf16 autocast on bf16 encoder and predictor outputs, and backward; the shapes of
fused_step.py's cases (fused_step.CASES, fused_step.batches): protocol-a, LibriSpeech train-clean-100 batches of 30,
512 -> 500, tanh; parakeet-tdt, Parakeet-TDT-0.6B's joint, B 16, T 375, U 100, 640 -> 8193 + 5 durations, relu.
Every rank takes the same batches. Contenders, timed on each batch in interleaved rounds:

    one GPU     the step on the rank's GPU alone: a copy of the Linear, not wrapped, no collectives
    FSDP2       --mode fsdp: fully_shard on the Linear (a unit of its own, whose forward never runs: the loss gathers
                its sharded weight and bias for the step and reduce-scatters their gradients, transducer/sharding.py),
                then on the root
    DDP         --mode ddp: DistributedDataParallel (the gradients all-reduced in backward)
    collectives the wrapped step's collectives alone at its sizes, on buffers made once: FSDP2's all-gathers of the
                weight's and bias's shards (fp32, padded to equal shards as DTensor pads them) and reduce-scatters of
                their gradients; DDP's all-reduce of each gradient

On each batch each contender runs once untimed, then --rounds rounds in which each runs once in turn, the first
rotating (as common.interleaved, so that a GPU whose clock falls slows all alike), every timed call after a barrier;
a call's time is the slowest rank's (CUDA events, common.cuda_call), and the figure is the mean over the batches of
each contender's minimum. Peak is the memory allocated during the step beyond what was allocated before it (the
largest of any rank); params, the memory of the rank's parameters (a 1/N shard under FSDP2). Printed: each figure,
the wrapped step against one GPU's (weak scaling: 1.00x is perfect) and the collectives' share of it.

--device cpu runs gloo on the CPU at tiny sizes, fp32, timed with the host's clock (no peak): it checks the script,
not the library. An exception on one rank (out of memory, say) stops the run.
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from bench import versions

# common first: it puts the repository root on sys.path
from common import cuda_call, gpu_clock
from fused_step import CASES, batches

from transducer import fused_joiner_loss
from transducer.fused.hopper_tiles import use_hopper
from transducer.lattices import kind_of
from transducer.options import LossOptions

ONE, COLLECTIVES = "one GPU", "collectives"
WRAPPED = {"fsdp": "FSDP2", "ddp": "DDP"}
TINY = {"protocol-a": (16, 10, None, "tanh"), "parakeet-tdt": (16, 9, [0, 1, 2, 3, 4], "relu")}  # J, V, durations


class Joint(torch.nn.Module):
    """The joiner's output Linear and the fused loss over it; the Linear's own forward never runs."""

    def __init__(self, J, V, durations, activation):
        super().__init__()
        self.out = torch.nn.Linear(J, V + len(durations or []))
        self.options = dict(activation=activation, blank=V - 1, reduction="sum")  # fused_step.py's blank: the last
        if durations:
            self.options.update(durations=durations, sigma=0.05)

    def forward(self, enc, pred, y, T, U):
        return fused_joiner_loss(enc, pred, self.out.weight, self.out.bias, y, T, U, **self.options)


def cpu_call(fn):
    """(ms, None) of one call of fn on the host's clock: common.cuda_call's figures on the CPU, without a peak."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3, None


def wrap(joint, mode, device):
    """``joint`` under FSDP2 (the Linear a unit of its own, then the root) or DDP."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(joint, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    fully_shard(joint.out)
    return fully_shard(joint)


def collectives(joint, mode, world, device):
    """The wrapped step's collectives at its sizes (the module docstring), on buffers made once."""
    ops = []
    for p in joint.parameters():
        if mode == "ddp":
            grad = torch.zeros(p.shape, device=device)
            ops.append(lambda grad=grad: dist.all_reduce(grad))
        else:
            rows = -(-p.size(0) // world)  # dim 0 as DTensor pads an uneven shard
            shard, full = (
                torch.zeros((rows, *p.shape[1:]), device=device),
                torch.zeros((rows * world, *p.shape[1:]), device=device),
            )
            ops.append(lambda shard=shard, full=full: dist.all_gather_into_tensor(full, shard))
            ops.append(lambda shard=shard, full=full: dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG))

    def run():
        for op in ops:
            op()

    return run


def contenders(shape, mode, world, device, dtype):
    """steps(batch) for a batch (T, U): {name: step()} of one GPU's step, the wrapped step and the collectives alone,
    on tensors made once for the batch."""
    J, V, durations, activation = shape
    torch.manual_seed(0)
    one = Joint(J, V, durations, activation).to(device)
    torch.manual_seed(0)
    wrapped = wrap(Joint(J, V, durations, activation).to(device), mode, device)
    comm = collectives(one, mode, world, device)

    def steps(batch):
        T, U = batch
        B = len(T)
        gen = torch.Generator().manual_seed(dist.get_rank())  # each rank its own values, every rank the same shapes
        Tt, Ut = torch.tensor(T).to(device), torch.tensor(U).to(device)
        y = torch.randint(0, V - 1, (B, int(U.max())), generator=gen).to(device)  # no blank
        enc = torch.randn(B, int(T.max()), J, generator=gen).to(device, dtype).requires_grad_()
        pred = torch.randn(B, int(U.max()) + 1, J, generator=gen).to(device, dtype).requires_grad_()

        def step(model):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = model(enc, pred, y, Tt, Ut)
            loss.backward()
            enc.grad = pred.grad = None
            model.zero_grad(set_to_none=True)

        return {ONE: lambda: step(one), WRAPPED[mode]: lambda: step(wrapped), COLLECTIVES: comm}

    return steps, {ONE: one, WRAPPED[mode]: wrapped}


def timed_rounds(shapes, steps, rounds, call, sync):
    """{name: (ms, peak MB or None)} of each contender over ``shapes`` (the module docstring): the mean over the
    batches of its minimum over the rounds of the slowest rank's time, and the largest peak of any rank."""
    times, peaks = {}, {}
    for batch in shapes:
        named = steps(batch)
        for step in named.values():  # untimed: compilation, the allocator's segments for the new shapes
            step()
        sync()
        per_round = {name: [] for name in named}
        for r in range(rounds):
            names = list(named)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                dist.barrier()
                ms, mb = call(named[name])
                per_round[name].append(ms)
                peaks[name] = None if mb is None else max(peaks.get(name) or 0.0, mb)
        for name, ms in per_round.items():
            times.setdefault(name, []).append(ms)
        del named
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (times, peaks))
    out = {}
    for name in times:
        slowest = np.max([np.array(t[name]) for t, _ in every], axis=0)  # (batches, rounds)
        rank_peaks = [p[name] for _, p in every]
        out[name] = (float(slowest.min(axis=1).mean()), None if None in rank_peaks else max(rank_peaks))
    return out


def params_mb(model):
    """The memory of this rank's part of ``model``'s parameters (a DTensor's local shard), MB."""
    return sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in model.parameters()) / 2**20


def run(case, mode, count, rounds, device):
    """The case's contenders timed over ``count`` batches; the figures as a dict (on every rank)."""
    world, cuda = dist.get_world_size(), device.type == "cuda"
    if cuda:
        J, V, durations, activation, _ = CASES[case]
        shapes = batches(case, count)
    else:
        J, V, durations, activation = TINY[case]
        shapes = [(np.array([6, 4]), np.array([3, 2]))] * count
    dtype = torch.bfloat16 if cuda else torch.float32
    hopper = use_hopper(kind_of(LossOptions(durations=tuple(durations or ()))), dtype, device, J)
    steps, models = contenders((J, V, durations, activation), mode, world, device, dtype)
    call, sync = (cuda_call, torch.cuda.synchronize) if cuda else (cpu_call, lambda: None)
    timed = timed_rounds(shapes, steps, rounds, call, sync)
    wrapped = timed[WRAPPED[mode]][0]
    return dict(
        case=case,
        mode=mode,
        world=world,
        backend=dist.get_backend(),
        precision="bf16" if cuda else "fp32",
        hopper=hopper,
        J=J,
        V=V,
        durations=durations,
        batches=count,
        rounds=rounds,
        rows=sum(int((T * (U + 1)).sum()) for T, U in shapes) // count,
        clock=gpu_clock() if cuda else None,
        contenders={
            name: dict(time_ms=ms, peak_mb=mb, params_mb=params_mb(models[name]) if name in models else None)
            for name, (ms, mb) in timed.items()
        },
        vs_one=wrapped / timed[ONE][0],
        collective_share=timed[COLLECTIVES][0] / wrapped,
    )


def table(r):
    """The figures of ``run`` as printed text."""
    where = f"{r['world']} GPUs" if r["backend"] == "nccl" else f"{r['world']} processes on the CPU"
    path = "" if r["backend"] != "nccl" else ", the Hopper kernels" if r["hopper"] else ", cuBLAS and the CUDA stages"
    lines = [
        f"{r['case']}, {WRAPPED[r['mode']]} on {where} ({r['backend']}), {r['precision']}{path}; "
        f"{r['batches']} batches of {r['rows']} rows on average, the same on every rank; the mean over the "
        f"batches of the minimum of {r['rounds']} interleaved rounds, the slowest rank's time; "
        f"clock {r['clock'] or '-'}",
        f"  {'contender':<14} {'ms':>9} {'vs one GPU':>11} {'peak MB':>9} {'params MB':>10}",
    ]
    one = r["contenders"][ONE]["time_ms"]
    for name, c in r["contenders"].items():
        peak = "-" if c["peak_mb"] is None else f"{c['peak_mb']:.0f}"
        params = "" if c["params_mb"] is None else f"{c['params_mb']:.3g}"
        vs = "" if name == COLLECTIVES else f"{c['time_ms'] / one:10.2f}x"
        lines.append(f"  {name:<14} {c['time_ms']:9.3f} {vs:>11} {peak:>9} {params:>10}")
    lines.append(
        f"  {WRAPPED[r['mode']]} step / one GPU's: {r['vs_one']:.2f}x; the collectives alone: "
        f"{100 * r['collective_share']:.0f}% of the {WRAPPED[r['mode']]} step"
    )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=list(WRAPPED), default="fsdp")
    p.add_argument("--case", choices=["protocol-a", "parakeet-tdt"], default="protocol-a")
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda: NCCL, one GPU a process; cpu: gloo, tiny sizes (checks the script)",
    )
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the figures here (rank 0)")
    a = p.parse_args()
    if "RANK" not in os.environ:
        p.error("run it under torchrun: torchrun --nproc_per_node N benchmarks/sharded_step.py ...")
    if a.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA GPU here (--device cpu runs gloo on the CPU)")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        if a.mode == "fsdp":
            p.error(f"--mode fsdp needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); this is {torch.__version__}")
    if device.type == "cuda":  # the rank's GPU named: NCCL's barrier then runs on it
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    try:
        result = run(a.case, a.mode, a.batches, a.rounds, device)
        if dist.get_rank() == 0:
            print(table(result), flush=True)
            if a.json:
                a.json.write_text(json.dumps(dict(versions(), results=[result]), indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
