"""Integrations with other libraries. Each submodule imports its library lazily: ``transducer`` works without it.

- :mod:`transducer.integrations.transformers`: transformers' ``ParakeetForRNNT`` and ``ParakeetForTDT`` trained
  on this library's losses, with the joint fused into the loss.
- :mod:`transducer.integrations.nemo`: NeMo's transducer models (RNN-T, TDT, multi-blank; char, BPE and hybrid)
  trained on this library's losses, the joint's fused path over the whole batch.
- :mod:`transducer.integrations.espnet`: ESPnet's transducer models trained on this library's losses without
  warp-transducer (``install()`` offers them under ``import warprnnt_pytorch``), the joint fused with the loss.
- :mod:`transducer.integrations.speechbrain`: SpeechBrain's ``transducer_loss`` (relative lengths, its values), and
  the loss fused with its ``Transducer_joint`` and output ``Linear``.
- :mod:`transducer.integrations.reductions`: NeMo's reductions of per-utterance losses, which both use.
- :mod:`transducer.integrations.methods`: ``InstanceMethod``, the picklable bound method ``apply`` sets on a model.
"""
