"""The joiner and the loss fused, so that no logits exist in memory: ``fused_joiner_loss`` and ``FusedJoinerLoss``
(loss.py), the registered op (op.py) and its two tile paths (tiles.py: the interface and the choice; cublas_tiles.py:
torch's GEMMs and the stages; hopper_tiles.py: transducer.hopper's kernels on sm_90)."""

from .loss import FusedJoinerLoss, fused_joiner_loss

__all__ = ["fused_joiner_loss", "FusedJoinerLoss"]
