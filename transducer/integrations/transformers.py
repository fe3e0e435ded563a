"""transformers' Parakeet transducers (``ParakeetForRNNT``, ``ParakeetForTDT``) trained on this library's losses.

Example::

    >>> from transformers import ParakeetForTDT
    >>> from transducer.integrations.transformers import apply
    >>> model = apply(ParakeetForTDT.from_pretrained("nvidia/parakeet-tdt-0.6b-v3"))
    >>> model(**batch).loss.backward()    # batch: input_features, attention_mask, decoder_input_ids, labels

:func:`ParakeetForRNNTLoss` and :func:`ParakeetForTDTLoss` take transformers' arguments and need torch alone;
:func:`apply` imports transformers (5.12 or newer) when called.
"""

from typing import Any, Sequence

import torch
from torch import Tensor

from .. import fused_joiner_loss, tdt_loss, transducer_loss
from ..joiner import ACTIVATIONS as JOINER_ACTIVATIONS
from .methods import InstanceMethod
from .reductions import reduce

__all__ = ["ParakeetForRNNTLoss", "ParakeetForTDTLoss", "apply"]

REDUCTIONS = ("mean_volume", "mean_batch", "mean", "sum", "none")

# config.hidden_act -> the joiner's activation (transducer/joiner.py): its names, and transformers' "linear"
# (the identity) and "swish" (silu); transformers' "gelu" is the erf form, as the joiner's.
ACTIVATIONS = dict({name: name for name in JOINER_ACTIVATIONS}, linear="identity", swish="silu")


def _check_reduction(reduction):  # transformers' message
    if reduction not in REDUCTIONS:
        raise ValueError(
            f'Invalid reduction mode "{reduction}". Expected one of {", ".join(repr(r) for r in REDUCTIONS)}.'
        )


def ParakeetForRNNTLoss(
    logits: Tensor,
    labels: Tensor,
    logit_lengths: Tensor,
    label_lengths: Tensor,
    blank_token_id: int,
    reduction: str = "mean_volume",
    **kwargs: Any,
) -> Tensor:
    r"""transformers' ``ParakeetForRNNTLoss`` (the RNN-T loss ``ParakeetForRNNT`` trains with) on
    :func:`transducer.transducer_loss`: no torchaudio, no float32 copy of 16-bit logits, right on every device
    (torchaudio's CUDA loss is wrong for an utterance with ``T_b = 1`` or ``U_b = 0``).

    Args:
        logits (Tensor): ``(B, maxT, maxU+1, V)`` joint scores, float16 / bfloat16 / float32 / float64, read as
            they are.
        labels (Tensor): ``(B, S)`` int32 / int64, ``S >= max U_b``; entries past ``U_b`` are ignored.
        logit_lengths (Tensor): ``(B,)`` frames ``T_b >= 1``.
        label_lengths (Tensor): ``(B,)`` labels ``U_b >= 0``.
        blank_token_id (int): the blank index; negative counts from the end.
        reduction (str, optional): ``"mean_volume"`` (the sum of the losses over the sum of ``label_lengths``),
            ``"mean_batch"`` (their mean), ``"mean"`` (each loss over its own ``U_b``, then the mean: an
            utterance with ``U_b = 0`` makes it inf or NaN, as in transformers), ``"sum"`` or ``"none"``.
            (Default: ``"mean_volume"``)
        **kwargs: ignored (the model passes its forward's extra keyword arguments).

    Returns:
        Tensor: float32 (float64 for float64 logits): a scalar, or ``(B,)`` for ``"none"``. The gradient flows to
        ``logits``, in their dtype.
    """
    _check_reduction(reduction)
    device = logits.device
    label_lengths = label_lengths.to(device)
    losses = transducer_loss(
        logits, labels.to(device), logit_lengths.to(device), label_lengths, blank=blank_token_id, reduction="none"
    )
    return reduce(losses, label_lengths, reduction)


