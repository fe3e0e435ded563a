"""The joiner's hidden h = dropout(act(a)), a = enc + pred: its activations, one table, and its dropout mask, one
function. The CPU stages, the CUDA pack kernels (pack.cu's ``enum Activation``, whose values
tests/test_kernel_params.py checks against ``code`` here, and its ``dropout_keep``, the same arithmetic),
``FusedJoinerLoss.logits`` and the integrations all read them.

Each activation gives h = act(a) and its derivative act'(a), from h where h alone gives it (tanh: 1 - h^2, relu:
[h > 0], leaky_relu: 1 where h > 0 else its negative slope, sigmoid: h (1 - h)), else from a (gelu, silu).

Dropout (NeMo's joint: activation, Dropout, Linear) keeps element (r, j) of the hidden, r the row of the compact
layout and j the column, where a hash of (seed, r, j) clears the rate p, and scales it by 1 / (1 - p): the mask
is a function of the seed and the position, so the backward's recompute (and a test) draws the same one, and
no mask is stored.
"""

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .checks import is_number

__all__ = [
    "Activation",
    "ACTIVATIONS",
    "LEAKY_RELU_SLOPE",
    "activation",
    "check_activation",
    "Dropout",
    "check_dropout",
    "dropout_keep",
    "dropout_mask",
]


class Activation(NamedTuple):
    name: str
    code: int  # pack.cu: enum Activation
    forward: Callable[[torch.Tensor], torch.Tensor]  # act(a)
    slope: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # act'(a), given (a, h = act(a))


def _gelu_slope(a, h):
    # gelu(a) = a Phi(a): Phi(a) + a phi(a)
    return 0.5 * (1 + torch.erf(a * math.sqrt(0.5))) + a * torch.exp(-0.5 * a * a) * (1 / math.sqrt(2 * math.pi))


def _silu_slope(a, h):
    # silu(a) = a s(a): s + a s (1 - s) = s + h (1 - s)
    s = torch.sigmoid(a)
    return s + h * (1 - s)


#: leaky_relu's negative slope: torch.nn.LeakyReLU's default, which SpeechBrain's Transducer_joint uses
#: (it builds its nonlinearity with no arguments, LeakyReLU by default).
LEAKY_RELU_SLOPE = 0.01


def _leaky_relu_slope(a, h):
    # 1 where h > 0, else the negative slope (at 0 too, as torch's leaky_relu backward)
    return torch.full_like(h, LEAKY_RELU_SLOPE).masked_fill_(h > 0, 1)


#: By name, as fused_joiner_loss's ``activation`` takes them: NeMo's joint activations (relu, sigmoid, tanh),
#: transformers' ``hidden_act`` values gelu (the erf form) and silu, SpeechBrain's default leaky_relu, and the
#: identity.
ACTIVATIONS = {
    a.name: a
    for a in (
        Activation("identity", 0, lambda a: a, lambda a, h: torch.ones_like(h)),
        Activation("tanh", 1, torch.tanh, lambda a, h: 1 - h * h),
        Activation("relu", 2, torch.relu, lambda a, h: (h > 0).to(h.dtype)),
        Activation("sigmoid", 3, torch.sigmoid, lambda a, h: h * (1 - h)),
        Activation("gelu", 4, F.gelu, _gelu_slope),
        Activation("silu", 5, F.silu, _silu_slope),
        Activation("leaky_relu", 6, lambda a: F.leaky_relu(a, LEAKY_RELU_SLOPE), _leaky_relu_slope),
    )
}


def check_activation(name):
    """ValueError unless ``name`` is an activation of the table."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {tuple(ACTIVATIONS)}, got {name!r}")


def activation(name):
    """The Activation called ``name`` (checked)."""
    check_activation(name)
    return ACTIVATIONS[name]


class Dropout(NamedTuple):
    """The joiner's dropout: rate p in [0, MAX_DROPOUT] (0: none) and the seed of its mask (a 64-bit int)."""

    p: float = 0.0
    seed: int = 0

    @property
    def threshold(self):
        """The mask keeps an element where its hash's top 24 bits are at least this."""
        return min(int(round(self.p * (1 << 24))), (1 << 24) - 1)


#: The largest dropout rate: the mask keeps an element by a 24-bit hash against round(p 2^24), so that a keep rate
#: of 2^-10 or more scales the kept elements by 1 / (1 - p) to within 2^-15 of the rate they are kept at.
MAX_DROPOUT = 1 - 2**-10


def check_dropout(p):
    """The rate ``p``: TypeError unless a number, ValueError unless in [0, MAX_DROPOUT]."""
    if not is_number(p):
        raise TypeError(f"dropout: expected a number in [0, 1 - 2^-10], got {type(p).__name__} {p!r}")
    if not 0 <= p <= MAX_DROPOUT:
        raise ValueError(
            f"dropout: expected a number in [0, 1 - 2^-10] (the mask's 24-bit hashes keep a rate of 2^-10 or more "
            f"unbiased), got {p!r}"
        )


_MASK32 = 0xFFFFFFFF


def _mul32(a, b):
    """(a * b) mod 2^32 for int64 tensors a in [0, 2^32) and an int b in [0, 2^32), without int64 overflow."""
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h):
    """MurmurHash3's finalizer (a bijection of 32-bit words that mixes every bit into every other)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def dropout_keep(dropout, rows, cols):
    """Bool (len(rows), len(cols)): whether the hidden's element (r, j) is kept, for int64 tensors of rows r and
    columns j: h = fmix32(fmix32(r * 0x9E3779B1 ^ seed_lo) ^ j * 0x85EBCA77 ^ seed_hi), kept where h >> 8 >=
    round(p 2^24) (pack.cu's dropout_keep: the same arithmetic on uint32)."""
    lo, hi = dropout.seed & _MASK32, (dropout.seed >> 32) & _MASK32
    h = _fmix32(_mul32(rows & _MASK32, 0x9E3779B1) ^ lo)
    h = _fmix32(h[:, None] ^ _mul32(cols & _MASK32, 0x85EBCA77)[None, :] ^ hi)
    return (h >> 8) >= dropout.threshold


def dropout_mask(dropout, num_rows, width, row_start=0, dtype=torch.float32, device=None):
    """The factors (num_rows, width) the hidden's rows [row_start, row_start + num_rows) are multiplied by: 1 / (1 -
    p) where kept, 0 elsewhere (all ones for p = 0): ``dropout(act(a))`` of the unfused joiner, as the fused loss
    draws it."""
    rows = torch.arange(row_start, row_start + num_rows, device=device)
    keep = dropout_keep(dropout, rows, torch.arange(width, device=device))
    return keep.to(dtype) / (1 - dropout.p)
