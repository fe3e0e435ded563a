"""Transducer (RNN-T) and one-symbol-per-frame (RNA) loss over compact or padded logits, CPU and CUDA."""

from .fused import FusedJoinerLoss, fused_joiner_loss
from .loss import RNNTLoss, TransducerLoss, rnnt_loss, transducer_loss
from .pack import pack
from .reference import transducer_loss_reference

__all__ = ["TransducerLoss", "transducer_loss", "RNNTLoss", "rnnt_loss", "FusedJoinerLoss", "fused_joiner_loss", "pack",
           "transducer_loss_reference"]
