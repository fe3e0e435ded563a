"""Random transducer batches and layout conversions shared by the CPU and CUDA tests."""

import pytest
import torch

# The loss tests that run on every device; the CUDA one only where tests/conftest.py finds a GPU and CuPy.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def random_batch(gen, B, max_t, max_u, V, blank, dtype=torch.float64, rna=False, scale=1.0, min_t=1, min_u=0):
    """Padded logits (B, maxT, maxU+1, V) on the CPU, targets avoiding blank, ragged lengths (one at the max)."""
    T = torch.randint(min_t, max_t + 1, (B,), generator=gen)
    U = torch.randint(min_u, max_u + 1, (B,), generator=gen)
    T[0], U[0] = max_t, max_u
    if rna:  # keep every alignment feasible: U_b <= T_b - 1
        U = torch.minimum(U, T - 1)
    labels = torch.tensor([v for v in range(V) if v != blank])
    targets = labels[torch.randint(0, len(labels), (B, max(max_u, 1)), generator=gen)]
    logits = torch.randn(B, max_t, int(U.max()) + 1, V, generator=gen, dtype=torch.float64) * scale
    return logits.to(dtype), targets, T, U


def compact(logits, T, U):
    """Padded -> compact by a plain loop (the tests' own, independent of pack)."""
    return torch.cat([logits[b, :T[b], :U[b] + 1].reshape(-1, logits.size(-1)) for b in range(len(T))])


def cell_mask(logits, T, U):
    """(B, maxT, maxU+1) bool: the cells of padded logits (not padding)."""
    mask = torch.zeros(logits.shape[:3], dtype=torch.bool, device=logits.device)
    for b in range(len(T)):
        mask[b, :T[b], :U[b] + 1] = True
    return mask
