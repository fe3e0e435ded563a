"""The loss part of a NeMo TDT training step, Parakeet-TDT-0.6B-sized, on a GPU: NeMo's fused joint (a loop over
``fused_batch_size`` sub-batches, each building its (b, T, U+1, C) joint, copying it to float32 and running
NeMo's numba ``TDTLossNumba``) against the same joint after ``transducer.integrations.nemo.apply`` (the joint
fused with the loss over the whole batch).

NeMo is not needed: its ``RNNTJoint`` is stood in for by ``NemoJoint`` below, the same modules (the encoder and
decoder projections, ``joint_net = [ReLU, Dropout, Linear]``) and the fused forward's loop as NeMo 3.0's
``RNNTJoint.forward`` runs it with ``compute_wer=False``; the loss is NeMo 3.0's ``TDTLossNumba`` where
importable (benchmarks/README.md, Peers). ``apply``'s joint is ``FusedJointMixin`` over the same
class, so the fused path measured is the integration's own code.

The step: the joint's forward from encoder outputs (B, 1024, T) and decoder outputs (B, 640, U+1) in bf16, under
bf16 autocast (the projections, the joint and its loss), ``mean_batch``, and backward to the joint's parameters
and both inputs. Joint 1024/640 -> 640 -> V + 1 + 5 (durations 0-4, sigma 0.02, omega 0.1: Parakeet-TDT-0.6B's
config), V 1024 and 8192; B 16, T_b in [225, 375] and U_b in [60, 100] (the longest at the maxima), new lengths
each batch. Time: the minimum over batches of CUDA-event time per step after a warm-up step on the batch; memory:
the peak above what the inputs and parameters hold.

    python benchmarks/nemo_step.py --json nemo_step.json   # NeMo's loss where importable
    python benchmarks/nemo_step.py --fused-batch-sizes --omega 0 --dropout 0     # ours alone, other options
"""

import argparse
import json
import time

import torch

import common  # first: it puts the repository root on sys.path
from transducer.integrations.nemo import FusedJointMixin, RNNTLoss

DURATIONS = [0, 1, 2, 3, 4]
TDT_KWARGS = dict(durations=DURATIONS, sigma=0.02, omega=0.1)  # Parakeet-TDT-0.6B's


class NemoJoint(torch.nn.Module):
    """The parts of NeMo 3.0's RNNTJoint a training step uses, and its fused forward (see the module docstring)."""

    def __init__(self, enc_hidden, pred_hidden, joint_hidden, num_classes, dropout, fused_batch_size):
        super().__init__()
        self.enc = torch.nn.Linear(enc_hidden, joint_hidden)
        self.pred = torch.nn.Linear(pred_hidden, joint_hidden)
        self.joint_net = torch.nn.Sequential(torch.nn.ReLU(inplace=True), torch.nn.Dropout(dropout),
                                             torch.nn.Linear(joint_hidden, num_classes + 1 + len(DURATIONS)))
        self.fuse_loss_wer, self.fused_batch_size, self.loss, self.masking_prob = True, fused_batch_size, None, -1.0

    def project_encoder(self, x):
        return self.enc(x)

    def project_prednet(self, x):
        return self.pred(x)

    def is_adapter_available(self):
        return False

    def joint(self, f, g):
        return self.joint_net(self.project_encoder(f)[:, :, None] + self.project_prednet(g)[:, None])

    def forward(self, encoder_outputs, decoder_outputs, encoder_lengths=None, transcripts=None,
                transcript_lengths=None, compute_wer=False, keep_hypotheses=False):
        enc, dec = encoder_outputs.transpose(1, 2), decoder_outputs.transpose(1, 2)
        losses = []
        for begin in range(0, enc.size(0), self.fused_batch_size):
            end = min(begin + self.fused_batch_size, enc.size(0))
            t_max, u_max = int(encoder_lengths[begin:end].max()), int(transcript_lengths[begin:end].max())
            sub_joint = self.joint(enc[begin:end, :t_max], dec[begin:end, :u_max + 1])
            losses.append(self.loss(log_probs=sub_joint, targets=transcripts[begin:end, :u_max],
                                    input_lengths=encoder_lengths[begin:end],
                                    target_lengths=transcript_lengths[begin:end]))
        return torch.cat(losses).mean(), None, None, None