def ParakeetForTDTLoss(
    token_logits: Tensor,
    duration_logits: Tensor,
    labels: Tensor,
    logit_lengths: Tensor,
    label_lengths: Tensor,
    blank_token_id: int,
    durations: Sequence[int],
    sigma: float = 0.0,
    reduction: str = "mean",
    **kwargs: Any,
) -> Tensor:
    r"""transformers' ``ParakeetForTDTLoss`` (the TDT loss ``ParakeetForTDT`` trains with) on
    :func:`transducer.tdt_loss`: the two heads read in place (column slices of one joint output are fine), 16-bit
    scores without a float32 copy, and a finite gradient whatever the durations (transformers' loss gives NaN
    gradients when ``durations`` has no 0).

    Args:
        token_logits (Tensor): ``(B, maxT, maxU+1, V)`` token scores (blank among them), float16 / bfloat16 /
            float32 / float64.
        duration_logits (Tensor): ``(B, maxT, maxU+1, D)`` duration scores, the dtype of ``token_logits``.
        labels (Tensor): ``(B, S)`` int32 / int64, ``S >= max U_b``; entries past ``U_b`` are ignored.
        logit_lengths (Tensor): ``(B,)`` frames ``T_b >= 1``.
        label_lengths (Tensor): ``(B,)`` labels ``U_b >= 0``.
        blank_token_id (int): the blank index among the V token columns; negative counts from the end.
        durations (list of int): the D durations: distinct ints >= 0, at least one >= 1 (floats are refused, as
            :func:`transducer.tdt_loss` refuses them).
        sigma (float, optional): logit under-normalisation: token log-probs are ``log_softmax - sigma``.
            (Default: ``0.0``)
        reduction (str, optional): ``"mean_volume"``, ``"mean_batch"``, ``"mean"`` (each loss over its own
            ``U_b``, then the mean: an utterance with ``U_b = 0`` makes it inf or NaN, as in transformers),
            ``"sum"`` or ``"none"``, as for :func:`ParakeetForRNNTLoss`. (Default: ``"mean"``)
        **kwargs: ignored (the model passes its forward's extra keyword arguments).

    Returns:
        Tensor: float32 (float64 for float64 scores): a scalar, or ``(B,)`` for ``"none"``. An utterance with no
        alignment gets ``+inf`` and zero gradient.
    """
    _check_reduction(reduction)
    device = token_logits.device
    label_lengths = label_lengths.to(device)
    losses = tdt_loss(
        token_logits,
        labels.to(device),
        logit_lengths.to(device),
        label_lengths,
        durations=durations,
        blank=blank_token_id,
        sigma=sigma,
        reduction="none",
        duration_logits=duration_logits,
    )
    return reduce(losses, label_lengths, reduction)


def _parakeet_classes():
    """transformers' ParakeetForRNNT and ParakeetForTDT, or an ImportError naming the version needed."""
    need = (
        "transducer.integrations.transformers needs transformers >= 5.12 (ParakeetForTDT came in 5.10, "
        "ParakeetForRNNT in 5.12)"
    )
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"{need}: pip install 'transformers>=5.12'") from e
    try:
        from transformers import ParakeetForRNNT, ParakeetForTDT
    except ImportError as e:
        raise ImportError(f"{need}; found transformers {transformers.__version__}") from e
    return ParakeetForRNNT, ParakeetForTDT


def apply(model: torch.nn.Module, fused: bool = True) -> torch.nn.Module:
    r"""Train a transformers ``ParakeetForRNNT`` or ``ParakeetForTDT`` (or a subclass) on this library's losses.

    Sets ``model.loss_function`` to :func:`ParakeetForRNNTLoss` or :func:`ParakeetForTDTLoss`. With ``fused``,
    a forward with ``labels`` computes the loss by :func:`transducer.fused_joiner_loss` from the projected encoder
    output (``pooler_output``), the decoder output, ``model.joint.head``'s weight and bias (TDT: its V token
    rows then its D duration rows) and the joint's activation, so that no ``(B, T, U+1, V)`` logits exist in
    forward or backward: the output then has ``loss`` and ``logits=None``, everything else as transformers returns
    it. The loss, its reductions (``reduction=``, and ``sigma=`` for TDT, passed to the forward as transformers
    takes them) and the label lengths (RNN-T: ``labels != blank_token_id``; TDT: ``labels != pad_token_id``) are
    the model's. A forward without ``labels`` (decoding, ``generate``) is transformers' own; so is every forward
    once ``model.loss_function`` is set to another function. Call it before wrapping the model in
    ``DistributedDataParallel`` or ``torch.compile``; autocast and gradient checkpointing work as they do without
    it. ``apply(model, fused=False)`` undoes the fused forward and keeps the loss function.

    Args:
        model (ParakeetForRNNT or ParakeetForTDT): the model, changed in place.
        fused (bool, optional): fuse the joint's output layer with the loss in training. (Default: ``True``)

    Returns:
        the model.

    Raises:
        TypeError: ``model`` is not a ``ParakeetForRNNT`` or ``ParakeetForTDT``.
        ValueError: ``fused`` and the joint's activation (``config.hidden_act``) is not one of
            ``ACTIVATIONS`` (relu, tanh, sigmoid, gelu, silu or swish, leaky_relu, identity or linear), or the
            model's class has its own forward, or ``model.joint`` is not transformers' joint network.
        ImportError: transformers older than 5.12 (no ``ParakeetForRNNT``) or missing.
    """
    rnnt_class, tdt_class = _parakeet_classes()
    if isinstance(model, tdt_class):
        loss_function = ParakeetForTDTLoss
    elif isinstance(model, rnnt_class):
        loss_function = ParakeetForRNNTLoss
    else:
        raise TypeError(f"model: expected a transformers ParakeetForRNNT or ParakeetForTDT, got {type(model).__name__}")
    if fused:
        _check_fusable(model, rnnt_class, tdt_class)
    model.loss_function = loss_function
    if fused:
        model.forward = InstanceMethod(_fused_forward, model)
    elif getattr(model.__dict__.get("forward"), "__func__", None) is _fused_forward:
        del model.forward
    return model


