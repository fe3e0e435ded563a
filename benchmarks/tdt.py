#!/usr/bin/env python
"""TDT loss benchmarks: the loss alone against NeMo's TDTLossNumba and the bandwidth floor, a Protocol A
training step (its batches and shapes; 3 warm-up and 4 timed batches where bench.py times 20; each timed step
follows an untimed one on the same batch) against NeMo and this library's RNN-T step, unfused and fused, and
the CPU loss against the RNN-T CPU loss. Prints one table; benchmarks/RESULTS.md keeps the figures.

    python benchmarks/tdt.py            # CUDA (NeMo's loss when importable: benchmarks/README.md)
    python benchmarks/tdt.py --cpu-only
"""

import common  # first: it puts the repository root on sys.path
import torch

import transducer

DURATIONS = [0, 1, 2, 3, 4]


def loss_alone(B=16, T=400, U=100, V=1024):
    gen = torch.Generator(device="cuda").manual_seed(0)
    D = len(DURATIONS)
    Ts, Us = torch.full((B,), T, device="cuda"), torch.full((B,), U, device="cuda")
    y = torch.randint(1, V, (B, U), device="cuda", generator=gen)
    padded = torch.randn(B, T, U + 1, V + D, device="cuda", generator=gen)
    rows = padded.view(-1, V + D)
    case = f"TDT loss alone ({B},{T},{U},{V}+{D}) fp32"
    out = [(case, "bandwidth floor (3 passes)", common.three_pass_floor_ms(rows), None)]
    for name, x in (("ours compact", rows), ("ours padded", padded)):
        x = x.detach().requires_grad_()

        def step():  # the gradient freed after the step: the extra memory counts it
            transducer.tdt_loss(x, y, Ts, Us, DURATIONS, sigma=0.05, reduction="sum").backward()
            x.grad = None

        ms, mb = common.cuda_ms(step)
        out.append((case, name, ms, mb))
    TDTLossNumba = common.nemo_class("TDTLossNumba")
    if TDTLossNumba is not None:
        fn = TDTLossNumba(blank=0, durations=DURATIONS, reduction="sum", sigma=0.05)
        x = padded.detach().requires_grad_()

        def step():
            fn(acts=x, labels=y, act_lens=Ts, label_lens=Us).backward()
            x.grad = None

        ms, mb = common.cuda_ms(step)
        out.append((case, "NeMo TDTLossNumba", ms, mb))
    print(f"  (gradient size {rows.numel() * 4 / 2**20:.0f} MB)")
    return out


def protocol_a(width=512, vocab=500):
    torch.manual_seed(0)
    joiner_tdt = torch.nn.Linear(width, vocab + len(DURATIONS)).cuda()
    joiner_rnnt = torch.nn.Linear(width, vocab).cuda()
    # the joint padded to a multiple of 8 columns (cuBLAS's fast kernels want 16-byte rows), the heads read as
    # views: tokens [0, vocab), durations the last D columns
    joiner_tdt8 = torch.nn.Linear(width, -(-(vocab + len(DURATIONS)) // 8) * 8).cuda()
    TDTLossNumba = common.nemo_class("TDTLossNumba")

    def contenders(enc, pred, y, T, U):
        out = {
            "ours RNN-T compact (scale)": lambda: transducer.transducer_loss(
                joiner_rnnt(torch.tanh(transducer.pack(enc, pred, T, U))), y, T, U, reduction="sum"
            ),
            "ours TDT compact": lambda: transducer.tdt_loss(
                joiner_tdt(torch.tanh(transducer.pack(enc, pred, T, U))),
                y,
                T,
                U,
                DURATIONS,
                sigma=0.05,
                reduction="sum",
            ),
            "ours TDT compact, joint padded to x8 (views)": lambda: (
                lambda z: transducer.tdt_loss(
                    z[:, :vocab],
                    y,
                    T,
                    U,
                    DURATIONS,
                    sigma=0.05,
                    reduction="sum",
                    duration_logits=z[:, -len(DURATIONS) :],
                )
            )(joiner_tdt8(torch.tanh(transducer.pack(enc, pred, T, U)))),
            "ours RNN-T fused (scale)": lambda: transducer.fused_joiner_loss(
                enc, pred, joiner_rnnt.weight, joiner_rnnt.bias, y, T, U, reduction="sum"
            ),
            "ours TDT fused": lambda: transducer.fused_joiner_loss(
                enc, pred, joiner_tdt.weight, joiner_tdt.bias, y, T, U, durations=DURATIONS, sigma=0.05, reduction="sum"
            ),
        }
        if TDTLossNumba is not None:
            nemo = TDTLossNumba(blank=0, durations=DURATIONS, reduction="sum", sigma=0.05)
            out["NeMo TDTLossNumba (padded, fp32 logits)"] = lambda: nemo(
                acts=joiner_tdt(torch.tanh(enc[:, :, None] + pred[:, None])).float(), labels=y, act_lens=T, label_lens=U
            )
        return out

    return common.protocol_a(
        f"30 utts, {width} -> {vocab} (+{len(DURATIONS)})",
        contenders,
        [joiner_tdt, joiner_rnnt, joiner_tdt8],
        vocab,
        width=width,
    )


def cpu(B=8, T=100, U=30, V=256):
    """The CPU losses, forward and backward, RNN-T and TDT steps alternating."""
    gen = torch.Generator().manual_seed(0)
    Ts, Us = torch.full((B,), T), torch.full((B,), U)
    y = torch.randint(1, V, (B, U), generator=gen)
    x_rnnt = torch.randn(B * T * (U + 1), V, generator=gen).requires_grad_()
    x_tdt = torch.randn(B * T * (U + 1), V + len(DURATIONS), generator=gen).requires_grad_()
    return common.cpu_pairs(
        f"CPU loss alone ({B},{T},{U},{V}) fp32",
        [
            ("RNN-T", x_rnnt, lambda x: transducer.transducer_loss(x, y, Ts, Us, reduction="sum")),
            ("TDT", x_tdt, lambda x: transducer.tdt_loss(x, y, Ts, Us, DURATIONS, reduction="sum")),
        ],
    )


if __name__ == "__main__":
    common.main(__doc__, loss_alone, protocol_a, cpu)
