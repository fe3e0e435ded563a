"""The loss part of an ESPnet transducer training step on a GPU: ESPnet's joint network building its (B, T, U+1, V)
joint and warp-transducer's loss on it (``ESPnetASRTransducerModel._calc_transducer_loss``: the joint copied to
float32, ``RNNTLoss(blank=0, reduction="mean")``), against this library's ``RNNTLoss`` on the same joint (what
``transducer.integrations.espnet.install()`` gives ESPnet) and the joint fused with the loss (what ``apply(model)``
runs).

ESPnet is not needed: its ``JointNetwork`` is stood in for by ``Joint`` below, the same modules
(``lin_out(tanh(lin_enc(enc) + lin_dec(dec)))``). The peer is warp-transducer (``warprnnt_pytorch``, built from
source) where importable, else warp-rnnt (``warp_rnnt``, benchmarks/README.md, Peers: shared/peers'
``setup.sh``) on the joint's log-softmax with ``gather=True``, its lightest mode; the table names the one run.

The step: encoder outputs (B, T, 512) and decoder outputs (B, U+1, 512) (the LibriSpeech conformer RNN-T recipe's
sizes, egs2/librispeech/asr1/conf/tuning/transducer/train_conformer-rnn_transducer.yaml), the joint 512 -> 640 ->
V, its loss and backward to the joint's parameters and both inputs; fp32, and bf16 autocast (``use_amp``, the
joint under autocast, as ESPnet runs it). Batches of B consecutive utterances of LibriSpeech train-clean-100's
(T, U) at 40 ms frames (benchmarks/data), labels in [1, V), each built once and shared by the contenders. Time: the
mean over the batches of the minimum of ``--rounds`` interleaved rounds of CUDA-event time per step, after an
untimed step of each contender on the batch (common.interleaved); memory: the peak above what the inputs and
parameters hold.

The floor: the four GEMMs a fused step cannot avoid over the batch's N = sum_b T_b (U_b + 1) rows, 640 -> V (the
logits in forward and again in backward's recompute, dH and dW; common.floor_gemms), in the GEMMs' dtype (bf16
under autocast, else fp32), timed in the same rounds; each contender's time is also given as a multiple of it.

    python benchmarks/espnet_step.py                        # on a CUDA machine: the table
    python benchmarks/espnet_step.py --vocab 5000 --json espnet_step.json
"""

import argparse
import functools
from typing import NamedTuple

import common  # first: it puts the repository root on sys.path
import numpy as np
import torch

from transducer.integrations.espnet import RNNTLoss

FLOOR = "floor (4 GEMMs)"


class Joint(torch.nn.Module):
    """ESPnet's JointNetwork (espnet2/asr_transducer/joint_network.py) with its default tanh."""

    def __init__(self, vocab, encoder_size=512, decoder_size=512, joint_space_size=640):
        super().__init__()
        self.lin_enc = torch.nn.Linear(encoder_size, joint_space_size)
        self.lin_dec = torch.nn.Linear(decoder_size, joint_space_size)
        self.lin_out = torch.nn.Linear(joint_space_size, vocab)
        self.joint_activation = torch.nn.Tanh()

    def forward(self, enc_out, dec_out):
        return self.lin_out(self.joint_activation(self.lin_enc(enc_out) + self.lin_dec(dec_out)))


def peer_loss():
    """(name, loss(joint_out, target, t_len, u_len)) of warp-transducer, else warp-rnnt, else (reason, None)."""
    try:
        import warprnnt_pytorch

        warp_transducer = warprnnt_pytorch.RNNTLoss(blank=0, fastemit_lambda=0.0, reduction="mean")
        return "warp-transducer", lambda x, y, T, U: warp_transducer(x.float(), y, T, U)
    except ImportError as e:
        reason = f"warp-transducer: {e}"
    try:
        import warp_rnnt

        def loss(x, y, T, U):
            return warp_rnnt.rnnt_loss(
                torch.log_softmax(x.float(), -1), y, T, U, reduction="mean", blank=0, gather=True
            )

        return "warp-rnnt (gather)", loss
    except ImportError as e:
        return f"{reason}; warp-rnnt: {e}", None


def contenders(joint, peer):
    """{name: step(enc, dec, y, T, U) -> loss}: ESPnet's joint with the peer's loss and with ours, and fused."""
    ours = RNNTLoss(blank=0, fastemit_lambda=0.0, reduction="mean")

    def unfused(loss):
        return lambda enc, dec, y, T, U: loss(joint(enc.unsqueeze(2), dec.unsqueeze(1)), y, T, U)

    def fused(enc, dec, y, T, U):
        return ours.joint_loss(
            joint.lin_enc(enc), joint.lin_dec(dec), joint.lin_out.weight, joint.lin_out.bias, y, T, U, "tanh"
        )

    steps = {f"ESPnet's joint + {peer[0]}": unfused(peer[1])} if peer[1] is not None else {}
    steps.update(
        {
            "ESPnet's joint + install()'s RNNTLoss": unfused(lambda x, y, T, U: ours(x.float(), y, T, U)),
            "apply(model): fused": fused,
        }
    )
    return steps


