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
each batch, each batch built once and shared by the contenders. Time: the mean over the batches of the minimum of
``--rounds`` interleaved rounds of CUDA-event time per step, after an untimed step of each contender on the batch
(common.interleaved); memory: the peak above what the inputs and parameters hold.

    python benchmarks/nemo_step.py --json nemo_step.json   # NeMo's loss where importable
    python benchmarks/nemo_step.py --fused-batch-sizes --omega 0 --dropout 0     # ours alone, other options
"""

import argparse
import functools

import common  # first: it puts the repository root on sys.path
import torch

from transducer.integrations.nemo import FusedJointMixin, RNNTLoss

DURATIONS = [0, 1, 2, 3, 4]
TDT_KWARGS = dict(durations=DURATIONS, sigma=0.02, omega=0.1)  # Parakeet-TDT-0.6B's


class NemoJoint(torch.nn.Module):
    """The parts of NeMo 3.0's RNNTJoint a training step uses, and its fused forward (see the module docstring)."""

    def __init__(self, enc_hidden, pred_hidden, joint_hidden, num_classes, dropout, fused_batch_size):
        super().__init__()
        self.enc = torch.nn.Linear(enc_hidden, joint_hidden)
        self.pred = torch.nn.Linear(pred_hidden, joint_hidden)
        self.joint_net = torch.nn.Sequential(
            torch.nn.ReLU(inplace=True),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(joint_hidden, num_classes + 1 + len(DURATIONS)),
        )
        self.fuse_loss_wer, self.fused_batch_size, self.loss, self.masking_prob = True, fused_batch_size, None, -1.0

    def project_encoder(self, x):
        return self.enc(x)

    def project_prednet(self, x):
        return self.pred(x)

    def is_adapter_available(self):
        return False

    def joint(self, f, g):
        return self.joint_net(self.project_encoder(f)[:, :, None] + self.project_prednet(g)[:, None])

    def forward(
        self,
        encoder_outputs,
        decoder_outputs,
        encoder_lengths=None,
        transcripts=None,
        transcript_lengths=None,
        compute_wer=False,
        keep_hypotheses=False,
    ):
        enc, dec = encoder_outputs.transpose(1, 2), decoder_outputs.transpose(1, 2)
        losses = []
        for begin in range(0, enc.size(0), self.fused_batch_size):
            end = min(begin + self.fused_batch_size, enc.size(0))
            t_max, u_max = int(encoder_lengths[begin:end].max()), int(transcript_lengths[begin:end].max())
            sub_joint = self.joint(enc[begin:end, :t_max], dec[begin:end, : u_max + 1])
            losses.append(
                self.loss(
                    log_probs=sub_joint,
                    targets=transcripts[begin:end, :u_max],
                    input_lengths=encoder_lengths[begin:end],
                    target_lengths=transcript_lengths[begin:end],
                )
            )
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
        return self.loss(
            acts=log_probs.float(),
            labels=targets.long().contiguous(),
            act_lens=input_lengths.long(),
            label_lens=target_lengths.long(),
        )


def batches(count, V, B=16, T=375, U=100, seed=0, device="cuda"):
    """``count`` batches (enc, dec, T, y, U) on ``device``, the encoder and decoder outputs in bf16."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        t = torch.randint(225, T + 1, (B,), generator=gen)
        u = torch.randint(60, U + 1, (B,), generator=gen)
        t[0], u[0] = T, U
        enc = torch.randn(B, 1024, T, generator=gen).to(device, torch.bfloat16).requires_grad_()
        dec = torch.randn(B, 640, U + 1, generator=gen).to(device, torch.bfloat16).requires_grad_()
        y = torch.randint(0, V, (B, U), generator=gen).to(device)
        yield enc, dec, t.to(device), y, u.to(device)


def make_joints(V, fused_batch_sizes, dropout):
    """{name: joint with its loss} on CUDA, each from seed 0: NeMo's at each of ``fused_batch_sizes``, and apply's."""
    joints = {}
    for n in fused_batch_sizes:
        torch.manual_seed(0)
        joints[f"NeMo, fused_batch_size {n}"] = NemoJoint(1024, 640, 640, V, dropout, n).cuda().train()
        joints[f"NeMo, fused_batch_size {n}"].loss = NemoTDTLoss(V)
    torch.manual_seed(0)
    joints["apply(model)"] = FusedNemoJoint(1024, 640, 640, V, dropout, 4).cuda().train()  # its batch size unused
    joints["apply(model)"].loss = RNNTLoss(V, reduction="mean_batch", loss_name="tdt", loss_kwargs=TDT_KWARGS)
    return joints


def steps(joints):
    """common.interleaved's steps(batch): on a batch, {name: step()} of each joint of ``joints`` = {name: joint},
    its forward with the loss under bf16 autocast and backward."""

    def on(batch):
        enc, dec, T, y, U = batch

        def step(joint):
            joint.zero_grad(set_to_none=True)
            enc.grad = dec.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _, _, _ = joint(
                    encoder_outputs=enc, decoder_outputs=dec, encoder_lengths=T, transcripts=y, transcript_lengths=U
                )
            loss.backward()
            joint.zero_grad(set_to_none=True)
            enc.grad = dec.grad = None

        return {name: functools.partial(step, joint) for name, joint in joints.items()}

    return on


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="*", default=[1024, 8192])
    p.add_argument("--fused-batch-sizes", type=int, nargs="*", default=[16, 4])
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds a batch, the minimum kept")
    p.add_argument("--dropout", type=float, default=0.2, help="joint dropout (FastConformer configs: 0.2)")
    p.add_argument("--omega", type=float, default=TDT_KWARGS["omega"])
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    TDT_KWARGS["omega"] = args.omega
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, clock {common.gpu_clock()}; "
        f"dropout {args.dropout}, omega {args.omega}"
    )
    print(f"ms: the mean over {args.batches} batches of the minimum of {args.rounds} interleaved rounds")
    nemo_loss = common.nemo_class("TDTLossNumba") is not None
    results = []
    for V in args.vocab:
        joints = make_joints(V, args.fused_batch_sizes if nemo_loss else [], args.dropout)
        timings = common.interleaved(batches(args.batches, V), steps(joints), args.rounds)
        for name, t in timings.items():
            results.append(
                dict(
                    vocab=V,
                    contender=name,
                    ms=t.ms,
                    peak_mib=t.peak_mib,
                    batches=t.batches,
                    rounds=args.rounds,
                    failed=t.failed,
                    clock=common.gpu_clock(),
                    dropout=args.dropout,
                    omega=args.omega,
                )
            )
            shown = f"  {t.failed}" if t.failed else f"{t.ms:8.2f} ms  {t.peak_mib:8.0f} MiB"
            print(f"V {V:5d} + 1 + 5  {name:28s}{shown}", flush=True)
        print(f"  clock: {common.gpu_clock()}")
        del joints
        torch.cuda.empty_cache()
    if args.json:
        common.write_results(args.json, results)


if __name__ == "__main__":
    main()
