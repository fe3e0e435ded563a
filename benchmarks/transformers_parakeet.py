"""transformers' Parakeet RNN-T and TDT trained on this library (transducer.integrations.transformers), on a GPU.

(a) A tiny random ParakeetForRNNT / ParakeetForTDT, one training step (forward + backward, fp32): with
    transformers' own loss, with ours (apply(model, fused=False)) and fused (apply(model)).
(b) Parakeet-0.6B's joint and TDT loss (vocabulary 8192 + blank, durations 0-4, joint width 640, 2-layer LSTM
    decoder, 375 encoder frames, 100 tokens, bf16 autocast), B = 4 to 32: the model's forward from given encoder
    outputs (its own path materialises (B, T, U+1, 8198) logits) with transformers' loss (up to
    --transformers-max-batch), with ours, and fused.

Time: CUDA events, two warm-up steps then the mean of 2 to 10 steps (about half a second); memory:
torch.cuda.max_memory_allocated over the measured steps, and the part of it above what was allocated before them.
Prints markdown tables and writes the figures as JSON to --out.

    python benchmarks/transformers_parakeet.py --out parakeet.json      # GPU, about 75 s on an H100
    python benchmarks/transformers_parakeet.py --smoke                  # tiny sizes, CPU, seconds
"""

import argparse
import copy
import gc
import json
import platform
import time

import torch
import transformers
from transformers import ParakeetForRNNT, ParakeetForTDT, ParakeetRNNTConfig, ParakeetTDTConfig
from transformers.models.parakeet.modeling_parakeet import ParakeetEncoderModelOutput

from transducer.integrations.transformers import apply

PATHS = ["transformers", "ours", "fused"]


def encoder_config(hidden_size, num_mel_bins):
    return dict(
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=4 * hidden_size,
        num_mel_bins=num_mel_bins,
        subsampling_factor=4,
        subsampling_conv_channels=16,
        conv_kernel_size=9,
        dropout=0.0,
        dropout_positions=0.0,
        layerdrop=0.0,
        activation_dropout=0.0,
        attention_dropout=0.0,
    )


def make_model(kind, vocab_size, decoder_hidden_size, num_decoder_layers, encoder):
    options = dict(
        encoder_config=encoder,
        vocab_size=vocab_size,
        decoder_hidden_size=decoder_hidden_size,
        num_decoder_layers=num_decoder_layers,
        blank_token_id=vocab_size - 1,
        pad_token_id=0,
        hidden_act="relu",
    )
    if kind == "rnnt":
        return ParakeetForRNNT(ParakeetRNNTConfig(**options))
    return ParakeetForTDT(ParakeetTDTConfig(durations=[0, 1, 2, 3, 4], **options))


def variant(base, path, device):
    """A copy of the model on device (the only one there while it is measured) with transformers' loss, ours, or
    ours fused with the joint."""
    model = copy.deepcopy(base)
    if path != "transformers":
        apply(model, fused=path == "fused")
    return model.to(device).train()


def labels_batch(gen, B, U, vocab_size):
    """Labels of U tokens (no padding: each model counts them whatever its pad) and the decoder input."""
    labels = torch.randint(1, vocab_size - 1, (B, U), generator=gen)
    return labels, torch.cat([torch.full((B, 1), vocab_size - 1), labels], 1)


class Timer:
    """Mean milliseconds of a step after warm-up, over as many steps as fit in about `budget` seconds (2 to 10);
    on CUDA the peak memory of the measured steps (max_memory_allocated) and the part of it above what was
    allocated before them (the step's own: activations, logits, gradients)."""

    def __init__(self, device, warmup=2, budget=0.5):
        self.device, self.warmup, self.budget = device, warmup, budget

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self, step):
        for _ in range(self.warmup):
            self.sync()
            start = time.perf_counter()
            step()
            self.sync()
        steps = max(2, min(10, int(self.budget / (time.perf_counter() - start))))
        gc.collect()
        if self.device.type != "cuda":
            start = time.perf_counter()
            for _ in range(steps):
                step()
            return (time.perf_counter() - start) * 1e3 / steps, None, None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return begin.elapsed_time(end) / steps, peak / 2**20, (peak - resident) / 2**20


