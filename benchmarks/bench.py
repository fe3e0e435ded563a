#!/usr/bin/env python
"""Speed and memory of the transducer loss beside its peers.

    python benchmarks/bench.py                 # everything this machine can run
    python benchmarks/bench.py --cpu-only      # only the CPU comparison
    python benchmarks/bench.py --out DIR       # write RESULTS.md, results.png, results.json to DIR
    python benchmarks/bench.py --from-json F   # re-render RESULTS.md / results.png from a raw json

Protocol A: training step (joiner + loss + backward) on LibriSpeech (T, U) batches; each contender's timed
step on a batch follows an untimed one on the same batch. Precisions: fp32; bf16 autocast with bf16 encoder
and predictor outputs; bf16 autocast with fp32 ones (a Conformer ending in a LayerNorm), ours only.
Protocol B: the loss alone at three shapes, against a copy-bandwidth floor.
F:          the fused joiner + loss step against its floor, its four GEMMs timed alone at the sizes it runs, in
            turns with it (benchmarks/fused_step.py, in a process of its own), and NeMo's Flash RNN-T beside it
            where --flash-rnnt names its folder.
scale:      one compact fp16 case with more than 2^31 logit elements.
CPU:        our CPU path against torchaudio's CPU loss.
Measurements go to results.json (raw); the rows are derived from it, so
--from-json re-renders exactly what a run printed. Only the text between
the bench:begin / bench:end markers of RESULTS.md is rewritten.
"""

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

A_BATCH, A_WARMUP, A_STEPS, A_WIDTH, A_VOCAB = 30, 3, 20, 512, 500
B_CASES = [(32, 150, 40, 500), (16, 400, 100, 1024), (8, 800, 100, 4096)]
B_WARMUP, B_REPS = 3, 10
SCALE_CASE = (8, 800, 100, 4096)  # every length at its max: 2.65e9 elements
CPU_CASES = [(4, 100, 20, 128), (8, 150, 40, 500)]
CPU_WARMUP, CPU_REPS = 1, 5
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

# Our variants: add a line to benchmark another option of TransducerLoss. step_only: a Protocol A variant only
# (inplace_grad writes the gradient over the logits, which must be an op's output: the joiner's, in a step).
OURS = [
    dict(name="ours compact", layout="compact", kwargs={}),
    dict(name="ours padded", layout="padded", kwargs={}),
    dict(name="ours compact no-check", layout="compact", kwargs={"check_inputs": False}),
    dict(name="ours compact inplace", layout="compact", kwargs={"inplace_grad": True}, step_only=True),
]
# Protocol A's precisions: the encoder and predictor outputs' dtype and the autocast dtype (None: no autocast)
PRECISIONS = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16-fp32in": (torch.float32, torch.bfloat16),
}
FP32_INPUTS = "bf16-fp32in"  # runs ours only (compact, fused, the joiner alone)


def log(msg):
    print(msg, flush=True)


def short_error(e):
    lines = [l for l in str(e).strip().splitlines() if l.strip()]
    return f"{type(e).__name__}: {lines[0][:160] if lines else ''}"


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- inputs


class Batch(SimpleNamespace):
    """Lengths and targets of one batch, in the dtypes each contender wants."""


def make_batch(Ts, Us, V, device, gen):
    Ts, Us = [int(t) for t in Ts], [int(u) for u in Us]
    B, maxU = len(Ts), max(Us)
    tgt = torch.randint(1, V, (B, max(maxU, 1)), generator=gen, dtype=torch.int64).to(device)
    T = torch.tensor(Ts, device=device)
    U = torch.tensor(Us, device=device)
    return Batch(
        Ts=Ts,
        Us=Us,
        B=B,
        maxT=max(Ts),
        maxU=maxU,
        V=V,
        T=T,
        U=U,
        tgt=tgt,
        T32=T.int(),
        U32=U.int(),
        tgt32=tgt.int(),
        labels_cat32=torch.cat([tgt[b, :u] for b, u in enumerate(Us)]).int(),
        N=sum(t * (u + 1) for t, u in zip(Ts, Us)),
    )


def draw_lengths(B, maxT, maxU, rng):
    """Lengths uniform in [0.7 max, max], the first utterance exactly at max."""
    Ts = rng.integers(math.ceil(0.7 * maxT), maxT + 1, B)
    Us = rng.integers(math.ceil(0.7 * maxU), maxU + 1, B)
    Ts[0], Us[0] = maxT, maxU
    return Ts, Us


def randn(shape, dtype, dev, gen):
    """Standard normal logits, filled in pieces of fewer than 2^31 elements."""
    x = torch.empty(shape, dtype=dtype, device=dev)
    for chunk in x.view(-1, shape[-1]).split(2**16):
        chunk.normal_(generator=gen)
    return x


def padded_to_compact(x, bt):
    return torch.cat([x[b, :t, : u + 1].reshape(-1, x.size(-1)) for b, (t, u) in enumerate(zip(bt.Ts, bt.Us))])


