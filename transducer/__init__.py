"""Transducer losses (RNN-T, one-symbol-per-frame RNA, Token-and-Duration TDT, multi-blank RNN-T) over compact or
padded logits, CPU and CUDA; the joiner fused with the loss."""

from .fused import FusedJoinerLoss, fused_joiner_loss
from .loss import RNNTLoss, TransducerLoss, rnnt_loss, transducer_loss
from .multiblank import MultiblankLoss, multiblank_loss
from .pack import pack
from .reference import multiblank_loss_reference, tdt_loss_reference, transducer_loss_reference
from .tdt import TDTLoss, tdt_loss

__all__ = [
    "TransducerLoss",
    "transducer_loss",
    "RNNTLoss",
    "rnnt_loss",
    "FusedJoinerLoss",
    "fused_joiner_loss",
    "TDTLoss",
    "tdt_loss",
    "MultiblankLoss",
    "multiblank_loss",
    "pack",
    "transducer_loss_reference",
    "tdt_loss_reference",
    "multiblank_loss_reference",
]