def measure(timer, step):
    """Time and memory of a step, or None and the reason when it runs out of memory."""
    try:
        ms, peak, own = timer(step)
        return dict(ms=ms, peak_mib=peak, step_mib=own)
    except torch.cuda.OutOfMemoryError:
        return dict(ms=None, peak_mib=None, step_mib=None, note="out of memory")
    finally:
        gc.collect()
        if timer.device.type == "cuda":
            torch.cuda.empty_cache()


def measure_path(base, path, device, timer, batches):
    """Time each batch's training step (forward + backward) with the model of this path, the only one on device;
    batches: (inputs, autocast) pairs."""
    model = variant(base, path, device)
    rows = []
    for inputs, autocast in batches:
        if inputs is None:  # not run
            rows.append({"ms": None, "peak_mib": None, "step_mib": None, "note": "not run"})
            continue

        def step(inputs=inputs, autocast=autocast):
            model.zero_grad(set_to_none=True)
            for value in inputs.values():  # the given encoder outputs' gradient
                if isinstance(value, ParakeetEncoderModelOutput):
                    value.pooler_output.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                out = model(**inputs)
            out.loss.backward()

        rows.append(measure(timer, step))
    return rows


def tiny_models(args, device, timer):
    """(a) One training step of a tiny random model, each loss path (fp32)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for kind in ("rnnt", "tdt"):
        torch.manual_seed(0)
        base = make_model(kind, args.tiny_vocab, 64, 1, encoder_config(64, 32))
        B, frames, U = args.tiny_batch, args.tiny_frames, args.tiny_labels
        labels, decoder_input_ids = labels_batch(gen, B, U, args.tiny_vocab)
        batch = dict(
            input_features=torch.randn(B, frames, 32, generator=gen),
            attention_mask=torch.ones(B, frames, dtype=torch.long),
            labels=labels,
            decoder_input_ids=decoder_input_ids,
        )
        batch = {k: v.to(device) for k, v in batch.items()}
        for path in PATHS:
            [row] = measure_path(base, path, device, timer, [(batch, False)])
            rows.append(dict(model=kind, path=path, B=B, frames=frames, U=U, **row))
    return rows


def joint_inputs(B, T, U, J, V, device):
    """Encoder outputs as the model's encoder_projector gives them under bf16 autocast, labels, decoder input."""
    gen = torch.Generator().manual_seed(B)
    labels, decoder_input_ids = labels_batch(gen, B, U, V)
    encoder_hidden_states = torch.randn(B, T, J, generator=gen).to(device, torch.bfloat16).requires_grad_()
    encoder_outputs = ParakeetEncoderModelOutput(
        pooler_output=encoder_hidden_states, attention_mask=torch.ones(B, T, dtype=torch.int32, device=device)
    )
    return dict(
        encoder_outputs=encoder_outputs, decoder_input_ids=decoder_input_ids.to(device), labels=labels.to(device)
    )


def parakeet_joint(args, device, timer):
    """(b) Parakeet-0.6B's joint and TDT loss under bf16 autocast, from given encoder outputs (a tiny encoder: it
    does not run)."""
    V, J, T, U = args.vocab, args.joint, args.frames, args.labels
    torch.manual_seed(0)
    base = make_model("tdt", V, J, 2, encoder_config(32, 16))
    rows = []
    for path in PATHS:
        # each batch's inputs made when it runs: the largest alone are 15 MiB, not worth keeping
        batches = (
            (
                None
                if path == "transformers" and B > args.transformers_max_batch
                else joint_inputs(B, T, U, J, V, device),
                True,
            )
            for B in args.batches
        )
        for B, row in zip(args.batches, measure_path(base, path, device, timer, batches)):
            rows.append(dict(B=B, path=path, **row))
    return sorted(rows, key=lambda r: (r["B"], PATHS.index(r["path"])))


def ratio(a, b):
    return None if a is None or b is None else a / b


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def memory(row):
    return "-" if row["peak_mib"] is None else f"{row['peak_mib']:.0f} ({row['step_mib']:.0f})"