def torch_pack(enc, pred, T, U, N):
    """Plain-torch compact joiner input (rows b, t, u) for peers: enc[b, t] + pred[b, u]."""
    sizes = T * (U + 1)
    b = torch.repeat_interleave(torch.arange(len(T), device=enc.device), sizes, output_size=N)
    local = torch.arange(N, device=enc.device) - (torch.cumsum(sizes, 0) - sizes)[b]
    u1 = (U + 1)[b]
    return enc[b, local // u1] + pred[b, local % u1]


# ----------------------------------------------------------------------------- contenders


def ours_contenders(step=False):
    """Our variants; ``step``: Protocol A's (with the step-only ones)."""
    try:
        import transducer

        ok = None
    except Exception as e:
        ok = short_error(e)
    out = []
    for v in OURS:
        if v.get("step_only") and not step:
            continue
        c = dict(v, peer=False, error=ok, pack=None, loss=None)
        if ok is None:
            mod = transducer.TransducerLoss(blank=0, reduction="sum", **v["kwargs"])
            c["loss"] = lambda x, bt, mod=mod: mod(x, bt.tgt, bt.T, bt.U)
            c["pack"] = lambda enc, pred, bt: transducer.pack(enc, pred, bt.T, bt.U)
        out.append(c)
    return out


def fused_contender():
    """Protocol A only: joiner and loss fused (transducer.fused_joiner_loss), no logits in memory."""
    try:
        import transducer

        err = None
    except Exception as e:
        err = short_error(e)
    joiner_loss = lambda enc, pred, joiner, bt: transducer.fused_joiner_loss(  # noqa: E731
        enc, pred, joiner.weight, joiner.bias, bt.tgt, bt.T, bt.U, reduction="sum"
    )
    return dict(
        name="ours fused joiner", layout="compact", peer=False, error=err, joiner_loss=joiner_loss, loss=None, pack=None
    )


def k2_pruned_contender(width, vocab, dev):
    """Protocol A only: k2's pruned RNN-T (fast_rnnt), the step icefall trains with, at its defaults: an
    approximation of the loss (benchmarks/README.md), with its two extra Linear(D, V) projections."""
    try:
        import fast_rnnt
    except Exception as e:
        return dict(
            name="k2 pruned (approximate)",
            layout="compact",
            peer=True,
            error="not installed: " + short_error(e),
            loss=None,
            pack=None,
        )
    torch.manual_seed(2)
    am_proj, lm_proj = torch.nn.Linear(width, vocab).to(dev), torch.nn.Linear(width, vocab).to(dev)

    def joiner_loss(enc, pred, joiner, bt):
        boundary = torch.stack([torch.zeros_like(bt.T), torch.zeros_like(bt.T), bt.U, bt.T], 1).long()
        am, lm = am_proj(enc).float(), lm_proj(pred).float()
        simple, (px_grad, py_grad) = fast_rnnt.rnnt_loss_smoothed(
            lm=lm,
            am=am,
            symbols=bt.tgt,
            termination_symbol=0,
            lm_only_scale=0.25,
            am_only_scale=0.0,
            boundary=boundary,
            reduction="sum",
            return_grad=True,
        )
        ranges = fast_rnnt.get_rnnt_prune_ranges(px_grad=px_grad, py_grad=py_grad, boundary=boundary, s_range=5)
        am_p, lm_p = fast_rnnt.do_rnnt_pruning(am=enc, lm=pred, ranges=ranges)
        logits = joiner(torch.tanh(am_p + lm_p))
        pruned = fast_rnnt.rnnt_loss_pruned(
            logits=logits.float(),
            symbols=bt.tgt,
            ranges=ranges,
            termination_symbol=0,
            boundary=boundary,
            reduction="sum",
        )
        return 0.5 * simple + pruned

    return dict(
        name="k2 pruned (approximate)",
        layout="compact",
        peer=True,
        error=None,
        joiner_loss=joiner_loss,
        loss=None,
        pack=None,
    )


# Protocol A's step without the loss (pack + tanh + Linear, backward from logits.sum()): the part of the
# step that no loss implementation can remove, shown for information.
JOINER_ALONE = "joiner alone (no loss)"


def joiner_alone_contender():
    import transducer

    return dict(
        name=JOINER_ALONE,
        layout="compact",
        peer=False,
        error=None,
        pack=lambda enc, pred, bt: transducer.pack(enc, pred, bt.T, bt.U),
        loss=lambda x, bt: x.float().sum(),
    )


def peer_contenders(cuda):
    """torchaudio always; warp_rnnt and warprnnt_numba (NeMo) when importable (CUDA only)."""

    def pack(enc, pred, bt):
        return torch_pack(enc, pred, bt.T, bt.U, bt.N)

    out = []
    try:
        from torchaudio.functional import rnnt_loss as ta

        def ta_loss(x, bt):
            x = x if x.dtype in (torch.float32, torch.float16) else x.float()  # no bf16 in torchaudio
            return ta(x, bt.tgt32, bt.T32, bt.U32, blank=0, reduction="sum")

        out.append(dict(name="torchaudio", layout="padded", loss=ta_loss, error=None, max_numel=2**31 - 1))
    except Exception as e:
        out.append(dict(name="torchaudio", layout="padded", loss=None, error="not installed: " + short_error(e)))
    if cuda:
        try:
            import inspect

            import warp_rnnt

            if "compact" in inspect.signature(warp_rnnt.rnnt_loss).parameters:
                out.append(
                    dict(
                        name="warp_rnnt compact",
                        layout="compact",
                        error=None,
                        loss=lambda x, bt: warp_rnnt.rnnt_loss(
                            torch.log_softmax(x.float(), -1),
                            bt.labels_cat32,
                            bt.T32,
                            bt.U32,
                            reduction="sum",
                            compact=True,
                        ),
                    )
                )
            else:
                out.append(
                    dict(
                        name="warp_rnnt gather",
                        layout="padded",
                        error=None,
                        loss=lambda x, bt: warp_rnnt.rnnt_loss(
                            torch.log_softmax(x.float(), -1), bt.tgt32, bt.T32, bt.U32, reduction="sum", gather=True
                        ),
                    )
                )
        except Exception as e:
            out.append(dict(name="warp_rnnt", layout="padded", loss=None, error="not installed: " + short_error(e)))
        try:
            if not hasattr(np, "row_stack"):  # numpy 2.5 removed it; warprnnt_numba 0.4.1 still calls it
                np.row_stack = np.vstack
            try:
                from warprnnt_numba import RNNTLossNumba
            except ImportError:
                from nemo.collections.asr.parts.numba.rnnt_loss import RNNTLossNumba
            mod = RNNTLossNumba(blank=0, reduction="sum")
            out.append(
                dict(
                    name="warprnnt_numba",
                    layout="padded",
                    error=None,
                    loss=lambda x, bt: mod(x.float().contiguous(), bt.tgt32, bt.T32, bt.U32).sum(),
                )
            )
        except Exception as e:
            out.append(
                dict(name="warprnnt_numba", layout="padded", loss=None, error="not installed: " + short_error(e))
            )
    for c in out:
        c.update(peer=True, pack=pack)
    return out


# ----------------------------------------------------------------------------- timing and memory


def measure(fn, cuda):
    """Run fn() once: (result, ms, peak bytes during it, bytes allocated before it).

    On CUDA the time is taken with events on an idle stream, so host-side work and
    synchronisation inside fn count; peak is torch.cuda.max_memory_allocated after
    reset_peak_memory_stats, i.e. everything torch's allocator holds, inputs included."""
    if not cuda:
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3, None, None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    out = fn()
    e1.record()
    torch.cuda.synchronize()
    return out, e0.elapsed_time(e1), torch.cuda.max_memory_allocated(), base


def cupy_pool_mb():
    cp = sys.modules.get("cupy")
    try:
        return cp.get_default_memory_pool().total_bytes() / 2**20 if cp else 0.0
    except Exception:
        return 0.0


def loss_alone(cands, bt, warmup, reps, cuda):
    """Forward + backward of each (contender, logits) pair, round-robin over the pairs
    within each repetition so that drift hits everyone equally. Per contender: median
    ms, extra peak MB over what was allocated before, last loss; an exception drops
    that contender with an error record and the others go on."""
    recs = {c["name"]: dict(status="ok", times_ms=[], extras=[]) for c, _ in cands}
    for i in range(warmup + reps):
        for c, master in cands:
            r = recs[c["name"]]
            if r["status"] != "ok":
                continue
            if i == 0:
                log(f"  {c['name']} ...")
            x = master
            x.requires_grad_(True)
            x.grad = None

            def fn():
                l = c["loss"](x, bt)
                l.backward()
                return l.detach()

            try:
                loss, ms, peak, base = measure(fn, cuda)
                r["loss"] = float(loss.float().sum())
            except Exception as e:
                r.update(status="error", msg=short_error(e))
                log(f"  {c['name']}: {r['msg']}")
            x.grad = None
            x = fn = None  # freed (the closures above read them)
            if r["status"] == "ok" and i >= warmup:
                r["times_ms"].append(ms)
                r["extras"].append(peak - base if cuda else None)
    for name, r in recs.items():
        extras = r.pop("extras")
        if r["status"] == "ok":
            r.update(time_ms=statistics.median(r["times_ms"]), extra_mb=max(extras) / 2**20 if cuda else None)
            log(f"  {name}: {r['time_ms']:.2f} ms" + (f", extra {r['extra_mb']:.0f} MB" if cuda else ""))
    free()
    return recs


TOO_LARGE = "not run: crashes beyond 2^31 (known)"


def too_large(c, numel):
    return numel > c.get("max_numel", float("inf"))


def run_case(contenders, padded, compact, bt, warmup, reps, cuda):
    """Loss alone for every contender on the layout it takes; records in contender order."""
    out, cands = {}, []
    for c in contenders:
        master = compact if c["layout"] == "compact" else padded
        if c["error"]:
            out[c["name"]] = dict(status="error", msg=c["error"])
        elif too_large(c, master.numel()):
            out[c["name"]] = dict(status="not run", msg=TOO_LARGE)
            log(f"  {c['name']}: {TOO_LARGE}")
        else:
            out[c["name"]] = None
            cands.append((c, master))
    out.update(loss_alone(cands, bt, warmup, reps, cuda))
    return out


# ----------------------------------------------------------------------------- protocols


def copy_bandwidth(dev, n=2**28):
    """Copy of n floats (1 GiB) on dev: bytes read + written over the median time (GB/s)."""
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    ms = [measure(lambda: dst.copy_(src), dev == "cuda")[1] for _ in range(13)][3:]
    src = dst = None  # freed (the closures above read them)
    free()
    return 2 * 4 * n / (statistics.median(ms) * 1e-3) / 1e9


def protocol_a(args, dev):
    cuda = dev == "cuda"
    rows = np.loadtxt(HERE / "data" / "librispeech_train_clean_100_TU.csv", delimiter=",", skiprows=1, dtype=np.int64)
    nb, bs = args.a_warmup + args.a_steps, args.a_batch
    batches = [rows[i * bs : (i + 1) * bs] for i in range(nb)]
    res = dict(batch=bs, warmup=args.a_warmup, steps=args.a_steps, width=args.a_width, vocab=args.a_vocab)
    everyone = ours_contenders(step=True) + [fused_contender()] + peer_contenders(cuda) + [joiner_alone_contender()]
    if cuda:
        everyone.append(k2_pruned_contender(args.a_width, args.a_vocab, dev))
    for prec in args.a_precisions:
        dtype, autocast = PRECISIONS[prec]
        contenders = (
            everyone
            if prec != FP32_INPUTS
            else [c for c in everyone if c["name"] in ("ours compact", "ours fused joiner", JOINER_ALONE)]
        )
        log(f"[A {prec}] {len(batches)} batches of {bs}, contenders: " + ", ".join(c["name"] for c in contenders))
        torch.manual_seed(0)
        joiner = torch.nn.Linear(args.a_width, args.a_vocab).to(dev)
        gen = torch.Generator().manual_seed(1)
        rec = {
            c["name"]: dict(status="ok", times_ms=[], peaks_mb=[], base_mb=[], losses=[], cupy_mb=0.0)
            for c in contenders
        }
        for c in contenders:
            if c["error"]:
                rec[c["name"]] = dict(
                    status="not installed" if c["error"].startswith("not installed") else "error", msg=c["error"]
                )
        for i, bt_rows in enumerate(batches):
            bt = make_batch(bt_rows[:, 0], bt_rows[:, 1], args.a_vocab, dev, gen)
            enc = torch.randn(bt.B, bt.maxT, args.a_width, generator=gen).to(dev, dtype).requires_grad_()
            pred = torch.randn(bt.B, bt.maxU + 1, args.a_width, generator=gen).to(dev, dtype).requires_grad_()
            order = contenders[i % len(contenders) :] + contenders[: i % len(contenders)]
            line = []
            for c in order:
                r = rec[c["name"]]
                if r["status"] != "ok":
                    continue
                if too_large(c, bt.B * bt.maxT * (bt.maxU + 1) * args.a_vocab):
                    r.update(status="not run", msg=TOO_LARGE)
                    continue
                if i == 0:
                    log(f"[A {prec}] first step of {c['name']} ...")

                def step():
                    with torch.autocast(dev, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                        if c.get("joiner_loss"):
                            loss = c["joiner_loss"](enc, pred, joiner, bt)
                        else:
                            h = (
                                c["pack"](enc, pred, bt)
                                if c["layout"] == "compact"
                                else enc[:, :, None] + pred[:, None]
                            )
                            loss = c["loss"](joiner(torch.tanh(h)), bt)
                    loss.backward()
                    return loss.detach()

                try:
                    # an untimed step on the batch first: a contender's first step on new shapes, between
                    # contenders of very different footprints, paid the allocator's new segments (synchronous
                    # cudaMalloc), 2x on some steps (DESIGN.md: Warm the allocator before timing a step); a
                    # training loop's allocator is warm
                    step()
                    enc.grad = pred.grad = None
                    joiner.zero_grad(set_to_none=True)
                    loss, ms, peak, base = measure(step, cuda)
                except Exception as e:
                    r.update(status="error", msg=short_error(e))
                    line.append(f"{c['name']} ERROR")
                    free()
                    continue
                finally:
                    enc.grad = pred.grad = None
                    joiner.zero_grad(set_to_none=True)
                if i >= args.a_warmup:
                    r["times_ms"].append(ms)
                    r["losses"].append(float(loss.float()))
                    if cuda:
                        r["peaks_mb"].append(peak / 2**20)
                        r["base_mb"].append(base / 2**20)
                        r["cupy_mb"] = max(r["cupy_mb"], cupy_pool_mb())
                line.append(f"{c['name']} {ms:.1f} ms" + (f" {peak / 2**20:.0f} MB" if cuda else ""))
            log(f"[A {prec}] batch {i + 1}/{nb} {'(warm-up) ' if i < args.a_warmup else ''}" + " | ".join(line))
            enc = pred = bt = None  # freed (the closures above read them)
            gc.collect()  # no empty_cache: the allocator stays warm, as in training
        for r in rec.values():
            if r["status"] == "ok" and r["times_ms"]:
                r["time_ms"] = statistics.fmean(r["times_ms"])
                r["peak_mb"] = max(r["peaks_mb"]) if r["peaks_mb"] else None
        res[prec] = rec
    return res


def protocol_b(args, dev):
    cuda = dev == "cuda"
    bw = copy_bandwidth(dev, args.copy_elems)
    log(f"[B] copy bandwidth {bw:.0f} GB/s (read + write)")
    res = dict(copy_gbps=bw, copy_bytes=2 * 4 * args.copy_elems, warmup=B_WARMUP, reps=B_REPS, cases=[])
    contenders = [c for c in ours_contenders() + peer_contenders(cuda) if not c["peer"] or c["name"] == "torchaudio"]
    rng = np.random.default_rng(2)
    gen = torch.Generator(device=dev).manual_seed(3)
    for k, (B, maxT, maxU, V) in enumerate(args.b_cases):
        Ts, Us = draw_lengths(B, maxT, maxU, rng)
        bt = make_batch(Ts, Us, V, dev, torch.Generator().manual_seed(k))
        for dn in args.b_dtypes:
            dt = DTYPES[dn]
            item = torch.finfo(dt).bits // 8
            floor_ms = 3 * bt.N * V * item / (bw * 1e9) * 1e3
            case = dict(
                shape=[B, maxT, maxU, V],
                dtype=dn,
                N=bt.N,
                floor_ms=floor_ms,
                contenders={},
                grad_mb=dict(compact=bt.N * V * item / 2**20, padded=B * maxT * (maxU + 1) * V * item / 2**20),
            )
            log(
                f"[B] case {k + 1}/{len(args.b_cases)} {(B, maxT, maxU, V)} {dn}: sum TU = {bt.N}, floor {floor_ms:.3f} ms"
            )
            padded = randn((B, maxT, maxU + 1, V), dt, dev, gen)
            compact = padded_to_compact(padded, bt)
            case["contenders"] = run_case(contenders, padded, compact, bt, B_WARMUP, B_REPS, cuda)
            res["cases"].append(case)
            del padded, compact
            free()
    return res


def protocol_scale(args, dev, bw):
    cuda = dev == "cuda"
    B, maxT, maxU, V = args.scale_case
    bt = make_batch([maxT] * B, [maxU] * B, V, dev, torch.Generator().manual_seed(5))
    elems = bt.N * V
    log(f"[scale] compact fp16 {tuple(args.scale_case)}: {elems / 1e9:.2f}e9 logit elements (2^31 = 2.15e9)")
    res = dict(
        shape=list(args.scale_case),
        dtype="fp16",
        N=bt.N,
        elements=elems,
        floor_ms=3 * elems * 2 / (bw * 1e9) * 1e3,
        grad_mb=elems * 2 / 2**20,
    )
    c = ours_contenders()[0]
    if c["error"]:
        res["ours"] = dict(status="error", msg=c["error"])
        return res
    try:
        x = randn((bt.N, V), torch.float16, dev, torch.Generator(device=dev).manual_seed(6))
    except Exception as e:
        res["ours"] = dict(status="error", msg=short_error(e))
        return res
    res["ours"] = loss_alone([(c, x)], bt, 1, 3, cuda)[c["name"]]
    del x
    free()
    return res


def protocol_cpu(args):
    torch.manual_seed(0)
    rng = np.random.default_rng(7)
    res = dict(threads=torch.get_num_threads(), warmup=CPU_WARMUP, reps=CPU_REPS, cases=[])
    contenders = ours_contenders() + peer_contenders(False)
    for k, (B, maxT, maxU, V) in enumerate(args.cpu_cases):
        Ts, Us = draw_lengths(B, maxT, maxU, rng)
        bt = make_batch(Ts, Us, V, "cpu", torch.Generator().manual_seed(k))
        padded = torch.randn(B, maxT, maxU + 1, V)
        compact = padded_to_compact(padded, bt)
        case = dict(shape=[B, maxT, maxU, V], dtype="fp32", N=bt.N, contenders={})
        log(f"[CPU] case {(B, maxT, maxU, V)} fp32, {torch.get_num_threads()} threads")
        case["contenders"] = run_case(contenders, padded, compact, bt, CPU_WARMUP, CPU_REPS, False)
        res["cases"].append(case)
    return res


# ----------------------------------------------------------------------------- evaluation


def ok_time(r):
    return r["time_ms"] if r and r.get("status") == "ok" and r.get("time_ms") is not None else None


def row(section, case, name, r, mem="", vs="", pt=None, pm=None):
    """One table line; pt / pm are the numbers the chart draws (time-like, memory-like)."""
    status = r.get("status", "ok") if r else "missing"
    if status != "ok":
        return dict(
            section=section,
            case=case,
            contender=name,
            time="",
            mem="",
            vs=r.get("msg", status) if r else status,
            pt=None,
            pm=None,
        )
    return dict(section=section, case=case, contender=name, time=f"{r['time_ms']:.2f}", mem=mem, vs=vs, pt=pt, pm=pm)


def rows_a(sec):
    out = []
    for prec in PRECISIONS:
        rec = sec.get(prec)
        if not rec:
            continue
        ta = rec.get("torchaudio")
        t_ta = ok_time(ta)
        for name, r in rec.items():
            t = ok_time(r)
            mem = f"peak {r['peak_mb']:.0f} MB (inputs {max(r['base_mb']):.0f})" if t and r.get("peak_mb") else ""
            if t and r.get("cupy_mb"):
                mem += f" +cupy pool {r['cupy_mb']:.0f}"
            vs = f"{t / t_ta:.2f}x torchaudio time" if t and t_ta else ""
            if t and t_ta and r.get("losses") and ta.get("losses"):
                d = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(r["losses"], ta["losses"]))
                vs += f", loss rel diff {d:.1e}"
            out.append(
                row(
                    f"A {prec}",
                    f"{sec['steps']} batches of {sec['batch']}",
                    name,
                    r,
                    mem,
                    vs,
                    t,
                    r.get("peak_mb") if t else None,
                )
            )
    return out


def rows_b(sec):
    out = []
    for case in sec["cases"]:
        ta = case["contenders"].get("torchaudio")
        for name, r in case["contenders"].items():
            t = ok_time(r)
            grad = case["grad_mb"]["padded" if name == "torchaudio" or "padded" in name else "compact"]
            ratio = t / case["floor_ms"] if t else None
            mratio = r["extra_mb"] / grad if t and r.get("extra_mb") is not None else None
            mem = f"extra {r['extra_mb']:.0f} MB = {mratio:.2f}x grad {grad:.0f}" if mratio is not None else ""
            vs = f"{ratio:.2f}x floor {case['floor_ms']:.2f} ms" if ratio else ""
            if t and ok_time(ta) and name != "torchaudio":
                vs += f", loss rel diff {abs(r['loss'] - ta['loss']) / abs(ta['loss']):.1e}"
            out.append(row("B", f"{tuple(case['shape'])} {case['dtype']}", name, r, mem, vs, ratio, mratio))
    return out


def rows_scale(sec):
    r, case = sec.get("ours", {}), f"{tuple(sec['shape'])} fp16 compact, {sec['elements'] / 1e9:.2f}e9 elem"
    t = ok_time(r)
    mem = (
        f"extra {r['extra_mb']:.0f} MB = {r['extra_mb'] / sec['grad_mb']:.2f}x grad" if t and r.get("extra_mb") else ""
    )
    vs = f"{t / sec['floor_ms']:.2f}x floor {sec['floor_ms']:.2f} ms" if t else ""
    if t:
        vs += f", loss {r['loss']:.6g}" + ("" if math.isfinite(r["loss"]) else " (not finite)")
    return [
        row("scale", case, "ours compact", r, mem, vs),
        dict(section="scale", case=case, contender="torchaudio", time="", mem="", pt=None, pm=None, vs=TOO_LARGE),
    ]


def rows_cpu(sec):
    out = []
    for case in sec["cases"]:
        t_ta = ok_time(case["contenders"].get("torchaudio"))
        for name, r in case["contenders"].items():
            t = ok_time(r)
            vs = f"{t / t_ta:.2f}x torchaudio" if t and t_ta else ""
            out.append(row("CPU", f"{tuple(case['shape'])} fp32", name, r, "", vs, t))
    return out


def protocol_f(args):
    """benchmarks/fused_step.py's cases in a process of its own (Flash RNN-T shadows NeMo's numba losses)."""
    out = args.out / "fused_step.json"
    env = dict(os.environ)
    if args.flash_rnnt:
        env["PYTHONPATH"] = os.pathsep.join([str(args.flash_rnnt)] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, str(HERE / "fused_step.py"), "--json", str(out), "--batches", str(args.f_batches)]
    if not args.flash_rnnt:
        cmd.append("--no-flash")
    log(f"[F] {' '.join(cmd)}")
    subprocess.run(cmd, env=env, check=True)
    return json.loads(out.read_text())


def rows_f(sec):
    out = []
    for c in sec["cases"]:
        floor = c["contenders"]["floor (4 GEMMs)"]["time_ms"]
        flash = c["contenders"].get("Flash RNN-T", {}).get("time_ms")
        name = f"{c['case']} {c['precision']}, {c['rows']} rows, {c['J']} -> {c['V']}" + (
            f" + {len(c['durations'])}" if c.get("durations") else ""
        )
        for who, r in c["contenders"].items():
            t = r["time_ms"]
            vs = f"{t / floor:.2f}x floor"
            if who == "ours fused" and flash:
                vs += f", {flash / t:.2f}x faster than Flash RNN-T"
            out.append(
                row("F", name, who, dict(r, status="ok"), f"peak {r['peak_mb']:.0f} MB", vs, t / floor, r["peak_mb"])
            )
    return out


def build_rows(res):
    s = res["sections"]
    return (
        (rows_a(s["A"]) if "A" in s else [])
        + (rows_f(s["F"]) if "F" in s else [])
        + (rows_b(s["B"]) if "B" in s else [])
        + (rows_scale(s["scale"]) if "scale" in s else [])
        + (rows_cpu(s["CPU"]) if "CPU" in s else [])
    )


# ----------------------------------------------------------------------------- output

COLS = [
    ("section", "section"),
    ("case", "case"),
    ("contender", "contender"),
    ("time", "time ms"),
    ("mem", "memory"),
    ("vs", "vs"),
]


def text_table(rows):
    w = {k: max([len(h)] + [len(str(r[k])) for r in rows]) for k, h in COLS}
    lines = ["  ".join(h.ljust(w[k]) for k, h in COLS)]
    lines += ["  ".join(str(r[k]).ljust(w[k]) for k, _ in COLS) for r in rows]
    return "\n".join(l.rstrip() for l in lines)


def md_block(res, rows):
    lines = [BEGIN, "", "_Generated by `benchmarks/bench.py`; edit outside the markers only._", ""]
    metas = {}
    for name, sec in res["sections"].items():
        m = sec["meta"]
        metas.setdefault(
            f"{m['date']}, {m['device']}; torch {m['torch']}, torchaudio {m['torchaudio']}, cupy {m['cupy']}, "
            f"warp_rnnt {m['warp_rnnt']}, numba {m['numba']}, python {m['python']}, tf32 matmul {m.get('tf32')}; commit {m['commit']}",
            [],
        ).append(name)
    lines += [f"- **{', '.join(names)}**: {m}" for m, names in metas.items()]
    if "B" in res["sections"]:
        b = res["sections"]["B"]
        lines.append(
            f"- copy bandwidth ({b.get('copy_bytes', 2**31) / 2**30:.2f} GiB read + written by one "
            f"device-to-device copy): {b['copy_gbps']:.0f} GB/s"
        )
    lines += ["", "| " + " | ".join(h for _, h in COLS) + " |", "|" + "---|" * len(COLS)]
    lines += ["| " + " | ".join(str(r[k]).replace("|", "/") for k, _ in COLS) + " |" for r in rows]
    lines += [
        "",
        "How to read it:",
        "- A: mean step time over the timed batches (CUDA events around joiner + loss(sum) + backward); "
        "peak = max over steps of torch.cuda.max_memory_allocated after reset_peak_memory_stats. It includes the "
        "inputs already resident (joiner weights, encoder/predictor outputs, targets: the 'inputs' figure) and "
        "everything the step allocates (joiner activations, logits, loss workspace, gradients of logits, "
        "encoder/predictor outputs and weights); it excludes CuPy's own memory pool (shown as +cupy pool when used) "
        "and memory cached but free. bf16 runs take bf16 encoder/predictor outputs under autocast, bf16-fp32in "
        "runs fp32 ones (ours only); peers without bf16 get logits cast to fp32. Padded paths build the joiner "
        "over (B, maxT, maxU+1, 512). Peers' compact "
        "input comes from a plain-torch gather.",
        "- F: the fused step (forward under the precision's autocast and backward) against its floor, the four "
        "GEMMs it cannot avoid (the logits in forward and again in backward's recompute, dH and dW) timed alone "
        "at its sizes; floor and steps in turns, each one's minimum over the rounds, summed over the batches "
        "(benchmarks/fused_step.py). Peak: memory allocated during the step beyond its inputs.",
        "- B: median of the timed fwd+bwd runs; floor = 3 passes over the valid logits at the measured copy "
        "bandwidth; extra = peak during fwd+bwd minus memory allocated before (logits already resident), so it "
        "includes the gradient itself; grad = size of the layout's gradient.",
        "- loss rel diff: against torchaudio on the same inputs (a cross-check).",
        "- CPU: wall-clock median of fwd+bwd.",
        "",
        END,
    ]
    return "\n".join(lines)


TEMPLATE = """# Benchmark results

`benchmarks/bench.py` rewrites only the block between the bench:begin and bench:end
markers below. Write notes (floors, predictions, measurements of each optimisation)
outside it: they are kept.

## Notes and history

## Latest run

{BEGIN}
{END}
"""


def write_md(path, block, seed):
    text = (
        path.read_text()
        if path.exists()
        else seed.read_text()
        if seed.exists()
        else TEMPLATE.replace("{BEGIN}", BEGIN).replace("{END}", END)
    )
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        text = text.rstrip() + "\n\n" + block + "\n"
    else:
        text = text[:i] + block + text[j + len(END) :]
    path.write_text(text)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        log(f"no chart: {short_error(e)}")
        return
    panels = [
        ("A", "pt", "A: step time (ms)", None),
        ("A", "pm", "A: peak memory (MB)", None),
        ("CPU", "pt", "CPU: fwd+bwd (ms)", None),
        ("B", "pt", "B: fwd+bwd time / floor", 1.0),
        ("B", "pm", "B: extra peak memory / gradient size", 1.05),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    axes = axes.ravel()
    for ax, (sec, key, title, line) in zip(axes, panels):
        sel = [r for r in rows if r["section"].startswith(sec) and r[key] is not None]
        group = (lambda r: r["section"]) if sec == "A" else (lambda r: r["case"])
        groups = list(dict.fromkeys(group(r) for r in sel))
        names = list(dict.fromkeys(r["contender"] for r in sel))
        width = 0.8 / max(len(names), 1)
        for j, n in enumerate(names):
            vals = {group(r): r[key] for r in sel if r["contender"] == n}
            ax.bar([i + j * width for i in range(len(groups))], [vals.get(g, 0.0) for g in groups], width, label=n)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
        if line:
            ax.axhline(line, color="k", lw=0.8, ls="--")
        ax.set_title(title)
        if names:
            ax.legend(fontsize=8)
    axes[-1].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log(f"wrote {path}")


def versions():
    def ver(mod):
        try:
            return __import__(mod).__version__
        except Exception:
            return "not installed"

    try:  # the device machine gets a copy of the tree without .git: BENCH_COMMIT names it
        commit = (
            os.environ.get("BENCH_COMMIT")
            or subprocess.run(
                ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except Exception:
        commit = "unknown"
    dev = (
        (torch.cuda.get_device_name() + f", CUDA {torch.version.cuda}")
        if torch.cuda.is_available()
        else f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        device=dev,
        torch=torch.__version__,
        torchaudio=ver("torchaudio"),
        cupy=ver("cupy"),
        warp_rnnt=ver("warp_rnnt"),
        numba=ver("numba"),
        python=platform.python_version(),
        commit=commit,
        tf32=bool(torch.backends.cuda.matmul.allow_tf32),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE, help="where RESULTS.md, results.png, results.json go")
    ap.add_argument("--cpu-only", action="store_true", help="only the CPU comparison")
    ap.add_argument("--only", default="", help="comma list of sections to run: A,F,B,scale,CPU")
    ap.add_argument("--from-json", type=Path, help="render RESULTS.md / results.png from this raw json, run nothing")
    ap.add_argument("--a-batch", type=int, default=A_BATCH)
    ap.add_argument("--a-warmup", type=int, default=A_WARMUP)
    ap.add_argument("--a-steps", type=int, default=A_STEPS)
    ap.add_argument("--a-width", type=int, default=A_WIDTH)
    ap.add_argument("--a-vocab", type=int, default=A_VOCAB)
    ap.add_argument("--a-precisions", default=",".join(PRECISIONS))
    ap.add_argument("--b-dtypes", default="fp32,fp16")
    ap.add_argument("--f-batches", type=int, default=4, help="F: batches of each case")
    ap.add_argument("--flash-rnnt", type=Path, help="F: the folder that holds NeMo's Flash RNN-T (its nemo package)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, every section, on CUDA if present else CPU: checks the script, not the library",
    )
    args = ap.parse_args()
    args.a_precisions, args.b_dtypes = args.a_precisions.split(","), args.b_dtypes.split(",")
    args.b_cases, args.scale_case, args.cpu_cases, args.copy_elems = B_CASES, SCALE_CASE, CPU_CASES, 2**28
    if args.smoke:
        args.a_batch, args.a_warmup, args.a_steps, args.a_width, args.a_vocab = 3, 1, 2, 16, 12
        args.b_cases, args.scale_case, args.cpu_cases = [(3, 20, 5, 10), (2, 30, 6, 16)], (2, 10, 4, 8), [(2, 12, 3, 7)]
        args.copy_elems = 2**20
    args.out.mkdir(parents=True, exist_ok=True)
    jpath = args.out / "results.json"
    try:
        old = json.loads(jpath.read_text()) if jpath.exists() else {"sections": {}}
    except ValueError:
        old = {"sections": {}}

    if args.from_json:
        new = json.loads(args.from_json.read_text())
    else:
        cuda = torch.cuda.is_available() and not args.cpu_only
        dev = "cuda" if cuda else "cpu" if args.smoke else None
        want = {s.strip() for s in args.only.split(",") if s.strip()} or (
            {"CPU"} if args.cpu_only else {"A", "F", "B", "scale", "CPU"} if dev else {"CPU"}
        )
        if want - {"A", "F", "B", "scale", "CPU"}:
            ap.error(f"--only: unknown sections {sorted(want - {'A', 'F', 'B', 'scale', 'CPU'})}")
        if not dev and want - {"CPU"}:
            log(f"no CUDA device: skipping {sorted(want - {'CPU'})}")
        meta, new, t0 = versions(), {"sections": {}}, time.perf_counter()
        log(f"bench: {meta}")
        secs = new["sections"]
        if dev and "A" in want:
            secs["A"] = protocol_a(args, dev)
        if cuda and "F" in want and not args.smoke:
            secs["F"] = protocol_f(args)
        if dev and ("B" in want or "scale" in want):
            secs["B"] = protocol_b(args, dev) if "B" in want else dict(copy_gbps=copy_bandwidth(dev), cases=[])
            if "scale" in want:
                secs["scale"] = protocol_scale(args, dev, secs["B"]["copy_gbps"])
            if "B" not in want:
                del secs["B"]
        if "CPU" in want:
            secs["CPU"] = protocol_cpu(args)
        for s in secs.values():
            s["meta"] = meta
        log(f"bench: {time.perf_counter() - t0:.0f} s")
    # sections not run this time keep their figures from the json already in --out
    merged = {"sections": {**old.get("sections", {}), **new["sections"]}}
    order = ["A", "F", "B", "scale", "CPU"]
    merged["sections"] = {k: merged["sections"][k] for k in order if k in merged["sections"]}
    rows = build_rows(merged)
    print(text_table(rows), flush=True)
    jpath.write_text(json.dumps(merged, indent=1))
    write_md(args.out / "RESULTS.md", md_block(merged, rows), HERE / "RESULTS.md")
    plot(rows, args.out / "results.png")
    log(f"wrote {jpath} and {args.out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
