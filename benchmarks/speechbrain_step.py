"""The loss part of a SpeechBrain conformer-transducer training step on a GPU (the LibriSpeech recipe's
``conformer_transducer.yaml``: ``Transducer_joint(joint="sum", nonlinearity=GELU)`` over the 640-wide projected
encoder and decoder outputs, then ``transducer_lin``, ``Linear(640, 1000, bias=False)``, blank 0): SpeechBrain's
numba ``transducer_loss`` on the joint's logits, against this library's ``transducer_loss`` on the same logits
(``transducer.integrations.speechbrain``) and the fused loss (``fused_transducer_loss``: no joint, no logits).

The step: from the projected outputs x (B, T, 640) and h (B, U+1, 640), leaves that require grad, the joint and
the loss (``"mean"``, lengths relative as the recipe passes them) and backward to x, h and the output weight,
under autocast in fp16 (the recipe's precision) or bf16, or in fp32. Batches: ``--batch`` consecutive
LibriSpeech train-clean-100 (T, U) pairs (``data/librispeech_train_clean_100_TU.csv``: frames after the
encoder's 4x subsampling, and labels), each built once and shared by the contenders. Time: the mean over the
batches of the minimum of ``--rounds`` interleaved rounds of CUDA-event time per step, after an untimed step of
each contender on the batch (common.interleaved); memory: the peak above what the inputs and parameters hold.

The floor: the four GEMMs a fused step cannot avoid over the batch's N = sum_b T_b (U_b + 1) rows, 640 -> 1000
(the logits in forward and again in backward's recompute, dH and dW; common.floor_gemms), in the GEMMs' dtype
(fp16 or bf16 under autocast, else fp32), timed in the same rounds; each contender's time is also given as a
multiple of it.

Where SpeechBrain is not installed its loss is skipped and the joint is stood in for by torch modules of the
same arithmetic (GELU(x + h), then ``torch.nn.Linear``); the fused loss is then ``fused_joiner_loss`` reduced as
``fused_transducer_loss`` reduces it. SpeechBrain's numba loss needs numba and CUDA.

    python benchmarks/speechbrain_step.py                        # fp16, bf16, fp32
    python benchmarks/speechbrain_step.py --precision bf16 --batch 16 --json sb.json
"""

import argparse
import functools
import importlib
from typing import NamedTuple

import common  # first: it puts the repository root on sys.path
import numpy as np
import torch

from transducer import fused_joiner_loss
from transducer.integrations.speechbrain import absolute_lengths, fused_transducer_loss, transducer_loss

JOINT, VOCAB = 640, 1000  # joint_dim, output_neurons
PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
FLOOR = "floor (4 GEMMs)"


class StandInJoint(torch.nn.Module):
    """SpeechBrain's Transducer_joint(joint="sum", nonlinearity=GELU), where SpeechBrain is not installed."""

    def forward(self, x, h):
        return torch.nn.functional.gelu(x + h)


def modules(device="cuda"):
    """(Tjoint, transducer_lin, output weight, whether they are SpeechBrain's) as the recipe builds them."""
    try:
        from speechbrain.nnet.linear import Linear
        from speechbrain.nnet.transducer.transducer_joint import Transducer_joint
    except ImportError as e:
        print(f"SpeechBrain not importable ({e}): torch stand-ins for its joint, its loss skipped")
        lin = torch.nn.Linear(JOINT, VOCAB, bias=False, device=device)
        return StandInJoint(), lin, lin.weight, False
    lin = Linear(input_size=JOINT, n_neurons=VOCAB, bias=False).to(device)
    return Transducer_joint(joint="sum", nonlinearity=torch.nn.GELU), lin, lin.w.weight, True


def speechbrain_loss():
    """SpeechBrain's numba transducer_loss, or None with a printed reason."""
    if not hasattr(np, "row_stack"):  # numba-cuda still registers np.row_stack, which numpy 2.5 removed
        np.row_stack = np.vstack
    try:
        importlib.import_module("speechbrain.integrations.numba.transducer_loss")  # numba and CUDA
        from speechbrain.nnet.losses import transducer_loss as numba_loss
    except Exception as e:  # noqa: BLE001
        print(f"SpeechBrain's numba loss: not importable ({type(e).__name__}: {str(e)[:100]})")
        return None
    return numba_loss


class Batch(NamedTuple):
    """A batch as SpeechBrain's recipe gives it to the loss, and its rows N = sum_b T_b (U_b + 1)."""

    x: torch.Tensor  # (B, T, 640) projected encoder outputs
    h: torch.Tensor  # (B, U + 1, 640) projected decoder outputs
    tokens: torch.Tensor  # (B, U) labels in [1, 1000)
    wav_lens: torch.Tensor  # (B,) T_b / T, relative
    token_lens: torch.Tensor  # (B,) U_b / U, relative
    rows: int