class Batch(NamedTuple):
    """A batch as ESPnet's transducer model gives it to its joint and loss, and its rows N = sum_b T_b (U_b + 1)."""

    enc: torch.Tensor  # (B, T, 512) encoder outputs
    dec: torch.Tensor  # (B, U + 1, 512) decoder outputs
    y: torch.Tensor  # (B, U) int32 labels in [1, V)
    T: torch.Tensor  # (B,) int32
    U: torch.Tensor  # (B,) int32
    rows: int


def batches(count, V, B, device="cuda"):
    """``count`` Batches of ``B`` consecutive LibriSpeech (T, U) pairs on ``device``."""
    rows = np.loadtxt(
        common.HERE / "data" / "librispeech_train_clean_100_TU.csv", delimiter=",", skiprows=1, dtype=np.int64
    )
    gen = torch.Generator().manual_seed(0)
    for i in range(count):
        r = rows[i * B : (i + 1) * B]
        T, U = torch.tensor(r[:, 0], dtype=torch.int32), torch.tensor(r[:, 1], dtype=torch.int32)
        y = torch.randint(1, V, (B, int(U.max())), generator=gen, dtype=torch.int32)
        enc = torch.randn(B, int(T.max()), 512, generator=gen).to(device).requires_grad_()
        dec = torch.randn(B, int(U.max()) + 1, 512, generator=gen).to(device).requires_grad_()
        yield Batch(enc, dec, y.to(device), T.to(device), U.to(device), int((T * (U + 1)).sum()))


def steps(joint, losses, V, precision):
    """common.interleaved's steps(batch): on a batch, {name: step()} of the floor and of each loss of ``losses``
    (``contenders``), under ``precision``."""

    def on(batch):
        def clear():
            joint.zero_grad(set_to_none=True)
            batch.enc.grad = batch.dec.grad = None

        def step(loss_fn):
            clear()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = loss_fn(batch.enc, batch.dec, batch.y, batch.T, batch.U)
            loss.sum().backward()
            clear()

        gemm_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        out = {FLOOR: common.floor_gemms(batch.rows, joint.lin_out.in_features, V, gemm_dtype)}
        out.update({name: functools.partial(step, loss_fn) for name, loss_fn in losses.items()})
        return out

    return on


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="*", default=[1000], help="output size of the joint (V)")
    p.add_argument("--batch", type=int, default=32, help="utterances per batch (B)")
    p.add_argument("--batches", type=int, default=4, help="batches timed, the mean kept")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds a batch, the minimum kept")
    p.add_argument("--precision", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("espnet_step.py times CUDA steps: no CUDA device here")
    peer = peer_loss()
    if peer[1] is None:
        print(f"no peer loss: {peer[0]}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, clock {common.gpu_clock()}; B {args.batch}")
    print(f"ms: the mean over {args.batches} batches of the minimum of {args.rounds} interleaved rounds")
    results = []
    for V in args.vocab:
        torch.manual_seed(0)
        joint = Joint(V).cuda().train()
        losses = contenders(joint, peer)
        for precision in args.precision:
            timings = common.interleaved(
                batches(args.batches, V, args.batch), steps(joint, losses, V, precision), args.rounds
            )
            floor = timings[FLOOR].ms
            for name, t in timings.items():
                x_floor = t.ms / floor if t.ms is not None and floor else None
                results.append(
                    dict(
                        vocab=V,
                        precision=precision,
                        contender=name,
                        ms=t.ms,
                        peak_mib=t.peak_mib,
                        x_floor=x_floor,
                        batch=args.batch,
                        batches=t.batches,
                        rounds=args.rounds,
                        failed=t.failed,
                        clock=common.gpu_clock(),
                    )
                )
                shown = (
                    f"  {t.failed}"
                    if t.failed
                    else f"{t.ms:8.2f} ms  {t.peak_mib:8.0f} MiB"
                    + (f"  {x_floor:5.2f}x floor" if x_floor is not None else "")
                )
                print(f"V {V:5d} {precision}  {name:42s}{shown}", flush=True)
            torch.cuda.empty_cache()
        del joint, losses
    if args.json:
        common.write_results(args.json, results)


if __name__ == "__main__":
    main()
