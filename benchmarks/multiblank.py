#!/usr/bin/env python
"""Multi-blank RNN-T benchmarks: the loss alone against NeMo's MultiblankRNNTLossNumba and the bandwidth floor, a
Protocol A training step (its batches and shapes, 3 warm-up and 4 timed batches, each timed step after an
untimed one on the same batch) fused and unfused against this library's RNN-T step, and the CPU loss against the
RNN-T CPU loss. Prints one table; benchmarks/RESULTS.md keeps the figures.

    python benchmarks/multiblank.py            # CUDA (NeMo's loss when importable: benchmarks/README.md)
    python benchmarks/multiblank.py --cpu-only
"""

import common  # first: it puts the repository root on sys.path
import torch

import transducer

BIG = [2, 4, 8]  # big blanks of durations 2, 4, 8 in the columns before the blank, which is the last column
SIGMA = 0.05


def loss_alone(B=16, T=400, U=100, V=1024):
    """(B, T, U, V + 3) fp32, every length at its max: V labels then the big blanks and the blank."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    width = V + len(BIG)
    Ts, Us = torch.full((B,), T, device="cuda"), torch.full((B,), U, device="cuda")
    y = torch.randint(0, V - 1, (B, U), device="cuda", generator=gen)
    padded = torch.randn(B, T, U + 1, width, device="cuda", generator=gen)
    rows = padded.view(-1, width)
    case = f"multi-blank loss alone ({B},{T},{U},{V}+{len(BIG)}) fp32"
    out = [(case, "bandwidth floor (3 passes)", common.three_pass_floor_ms(rows), None)]
    for name, x in (("ours compact", rows), ("ours padded", padded)):
        x = x.detach().requires_grad_()

        def step():  # the gradient freed after the step: the extra memory counts it
            transducer.multiblank_loss(x, y, Ts, Us, BIG, -1, sigma=SIGMA, reduction="sum").backward()
            x.grad = None

        ms, mb = common.cuda_ms(step)
        out.append((case, name, ms, mb))
    loss_class = common.nemo_class("MultiblankRNNTLossNumba")
    if loss_class is not None:
        fn = loss_class(blank=width - 1, big_blank_durations=BIG, reduction="none", sigma=SIGMA)
        x = padded.detach().requires_grad_()

        def step():
            fn(x, y, Ts, Us).sum().backward()
            x.grad = None

        ms, mb = common.cuda_ms(step)
        out.append((case, "NeMo MultiblankRNNTLossNumba", ms, mb))
    print(f"  (gradient size {rows.numel() * 4 / 2**20:.0f} MB)")
    return out


def protocol_a(width=512, vocab=500):
    torch.manual_seed(0)
    joiner_mb = torch.nn.Linear(width, vocab + len(BIG) + 1).cuda()  # labels [1, vocab), the big blanks, the blank
    joiner_rnnt = torch.nn.Linear(width, vocab).cuda()

    def contenders(enc, pred, y, T, U):
        return {
            "ours RNN-T fused (scale)": lambda: transducer.fused_joiner_loss(
                enc, pred, joiner_rnnt.weight, joiner_rnnt.bias, y, T, U, reduction="sum"
            ),
            "ours multi-blank fused": lambda: transducer.fused_joiner_loss(
                enc,
                pred,
                joiner_mb.weight,
                joiner_mb.bias,
                y,
                T,
                U,
                blank=-1,
                big_blank_durations=BIG,
                sigma=SIGMA,
                reduction="sum",
            ),
            "ours RNN-T compact (scale)": lambda: transducer.transducer_loss(
                joiner_rnnt(torch.tanh(transducer.pack(enc, pred, T, U))), y, T, U, reduction="sum"
            ),
            "ours multi-blank compact": lambda: transducer.multiblank_loss(
                joiner_mb(torch.tanh(transducer.pack(enc, pred, T, U))), y, T, U, BIG, -1, sigma=SIGMA, reduction="sum"
            ),
        }

    return common.protocol_a(
        f"30 utts, {width} -> {vocab} (+{len(BIG) + 1})", contenders, [joiner_mb, joiner_rnnt], vocab, width=width
    )


def cpu(B=8, T=100, U=30, V=256):
    """The CPU losses, forward and backward, RNN-T and multi-blank steps alternating (V columns each)."""
    gen = torch.Generator().manual_seed(0)
    Ts, Us = torch.full((B,), T), torch.full((B,), U)
    y = torch.randint(1, V - len(BIG) - 1, (B, U), generator=gen)
    x_rnnt = torch.randn(B * T * (U + 1), V, generator=gen).requires_grad_()
    x_mb = torch.randn(B * T * (U + 1), V, generator=gen).requires_grad_()
    return common.cpu_pairs(
        f"CPU loss alone ({B},{T},{U},{V}) fp32",
        [
            ("RNN-T", x_rnnt, lambda x: transducer.transducer_loss(x, y, Ts, Us, reduction="sum")),
            (
                "multi-blank",
                x_mb,
                lambda x: transducer.multiblank_loss(x, y, Ts, Us, BIG, -1, sigma=SIGMA, reduction="sum"),
            ),
        ],
    )


if __name__ == "__main__":
    common.main(__doc__, loss_alone, protocol_a, cpu)
