"""The tests' one batch generator (random targets, lengths and padded logits) and the small conversions they
share: compact rows, the cell mask, tensors moved to a device."""

import pytest
import torch

# The tests that run on every device; the CUDA one only where tests/conftest.py finds a GPU and CuPy.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def random_targets(gen, B, max_t, max_u, V, blank, rna=False, min_t=1, min_u=0, edges=False):
    """Targets (B, max(max_u, 1)) and lengths T, U (B,) of a random ragged batch, on the CPU.

    T_b is drawn in [min_t, max_t] and U_b in [min_u, max_u], utterance 0 at the maxima. ``edges``: utterance 1
    gets T_b = 1 and utterance 2 U_b = 0 (where B allows). ``rna``: every U_b <= T_b - 1, so that an RNA
    alignment exists. Labels are uniform over [0, V) less ``blank`` (a column, or a sequence of columns)."""
    T = torch.randint(min_t, max_t + 1, (B,), generator=gen)
    U = torch.randint(min_u, max_u + 1, (B,), generator=gen)
    T[0], U[0] = max_t, max_u
    if edges and B > 1:
        T[1] = 1
    if edges and B > 2:
        U[2] = 0
    if rna:
        U = torch.minimum(U, T - 1)
    skip = set(blank) if isinstance(blank, (list, tuple)) else {int(blank)}
    labels = torch.tensor([v for v in range(V) if v not in skip])
    targets = labels[torch.randint(0, len(labels), (B, max(max_u, 1)), generator=gen)]
    return targets, T, U


def random_batch(
    gen, B, max_t, max_u, V, blank, dtype=torch.float64, rna=False, scale=1.0, min_t=1, min_u=0, edges=False, extra=0
):
    """Padded logits (B, max_t, max U_b + 1, V + extra) on the CPU, with random_targets' targets and lengths.

    The logits are normal, times ``scale``, drawn in float64 and then cast to ``dtype`` (the same values up to
    rounding in every dtype). ``extra``: columns after the V token columns (TDT's duration scores)."""
    targets, T, U = random_targets(gen, B, max_t, max_u, V, blank, rna, min_t, min_u, edges)
    logits = torch.randn(B, max_t, int(U.max()) + 1, V + extra, generator=gen, dtype=torch.float64) * scale
    return logits.to(dtype), targets, T, U


def compact(logits, T, U):
    """Padded -> compact by a plain loop (the tests' own, independent of pack)."""
    return torch.cat([logits[b, : T[b], : U[b] + 1].reshape(-1, logits.size(-1)) for b in range(len(T))])


def cell_mask(logits, T, U):
    """(B, maxT, maxU+1) bool: the cells of padded logits (not padding)."""
    mask = torch.zeros(logits.shape[:3], dtype=torch.bool, device=logits.device)
    for b in range(len(T)):
        mask[b, : T[b], : U[b] + 1] = True
    return mask


def to_device(device, *tensors):
    """The tensors on ``device``, as a tuple."""
    return tuple(t.to(device) for t in tensors)
