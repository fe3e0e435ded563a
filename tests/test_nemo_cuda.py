"""transducer.integrations.nemo's RNNTLoss on CUDA against NeMo's numba CUDA losses (RNNTLossNumba, TDTLossNumba,
MultiblankRNNTLossNumba: NeMo's TDT and multi-blank losses run on CUDA only), with their options, in float32 and
bf16; and the fused joint loss against NeMo's loss of the joint it stands for. Needs NeMo's numba losses (the
nemo-toolkit package, or a copy of them on PYTHONPATH: benchmarks/README.md, Peers)."""

import importlib

import numpy as np
import pytest
import torch
from _batches import random_batch

from transducer.integrations.nemo import RNNTLoss

pytestmark = pytest.mark.cuda

CASES = {  # loss_name: (NeMo's numba class, its options, extra columns)
    "warprnnt_numba": ("RNNTLossNumba", {"fastemit_lambda": 0.1, "clamp": 0.02}, 0),
    "tdt": ("TDTLossNumba", {"durations": [0, 1, 2, 4], "sigma": 0.05, "fastemit_lambda": 0.1, "clamp": 0.02}, 4),
    "multiblank_rnnt": (
        "MultiblankRNNTLossNumba",
        {"big_blank_durations": [2, 3], "sigma": 0.05, "fastemit_lambda": 0.1},
        0,
    ),
}


def nemo_numba(name):
    if not hasattr(np, "row_stack"):  # NeMo 3.0's numba losses call it; numpy 2.5 removed it
        np.row_stack = np.vstack
    try:
        module = importlib.import_module("nemo.collections.asr.parts.numba.rnnt_loss")
    except Exception as e:  # noqa: BLE001 - NeMo or numba missing or broken: nothing to compare with
        pytest.skip(f"NeMo's numba losses are not importable ({type(e).__name__}: {e})")
    return getattr(module, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss_name", list(CASES))
def test_loss_equals_nemos_cuda_loss(loss_name, dtype):
    cls, kwargs, extra = CASES[loss_name]
    gen = torch.Generator().manual_seed(11)
    V = 40  # the blank last of the token columns, as NeMo's models put it
    logits, targets, T, U = random_batch(
        gen, 6, 9, 5, V - 4, V - 4, dtype=torch.float64, scale=2.0, edges=True, extra=4 + extra
    )
    logits, targets, T, U = (x.cuda() for x in (logits.to(dtype), targets, T, U))
    x = logits.clone().requires_grad_()
    theirs = nemo_numba(cls)(blank=V - 1, reduction="none", **kwargs)
    want = theirs(acts=x.float(), labels=targets.long(), act_lens=T.long(), label_lens=U.long())
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    ours = RNNTLoss(V - 1, reduction="sum", loss_name=loss_name, loss_kwargs=kwargs)
    got = ours(log_probs=x, targets=targets, input_lengths=T, target_lengths=U)
    (got_grad,) = torch.autograd.grad(got, x)
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    torch.testing.assert_close(got, want.sum(), rtol=1e-5, atol=1e-4)
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-3)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), **tolerance)


@pytest.mark.parametrize("loss_name", list(CASES))
def test_joint_loss_equals_nemos_loss_of_the_joint(loss_name):
    """RNNTLoss.joint_loss (the fused path of apply) against NeMo's loss of relu(f + g) @ W.T + b, float32."""
    cls, kwargs, extra = CASES[loss_name]
    gen = torch.Generator().manual_seed(12)
    B, T_max, U_max, H, V = 5, 11, 6, 24, 50
    T = torch.tensor([11, 1, 7, 4, 9])
    U = torch.tensor([6, 2, 0, 3, 5])
    f = torch.randn(B, T_max, H, generator=gen).cuda().requires_grad_()
    g = torch.randn(B, U_max + 1, H, generator=gen).cuda().requires_grad_()
    C = V + (len(kwargs.get("durations", ())) if loss_name == "tdt" else 0)
    weight = (0.3 * torch.randn(C, H, generator=gen)).cuda().requires_grad_()
    bias = torch.randn(C, generator=gen).cuda().requires_grad_()
    y = torch.randint(0, V - 4, (B, U_max), generator=gen).cuda()
    T, U = T.cuda(), U.cuda()
    params = (f, g, weight, bias)
    joint = torch.relu(f[:, :, None] + g[:, None]) @ weight.T + bias
    theirs = nemo_numba(cls)(blank=V - 1, reduction="none", **kwargs)
    want = theirs(acts=joint, labels=y, act_lens=T, label_lens=U).mean()
    want_grads = torch.autograd.grad(want, params)
    ours = RNNTLoss(V - 1, loss_name=loss_name, loss_kwargs=kwargs)
    got = ours.reduce(ours.joint_loss(f, g, weight, bias, y, T, U, "relu"), U)
    got_grads = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got_grad, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5)