class FusedNemoJoint(FusedJointMixin, NemoJoint):
    """NemoJoint after apply."""


class NemoTDTLoss(torch.nn.Module):
    """NeMo's RNNTLoss(loss_name="tdt", reduction=None) around its numba TDTLossNumba: 16-bit joints copied to
    float32 (its force_float32), contiguous targets, per-utterance losses."""

    def __init__(self, num_classes):
        super().__init__()
        self.loss = common.nemo_class("TDTLossNumba")(blank=num_classes, reduction="none", **TDT_KWARGS)

    def forward(self, log_probs, targets, input_lengths, target_lengths):
        return self.loss(acts=log_probs.float(), labels=targets.long().contiguous(), act_lens=input_lengths.long(),
                         label_lens=target_lengths.long())


def batches(count, V, B=16, T=375, U=100, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        t = torch.randint(225, T + 1, (B,), generator=gen)
        u = torch.randint(60, U + 1, (B,), generator=gen)
        t[0], u[0] = T, U
        enc = torch.randn(B, 1024, T, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
        dec = torch.randn(B, 640, U + 1, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
        y = torch.randint(0, V, (B, U), generator=gen).cuda()
        yield enc, dec, t.cuda(), y, u.cuda()


def measure(joint, V, count):
    """(min ms, peak MiB above the inputs and parameters) of the joint's loss step over ``count`` batches, or
    (None, "out of memory")."""
    times, peak = [], 0
    for enc, dec, T, y, U in batches(count, V):
        def step():
            joint.zero_grad(set_to_none=True)
            enc.grad = dec.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _, _, _ = joint(encoder_outputs=enc, decoder_outputs=dec, encoder_lengths=T, transcripts=y,
                                      transcript_lengths=U)
            loss.backward()
        try:
            step()  # warm-up on the batch's shapes
            enc.grad = dec.grad = None
            joint.zero_grad(set_to_none=True)
            ms, mb = common.cuda_call(step)
        except torch.cuda.OutOfMemoryError:
            return None, "out of memory"
        times.append(ms)
        peak = max(peak, mb)
        del enc, dec
    return min(times), peak


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="*", default=[1024, 8192])
    p.add_argument("--fused-batch-sizes", type=int, nargs="*", default=[16, 4])
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.2, help="joint dropout (FastConformer configs: 0.2)")
    p.add_argument("--omega", type=float, default=TDT_KWARGS["omega"])
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    TDT_KWARGS["omega"] = args.omega
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, clock {common.gpu_clock()}; "
          f"dropout {args.dropout}, omega {args.omega}")
    results = []
    for V in args.vocab:
        contenders = [(f"NeMo, fused_batch_size {n}", n) for n in args.fused_batch_sizes] + [("apply(model)", None)]
        for name, n in contenders:
            torch.manual_seed(0)
            if n is None:
                joint = FusedNemoJoint(1024, 640, 640, V, args.dropout, 4).cuda().train()  # its batch size unused
                joint.loss = RNNTLoss(V, reduction="mean_batch", loss_name="tdt", loss_kwargs=TDT_KWARGS)
            else:
                if common.nemo_class("TDTLossNumba") is None:
                    continue
                joint = NemoJoint(1024, 640, 640, V, args.dropout, n).cuda().train()
                joint.loss = NemoTDTLoss(V)
            start = time.perf_counter()
            ms, peak = measure(joint, V, args.batches)
            results.append(dict(vocab=V, contender=name, ms=ms, peak_mib=peak, clock=common.gpu_clock(),
                                dropout=args.dropout, omega=args.omega))
            shown = f"{ms:8.2f} ms  {peak:8.0f} MiB" if ms is not None else f"  {peak}"
            print(f"V {V:5d} + 1 + 5  {name:28s}{shown}   ({time.perf_counter() - start:.0f} s, {common.gpu_clock()})",
                  flush=True)
            del joint
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results), f,
                      indent=1)


if __name__ == "__main__":
    main()
