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
(T, U) at 40 ms frames (benchmarks/data), labels in [1, V). Time: the minimum over batches of CUDA-event time per
step after a warm-up step on the batch; memory: the peak above what the inputs and parameters hold.

    python benchmarks/espnet_step.py                        # on a CUDA machine: the table
    python benchmarks/espnet_step.py --vocab 5000 --json espnet_step.json
"""

import argparse
import json
import time

import numpy as np
import torch

import common  # first: it puts the repository root on sys.path
from transducer.integrations.espnet import RNNTLoss


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

        loss = warprnnt_pytorch.RNNTLoss(blank=0, fastemit_lambda=0.0, reduction="mean")
        return "warp-transducer", lambda x, y, T, U: loss(x.float(), y, T, U)
    except ImportError as e:
        reason = f"warp-transducer: {e}"
    try:
        import warp_rnnt

        def loss(x, y, T, U):
            return warp_rnnt.rnnt_loss(torch.log_softmax(x.float(), -1), y, T, U, reduction="mean", blank=0,
                                       gather=True)
        return "warp-rnnt (gather)", loss
    except ImportError as e:
        return f"{reason}; warp-rnnt: {e}", None


def contenders(joint, peer):
    """{name: step(enc, dec, y, T, U) -> loss}: ESPnet's joint with the peer's loss and with ours, and fused."""
    ours = RNNTLoss(blank=0, fastemit_lambda=0.0, reduction="mean")

    def unfused(loss):
        return lambda enc, dec, y, T, U: loss(joint(enc.unsqueeze(2), dec.unsqueeze(1)), y, T, U)

    def fused(enc, dec, y, T, U):
        return ours.joint_loss(joint.lin_enc(enc), joint.lin_dec(dec), joint.lin_out.weight, joint.lin_out.bias,
                               y, T, U, "tanh")
    steps = {f"ESPnet's joint + {peer[0]}": unfused(peer[1])} if peer[1] is not None else {}
    steps.update({"ESPnet's joint + install()'s RNNTLoss": unfused(lambda x, y, T, U: ours(x.float(), y, T, U)),
                  "apply(model): fused": fused})
    return steps


def batches(count, V, B):
    rows = np.loadtxt(common.HERE / "data" / "librispeech_train_clean_100_TU.csv", delimiter=",", skiprows=1,
                      dtype=np.int64)
    gen = torch.Generator().manual_seed(0)
    for i in range(count):
        r = rows[i * B:(i + 1) * B]
        T, U = torch.tensor(r[:, 0], dtype=torch.int32), torch.tensor(r[:, 1], dtype=torch.int32)
        y = torch.randint(1, V, (B, int(U.max())), generator=gen, dtype=torch.int32)
        enc = torch.randn(B, int(T.max()), 512, generator=gen).cuda().requires_grad_()
        dec = torch.randn(B, int(U.max()) + 1, 512, generator=gen).cuda().requires_grad_()
        yield enc, dec, y.cuda(), T.cuda(), U.cuda()


def measure(joint, step, V, B, count, precision):
    """(min ms, peak MiB above the inputs and parameters) of ``step`` over ``count`` batches, or (None, reason)."""
    times, peak = [], 0
    for enc, dec, y, T, U in batches(count, V, B):
        def run():
            joint.zero_grad(set_to_none=True)
            enc.grad = dec.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = step(enc, dec, y, T, U)
            loss.sum().backward()
        try:
            run()  # warm-up on the batch's shapes
            joint.zero_grad(set_to_none=True)
            enc.grad = dec.grad = None
            ms, mb = common.cuda_call(run)
        except torch.cuda.OutOfMemoryError:
            return None, "out of memory"
        times.append(ms)
        peak = max(peak, mb)
        del enc, dec
    return min(times), peak


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="*", default=[1000], help="output size of the joint (V)")
    p.add_argument("--batch", type=int, default=32, help="utterances per batch (B)")
    p.add_argument("--batches", type=int, default=4, help="batches timed, the minimum kept")
    p.add_argument("--precision", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("espnet_step.py times CUDA steps: no CUDA device here")
    peer = peer_loss()
    if peer[1] is None:
        print(f"no peer loss: {peer[0]}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, clock {common.gpu_clock()}; B {args.batch}")
    results = []
    for V in args.vocab:
        for precision in args.precision:
            for name in contenders(None, peer):
                torch.manual_seed(0)
                joint = Joint(V).cuda().train()
                step = contenders(joint, peer)[name]
                start = time.perf_counter()
                ms, peak = measure(joint, step, V, args.batch, args.batches, precision)
                results.append(dict(vocab=V, precision=precision, contender=name, ms=ms, peak_mib=peak,
                                    batch=args.batch, clock=common.gpu_clock()))
                shown = f"{ms:8.2f} ms  {peak:8.0f} MiB" if ms is not None else f"  {peak}"
                print(f"V {V:5d} {precision}  {name:42s}{shown}   ({time.perf_counter() - start:.0f} s)", flush=True)
                del joint
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results), f,
                      indent=1)


if __name__ == "__main__":
    main()