def batches(count, batch, seed=0, device="cuda"):
    """``count`` Batches of ``batch`` consecutive LibriSpeech (T, U) pairs on ``device``."""
    rows = np.loadtxt(
        common.HERE / "data" / "librispeech_train_clean_100_TU.csv", delimiter=",", skiprows=1, dtype=np.int64
    )
    gen = torch.Generator().manual_seed(seed)
    for i in range(count):
        T, U = (torch.tensor(c) for c in rows[i * batch : (i + 1) * batch].T)
        max_t, max_u = int(T.max()), int(U.max())
        x = torch.randn(batch, max_t, JOINT, generator=gen).to(device).requires_grad_()
        h = torch.randn(batch, max_u + 1, JOINT, generator=gen).to(device).requires_grad_()
        tokens = torch.randint(1, VOCAB, (batch, max_u), generator=gen).to(device)
        wav_lens, token_lens = (T / max_t).to(device), (U / max_u).to(device)
        assert torch.equal(absolute_lengths(wav_lens, max_t).cpu(), T.int())  # the recipe's rounding gives them back
        yield Batch(x, h, tokens, wav_lens, token_lens, int((T * (U + 1)).sum()))


def contenders(joint, lin, weight, is_speechbrain, numba_loss):
    """{name: loss(x, h, tokens, wav_lens, token_lens)}."""

    def logits(x, h):
        return lin(joint(x.unsqueeze(2), h.unsqueeze(1)))

    def fused(x, h, tokens, wav_lens, token_lens):
        if is_speechbrain:
            return fused_transducer_loss(x, h, joint, lin, tokens, wav_lens, token_lens, blank_index=0)
        T, U = absolute_lengths(wav_lens, x.size(1)), absolute_lengths(token_lens, tokens.size(1))
        losses = fused_joiner_loss(x, h, weight, None, tokens, T, U, activation="gelu", blank=0, reduction="none")
        return (losses / T).mean()

    out = {}
    if numba_loss is not None:
        out["SpeechBrain (numba)"] = lambda x, h, *rest: numba_loss(logits(x, h), *rest, blank_index=0)
    out["transducer_loss"] = lambda x, h, *rest: transducer_loss(logits(x, h), *rest, blank_index=0)
    out["fused_transducer_loss"] = fused
    return out


def steps(losses, precision, weight):
    """common.interleaved's steps(batch): on a batch, {name: step()} of the floor and of each loss of ``losses``
    (``contenders``), under ``precision``."""
    dtype = PRECISIONS[precision]

    def on(batch):
        def clear():
            batch.x.grad = batch.h.grad = weight.grad = None

        def step(loss_fn):
            clear()
            with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
                loss = loss_fn(batch.x, batch.h, batch.tokens, batch.wav_lens, batch.token_lens)
            loss.backward()
            clear()

        out = {FLOOR: common.floor_gemms(batch.rows, JOINT, VOCAB, dtype or torch.float32)}
        out.update({name: functools.partial(step, loss_fn) for name, loss_fn in losses.items()})
        return out

    return on


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", nargs="*", choices=list(PRECISIONS), default=list(PRECISIONS))
    p.add_argument("--batch", type=int, default=8, help="utterances a batch (the recipe's batch_size: 8)")
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds a batch, the minimum kept")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, clock {common.gpu_clock()}; joint {JOINT} "
        f"-> {VOCAB}, GELU, batch {args.batch}"
    )
    torch.manual_seed(0)
    joint, lin, weight, is_speechbrain = modules()
    numba_loss = speechbrain_loss() if is_speechbrain else None
    losses = contenders(joint, lin, weight, is_speechbrain, numba_loss)
    results = []
    print(f"ms: the mean over {args.batches} batches of the minimum of {args.rounds} interleaved rounds")
    print(f"{'precision':10s}{'loss':24s}{'ms':>10s}{'peak MiB':>10s}{'x floor':>9s}")
    for precision in args.precision:
        timings = common.interleaved(batches(args.batches, args.batch), steps(losses, precision, weight), args.rounds)
        floor = timings[FLOOR].ms
        for name, t in timings.items():
            x_floor = t.ms / floor if t.ms is not None and floor else None
            results.append(
                dict(
                    precision=precision,
                    loss=name,
                    ms=t.ms,
                    peak_mib=t.peak_mib,
                    x_floor=x_floor,
                    batch=args.batch,
                    batches=t.batches,
                    rounds=args.rounds,
                    failed=t.failed,
                )
            )
            shown = (
                f"  {t.failed}"
                if t.failed
                else f"{t.ms:10.2f}{t.peak_mib:10.0f}" + (f"{x_floor:8.2f}x" if x_floor is not None else "")
            )
            print(f"{precision:10s}{name:24s}{shown}", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        common.write_results(args.json, results)


if __name__ == "__main__":
    main()
