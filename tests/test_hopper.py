"""transducer.hopper's logits statistics (the CuTe DSL kernel for sm_90) against a float32 torch reference on random
inputs: V not a multiple of the vocabulary tile and smaller than one, row counts not a multiple of the row tile, J not
a multiple of the K tile, rows without a label (-1), with and without a bias, bfloat16 and float16; and the argument
checks, which run anywhere."""

import pytest
import torch

from transducer import hopper

needs_hopper = pytest.mark.skipif(not hopper.available(), reason="needs an sm_90 GPU and nvidia-cutlass-dsl "
                                                                 "(pip install nvidia-cutlass-dsl)")


def reference(H, W, bias, labels, blank):
    """(den, z_blank, z_label) from the logits Z = H W^T + bias in float32 (H and W's products are exact there)."""
    Z = H.float() @ W.float().t()
    if bias is not None:
        Z += bias.float()
    rows = torch.arange(Z.size(0), device=Z.device)
    z_label = torch.where(labels >= 0, Z[rows, labels.clamp(min=0).long()], 0.0)
    return torch.logsumexp(Z, dim=1), Z[:, blank], z_label


def random_inputs(N, J, V, dtype, with_bias, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    H = torch.randn(N, J, device="cuda", generator=g).to(dtype)
    W = (torch.randn(V, J, device="cuda", generator=g) / J ** 0.5).to(dtype)
    bias = torch.randn(V, device="cuda", generator=g) if with_bias else None
    labels = torch.randint(0, V, (N,), device="cuda", generator=g, dtype=torch.int32)
    labels[torch.rand(N, device="cuda", generator=g) < 0.2] = -1
    return H, W, bias, labels


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("N, J, V, blank, dtype, with_bias", [
    (1000, 512, 500, 0, torch.bfloat16, False),  # Protocol A's joint; 1000 rows: a partial row tile
    (777, 640, 1024, 1023, torch.bfloat16, True),  # whole vocabulary tiles, the blank last
    (300, 640, 8198, 5, torch.bfloat16, True),  # Parakeet-TDT's joint width: 33 vocabulary tiles
    (129, 200, 37, 36, torch.float16, True),  # V under one tile, J not a multiple of the K tile
    (64, 8, 300, 299, torch.bfloat16, False),  # J of one 16-byte vector
])
def test_matches_reference(N, J, V, blank, dtype, with_bias):
    H, W, bias, labels = random_inputs(N, J, V, dtype, with_bias, seed=N + V)
    den, z_blank, z_label = hopper.logits_statistics(H, W, bias, labels, blank)
    ref_den, ref_blank, ref_label = reference(H, W, bias, labels, blank)
    for name, got, want in (("den", den, ref_den), ("z_blank", z_blank, ref_blank), ("z_label", z_label, ref_label)):
        assert got.shape == (N,) and got.dtype == torch.float32, name
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-5, msg=lambda m: f"{name}: {m}")
    assert (z_label[labels < 0] == 0).all()


@pytest.mark.cuda
@needs_hopper
def test_large_logits_and_reuse():
    """Logits far from 0 (the running max carries the sum) and a second call of the compiled kernel with another row
    count and V of the same vocabulary tiles."""
    H, W, bias, labels = random_inputs(2048, 512, 500, torch.bfloat16, True, seed=1)
    bias = bias * 100
    for rows, cols in ((2048, 500), (1500, 480)):
        args = (H[:rows], W[:cols].contiguous(), bias[:cols], labels[:rows].clamp(max=cols - 1), 3)
        got = hopper.logits_statistics(*args)
        want = reference(*args)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-3, rtol=2e-5)


def test_argument_checks():
    H = torch.zeros(4, 8, dtype=torch.bfloat16)
    W = torch.zeros(6, 8, dtype=torch.bfloat16)
    labels = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="H: expected a 2-D bfloat16 or float16"):
        hopper.logits_statistics(H.float(), W, None, labels, 0)
    with pytest.raises(ValueError, match="H: expected a contiguous CUDA tensor"):
        hopper.logits_statistics(H, W, None, labels, 0)
    if torch.cuda.is_available():
        H, W, labels = H.cuda(), W.cuda(), labels.cuda()
        with pytest.raises(ValueError, match="W: expected"):
            hopper.logits_statistics(H, W[:, :4], None, labels, 0)
        with pytest.raises(ValueError, match="labels: expected an int32"):
            hopper.logits_statistics(H, W, None, labels.long(), 0)
        with pytest.raises(ValueError, match="blank: expected a column in"):
            hopper.logits_statistics(H, W, None, labels, 6)
        with pytest.raises(ValueError, match="bias: expected None or a floating"):
            hopper.logits_statistics(H, W, torch.zeros(5, device="cuda"), labels, 0)


def test_available_without_a_gpu_or_package():
    """available() answers False rather than failing where there is no CUDA device or no sm_90 one."""
    if not torch.cuda.is_available():
        assert hopper.available() is False
    assert hopper.available("cpu") is False