def report(tiny, joint, args):
    lines = [
        "(a) tiny random models, one training step (forward + backward, fp32)",
        "",
        "| model | loss | step ms | peak MiB (step's own) | speed-up over transformers' loss |",
        "| --- | --- | --- | --- | --- |",
    ]
    base = {r["model"]: r["ms"] for r in tiny if r["path"] == "transformers"}
    for r in tiny:
        lines.append(
            f"| {r['model']} | {r['path']} | {fmt(r['ms'], '.1f')} | {memory(r)} | "
            f"{fmt(ratio(base[r['model']], r['ms']), '.1f')}x |"
        )
    lines += [
        "",
        f"(b) Parakeet-0.6B joint + TDT loss (V = {args.vocab - 1} + blank, durations 0-4, joint "
        f"{args.joint}, T = {args.frames}, U = {args.labels}), bf16 autocast, forward + backward from the "
        "encoder outputs",
        "",
        "| B | loss | step ms | peak MiB (step's own) | fused against ours unfused: speed-up, peak |",
        "| --- | --- | --- | --- | --- |",
    ]
    by = {(r["B"], r["path"]): r for r in joint}
    for r in joint:
        versus = ""
        if r["path"] == "fused":
            ours = by[(r["B"], "ours")]
            versus = (
                f"{fmt(ratio(ours['ms'], r['ms']), '.2f')}x, 1/{fmt(ratio(ours['peak_mib'], r['peak_mib']), '.0f')}"
            )
        lines.append(f"| {r['B']} | {r['path']} | {fmt(r['ms'], '.1f')} | {memory(r)} | {r.get('note', versus)} |")
    return "\n".join(lines)


def targets(tiny, joint, B=16):
    """The targets: the tiny TDT step >= 50x faster than with transformers' loss (ours and fused); fused at B = 16
    at most 1/50 of the unfused peak and at least 1.8x faster."""
    tdt = {r["path"]: r for r in tiny if r["model"] == "tdt"}
    by = {(r["B"], r["path"]): r for r in joint}
    fused, ours = by.get((B, "fused"), {}), by.get((B, "ours"), {})
    speedup_ours = ratio(tdt["transformers"]["ms"], tdt["ours"]["ms"])
    speedup_fused = ratio(tdt["transformers"]["ms"], tdt["fused"]["ms"])
    memory = ratio(fused.get("peak_mib"), ours.get("peak_mib"))
    faster = ratio(ours.get("ms"), fused.get("ms"))
    return dict(
        tiny_tdt_speedup_ours=speedup_ours,
        tiny_tdt_speedup_fused=speedup_fused,
        fused_b16_memory_fraction=memory,
        fused_b16_speedup=faster,
        met=dict(
            tiny_tdt_50x=None if speedup_ours is None else min(speedup_ours, speedup_fused) >= 50,
            fused_b16_memory_1_50=None if memory is None else memory <= 1 / 50,
            fused_b16_1_8x=None if faster is None else faster >= 1.8,
        ),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the figures as JSON to this path")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (checks that the script runs)")
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument(
        "--transformers-max-batch",
        type=int,
        default=16,
        help="largest B run with transformers' TDT loss in (b): seconds a step, and its float32 "
        "copies of the logits need about 5.4 GB per utterance (default 16)",
    )
    args = parser.parse_args()
    if args.smoke:
        device = torch.device("cpu")
        args.vocab, args.joint, args.frames, args.labels, args.batches = 33, 32, 12, 4, [2, 4]
        args.tiny_vocab, args.tiny_batch, args.tiny_frames, args.tiny_labels = 24, 2, 32, 4
        timer = Timer(device, warmup=1, budget=0.0)
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --smoke)")
        device = torch.device("cuda")
        args.vocab, args.joint, args.frames, args.labels = 8193, 640, 375, 100
        args.tiny_vocab, args.tiny_batch, args.tiny_frames, args.tiny_labels = 128, 8, 800, 40
        timer = Timer(device)

    tiny = tiny_models(args, device, timer)
    joint = parakeet_joint(args, device, timer)
    figures = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__,
        transformers=transformers.__version__,
        smoke=args.smoke,
        tiny=tiny,
        joint=joint,
        targets=targets(tiny, joint) if not args.smoke else None,
    )
    print(report(tiny, joint, args))
    if figures["targets"]:
        print("\ntargets:", json.dumps(figures["targets"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
