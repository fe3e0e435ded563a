"""Integrations with other libraries. Each submodule imports its library lazily: ``transducer`` works without it.

- :mod:`transducer.integrations.transformers`: transformers' ``ParakeetForRNNT`` and ``ParakeetForTDT`` trained
  on this library's losses, with the joint fused into the loss.
"""