def _check_fusable(model, rnnt_class, tdt_class):
    """The fused forward stands for transformers' forward and joint: refuse a model that changes either."""
    from transformers.models.parakeet.modeling_parakeet import ParakeetRNNTJointNetwork

    unfused = "or apply(model, fused=False)"
    if model.config.hidden_act not in ACTIVATIONS:
        raise ValueError(
            f"model: the joint's activation {model.config.hidden_act!r} (config.hidden_act) cannot be "
            f"fused; expected one of {', '.join(map(repr, ACTIVATIONS))}, {unfused}"
        )
    if type(model).forward not in (rnnt_class.forward, tdt_class.forward):
        raise ValueError(
            f"model: {type(model).__name__} has its own forward, which the fused forward would skip; {unfused}"
        )
    if (
        not isinstance(model.joint, ParakeetRNNTJointNetwork)
        or type(model.joint).forward is not ParakeetRNNTJointNetwork.forward
    ):
        raise ValueError(
            f"model.joint: {type(model.joint).__name__} is not transformers' joint network "
            f"(activation(encoder + decoder), then head); {unfused}"
        )


def _check_joint_activation(joint, hidden_act):
    """The fused loss applies config.hidden_act's activation: refuse a joint whose activation module was
    replaced by another (the unfused joint would apply that one)."""
    from transformers.activations import ACT2FN

    if hidden_act not in ACT2FN:
        return
    built = dict.__getitem__(ACT2FN, hidden_act)  # the class (or class and arguments) ACT2FN[...] would build
    built = built[0] if isinstance(built, tuple) else built
    if type(joint.activation) is not built:
        raise ValueError(
            f"model.joint.activation: a {type(joint.activation).__name__} where config.hidden_act "
            f"({hidden_act!r}) gives a {built.__name__}, which the fused loss applies; set config.hidden_act to "
            f"the joint's activation, or apply(model, fused=False)"
        )


def _fused_forward(
    self,
    input_features=None,
    attention_mask=None,
    decoder_input_ids=None,
    decoder_cache=None,
    use_decoder_cache=None,
    encoder_outputs=None,
    labels=None,
    **kwargs,
):
    """ParakeetForRNNT's and ParakeetForTDT's forward with labels, the joint fused with the loss (see apply)."""
    tdt = self.loss_function is ParakeetForTDTLoss
    if labels is None or not (tdt or self.loss_function is ParakeetForRNNTLoss):
        return type(self).forward(
            self,
            input_features=input_features,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_cache=decoder_cache,
            use_decoder_cache=use_decoder_cache,
            encoder_outputs=encoder_outputs,
            labels=labels,
            **kwargs,
        )
    from transformers.models.parakeet.modeling_parakeet import ParakeetRNNTDecoderCache, ParakeetRNNTOutput

    config = self.config
    _check_joint_activation(self.joint, config.hidden_act)
    # The loss options and label lengths as the model passes them to its loss function.
    reduction = kwargs.get("reduction", "mean" if tdt else "mean_volume")
    _check_reduction(reduction)
    if tdt:
        durations, sigma = config.durations, kwargs.get("sigma", 0.0)
        label_lengths = (labels != config.pad_token_id).sum(-1)
    else:
        durations, sigma = None, 0.0
        label_lengths = (labels != config.blank_token_id).sum(-1)
    # What transformers' can_return_tuple does around its forward.
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = config.return_dict

    if encoder_outputs is None:
        encoder_outputs = self.get_audio_features(
            input_features=input_features, attention_mask=attention_mask, **kwargs
        )
    if use_decoder_cache and decoder_cache is None:
        decoder_cache = ParakeetRNNTDecoderCache(config)
    decoder_hidden_states = self.decoder(decoder_input_ids, cache=decoder_cache)
    encoder_hidden_states = encoder_outputs.pooler_output
    device = encoder_hidden_states.device
    label_lengths = label_lengths.to(device)
    losses = fused_joiner_loss(
        encoder_hidden_states,
        decoder_hidden_states,
        self.joint.head.weight,
        self.joint.head.bias,
        labels.to(device),
        encoder_outputs.attention_mask.sum(-1).to(device),
        label_lengths,
        activation=ACTIVATIONS[config.hidden_act],
        blank=config.blank_token_id,
        reduction="none",
        durations=durations,
        sigma=sigma,
    )
    output = ParakeetRNNTOutput(
        loss=reduce(losses, label_lengths, reduction),
        logits=None,
        last_hidden_state=encoder_outputs.last_hidden_state,
        pooler_output=encoder_hidden_states,
        hidden_states=encoder_outputs.hidden_states,
        attentions=encoder_outputs.attentions,
        decoder_cache=decoder_cache,
    )
    return output if return_dict else output.to_tuple()
