"""The regularisers and losses against the peers that define them, on a CUDA machine (skipped where the peers
are not importable: benchmarks/README.md says how to install them): k2's delay penalty
(fast_rnnt.rnnt_loss), warp-rnnt's FastEmit (its gradient w.r.t. the log-probabilities it takes), NeMo's TDT
and multi-blank losses."""

import importlib.util

import pytest
import torch
from _batches import random_batch

from transducer import transducer_loss

pytestmark = pytest.mark.cuda


def peer(name):
    if importlib.util.find_spec(name.split(".")[0]) is None or importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not importable here (the GPU machine's .peers/setup.sh makes it so)")
    return importlib.import_module(name)


@pytest.mark.parametrize("delay_penalty", [0.1, 0.5])
def test_delay_penalty_matches_k2(delay_penalty):
    fast_rnnt = peer("fast_rnnt")
    gen = torch.Generator().manual_seed(90)
    # k2 asserts U_b >= 1
    logits, targets, T, U = random_batch(gen, 6, 30, 10, 50, 0, dtype=torch.float32, scale=2.0, min_t=2, min_u=1)
    T[2] = 2
    logits, targets, T, U = logits.cuda(), targets[:, : int(U.max())].cuda(), T.cuda(), U.cuda()
    boundary = torch.stack([torch.zeros_like(T), torch.zeros_like(T), U, T], dim=1).long()
    k2_in = logits.clone().requires_grad_()
    want = fast_rnnt.rnnt_loss(
        k2_in, targets.long(), termination_symbol=0, boundary=boundary, delay_penalty=delay_penalty, reduction="none"
    )
    weights = torch.rand(6, generator=gen).cuda() + 0.5
    (want * weights).sum().backward()
    x = logits.clone().requires_grad_()
    got = transducer_loss(x, targets, T, U, reduction="none", delay_penalty=delay_penalty)
    (got * weights).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    for b in range(6):
        torch.testing.assert_close(
            x.grad[b, : T[b], : U[b] + 1], k2_in.grad[b, : T[b], : U[b] + 1], rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("fastemit_lambda", [0.01, 0.5])
def test_fastemit_matches_warp_rnnt(fastemit_lambda):
    warp_rnnt = peer("warp_rnnt")
    gen = torch.Generator().manual_seed(91)
    logits, targets, T, U = random_batch(gen, 6, 25, 8, 40, 0, dtype=torch.float32, scale=2.0, min_t=2, min_u=1)
    log_probs = logits.log_softmax(-1).cuda()
    targets, T, U = targets[:, : int(U.max())].cuda(), T.cuda(), U.cuda()
    warp_in = log_probs.clone().requires_grad_()
    want = warp_rnnt.rnnt_loss(
        warp_in, targets.int(), T.int(), U.int(), reduction="none", blank=0, fastemit_lambda=fastemit_lambda
    )
    weights = torch.rand(6, generator=gen).cuda() + 0.5
    (want * weights).sum().backward()
    x = log_probs.clone().requires_grad_()
    got = transducer_loss(x, targets, T, U, reduction="none", from_log_softmax=True, fastemit_lambda=fastemit_lambda)
    (got * weights).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    for b in range(6):
        torch.testing.assert_close(
            x.grad[b, : T[b], : U[b] + 1], warp_in.grad[b, : T[b], : U[b] + 1], rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("sigma", [0.0, 0.05])
def test_tdt_matches_nemo(sigma):
    import numpy as np

    if not hasattr(np, "row_stack"):  # NeMo 3.0's numba loss still calls it
        np.row_stack = np.vstack
    nemo = peer("nemo.collections.asr.parts.numba.rnnt_loss")
    from transducer import tdt_loss

    gen = torch.Generator().manual_seed(92)
    B, max_t, max_u, V, durations = 6, 30, 10, 40, [0, 1, 2, 3, 4]
    # blank = V - 1, as in NeMo's examples
    logits, targets, T, U = random_batch(
        gen, B, max_t, max_u, V, V - 1, dtype=torch.float32, scale=2.0, min_t=max_t // 2, min_u=1, extra=len(durations)
    )
    logits, targets, T, U = logits.cuda(), targets.cuda(), T.cuda(), U.cuda()
    nemo_in = logits.clone().requires_grad_()
    want = nemo.TDTLossNumba(blank=V - 1, durations=durations, reduction="none", sigma=sigma)(
        acts=nemo_in, labels=targets.long(), act_lens=T.long(), label_lens=U.long()
    )
    weights = torch.rand(B, generator=gen).cuda() + 0.5
    (want * weights).sum().backward()
    x = logits.clone().requires_grad_()
    got = tdt_loss(x, targets, T, U, durations, blank=V - 1, sigma=sigma, reduction="none")
    (got * weights).sum().backward()
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-4)
    for b in range(B):
        torch.testing.assert_close(
            x.grad[b, : T[b], : U[b] + 1], nemo_in.grad[b, : T[b], : U[b] + 1], rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("seed", range(4))
def test_multiblank_matches_nemo(seed):
    # NeMo's MultiblankRNNTLossNumba (big blank i in column blank - 1 - i, as its kernel reads it), on random
    # ragged batches with T_b = 1, U_b = 0 and T_b shorter than a big blank; its reduction "none" is per utterance
    import numpy as np

    if not hasattr(np, "row_stack"):  # NeMo 3.0's numba loss still calls it
        np.row_stack = np.vstack
    nemo = peer("nemo.collections.asr.parts.numba.rnnt_loss")
    from transducer import multiblank_loss

    gen = torch.Generator().manual_seed(93 + seed)
    B, max_t, max_u, V, big = 6, 24, 8, 40, [2, 4, 8]
    sigma = (0.0, 0.05)[seed % 2]
    # labels avoid the blank (V - 1) and the big blanks before it
    logits, targets, T, U = random_batch(
        gen, B, max_t, max_u, V, tuple(range(V - 1 - len(big), V)), dtype=torch.float32, scale=2.0, edges=True
    )
    T[3] = 3
    logits, targets, T, U = logits.cuda(), targets.cuda(), T.cuda(), U.cuda()
    nemo_in = logits.clone().requires_grad_()
    want = nemo.MultiblankRNNTLossNumba(blank=V - 1, big_blank_durations=big, reduction="none", sigma=sigma)(
        nemo_in, targets.long(), T.long(), U.long()
    )
    weights = torch.rand(B, generator=gen).cuda() + 0.5
    (want * weights).sum().backward()
    x = logits.clone().requires_grad_()
    got = multiblank_loss(x, targets, T, U, big, blank=-1, sigma=sigma, reduction="none")
    (got * weights).sum().backward()
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-4)
    for b in range(B):
        torch.testing.assert_close(
            x.grad[b, : T[b], : U[b] + 1], nemo_in.grad[b, : T[b], : U[b] + 1], rtol=1e-4, atol=1e-5
        )
    # its reduction "mean" is the batch's sum over B, as ours (NeMo's RNNTLoss divides by target lengths)
    mean = nemo.MultiblankRNNTLossNumba(blank=V - 1, big_blank_durations=big, reduction="mean", sigma=sigma)(
        logits.clone(), targets.long(), T.long(), U.long()
    )
    torch.testing.assert_close(
        multiblank_loss(logits, targets, T, U, big, blank=-1, sigma=sigma).reshape(()),
        mean.float().reshape(()),
        rtol=1e-5,
        atol=1e-4,
    )
