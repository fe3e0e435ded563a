"""NeMo's reductions of per-utterance transducer losses, which transformers' Parakeet losses took with their names.

``reduce(losses, target_lengths, reduction)`` for ``losses`` and ``target_lengths`` of shape ``(B,)``:

- ``"mean_batch"``: the mean of the losses;
- ``"mean"``: each loss over its own target length, then the mean (an utterance with no labels makes it inf
  or NaN, as in NeMo and transformers);
- ``"mean_volume"``: the sum of the losses over the sum of the target lengths;
- ``"sum"``: the sum;
- ``None`` or ``"none"``: the losses as they are.
"""


def reduce(losses, target_lengths, reduction):
    """``losses`` reduced as NeMo's ``RNNTLoss.reduce`` does (see the module's docstring)."""
    if reduction == "mean_batch":
        return losses.mean()
    if reduction == "mean":
        return (losses / target_lengths.to(losses.device, losses.dtype)).mean()
    if reduction == "mean_volume":
        return losses.sum() / target_lengths.to(losses.device, losses.dtype).sum()
    if reduction == "sum":
        return losses.sum()
    return losses
