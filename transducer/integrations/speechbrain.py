"""SpeechBrain's transducer loss (``speechbrain.nnet.losses.transducer_loss``) on this library's loss, and the
loss fused with SpeechBrain's joint (``Transducer_joint``, then the output ``Linear``).

In a recipe's hparams::

    transducer_cost: !name:transducer.integrations.speechbrain.transducer_loss
       blank_index: !ref <blank_index>

:func:`transducer_loss` takes SpeechBrain's arguments and gives its values: lengths relative to the padded lengths,
rounded as SpeechBrain rounds them, each utterance's loss over its frames T_b (SpeechBrain's numba loss), or with
``use_torchaudio=True`` the plain losses (torchaudio's ``rnnt_loss``, the other loss SpeechBrain offered), then
the reduction. Its gradient is the gradient of the value it returns, where SpeechBrain's numba loss returns the
gradient of the sum of the plain losses whatever the reduction (T_b times larger for each utterance, and B times
larger for ``"mean"``): the README says what that changes for a recipe. :func:`fused_transducer_loss` is the same
loss computed from the projected encoder and decoder outputs by :func:`transducer.fused_joiner_loss`, without the
``(B, T, U+1, V)`` joint.

:func:`transducer_loss` needs torch alone; :func:`fused_transducer_loss` imports SpeechBrain when called.
"""

import torch
from torch import Tensor

from .. import fused_joiner_loss
from .. import transducer_loss as _transducer_loss
from ..checks import FLOAT_DTYPES, INDEX_DTYPES, check_blank, check_tensor, is_flag
from ..joiner import LEAKY_RELU_SLOPE
from .options import spelled

__all__ = ["transducer_loss", "fused_transducer_loss", "absolute_lengths", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum", "none")  # SpeechBrain's numba loss's (it raises on any other, "batchmean" too)


def absolute_lengths(relative_lengths: Tensor, padded_length: int) -> Tensor:
    """SpeechBrain's lengths in frames or labels: ``(relative_lengths * padded_length).round().int()``, as its
    ``transducer_loss`` computes them."""
    return (relative_lengths * padded_length).round().int()


def _lengths(input_lens, target_lens, padded_frames, targets, scores, of):
    """(T, U): the lengths in frames and labels of the relative lengths ``input_lens`` and ``target_lens``, checked:
    floating ``(B,)`` tensors on the device of ``scores`` (the argument ``of``) with values in [0, 1] (one host
    read)."""
    check_tensor("targets", targets, INDEX_DTYPES, (2,), scores.device, of)
    batch_size = targets.size(0)
    for name, lengths in (("input_lens", input_lens), ("target_lens", target_lens)):
        check_tensor(name, lengths, FLOAT_DTYPES, (1,), scores.device, of)
        if lengths.size(0) != batch_size:
            raise ValueError(
                f"{name}: expected shape ({batch_size},) (one length per utterance), got {tuple(lengths.shape)}"
            )
    frames, labels = absolute_lengths(input_lens, padded_frames), absolute_lengths(target_lens, targets.size(1))
    if batch_size:  # an empty batch: the loss refuses it
        ends = (input_lens.min(), input_lens.max(), target_lens.min(), target_lens.max(), frames.min())
        *bounds, fewest_frames = torch.stack([x.double() for x in ends]).tolist()
        for name, low, high in (("input_lens", *bounds[:2]), ("target_lens", *bounds[2:])):
            if not 0 <= low <= high <= 1:
                raise ValueError(
                    f"{name}: expected lengths relative to the padded length, in [0, 1], got values in [{low}, {high}]"
                )
        if fewest_frames < 1:
            raise ValueError(
                f"input_lens: an utterance of relative length {bounds[0]} has round({bounds[0]} * {padded_frames}) = "
                f"{int(fewest_frames)} frames of {of}'s {padded_frames}; each needs at least one"
            )
    return frames, labels


def _check_arguments(blank_index, num_columns, columns, reduction, use_torchaudio):
    """The arguments besides the tensors, as the loss checks its own (a float blank_index or a string
    use_torchaudio is refused, not converted)."""
    with spelled("blank", "blank_index"):
        check_blank(blank_index, num_columns, columns)
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduction: expected one of {', '.join(map(repr, REDUCTIONS))} (SpeechBrain's transducer "
            f"loss's), got {reduction!r}"
        )
    if not is_flag(use_torchaudio):
        raise TypeError(f"use_torchaudio: expected a bool, got {type(use_torchaudio).__name__} {use_torchaudio!r}")


def _reduce(losses, frames, reduction, use_torchaudio):
    """The ``(B,)`` losses as SpeechBrain returns them: over T_b unless ``use_torchaudio``, then reduced."""
    if not use_torchaudio:
        losses = losses / frames.to(losses.dtype)
    if reduction == "mean":
        return losses.mean()
    if reduction == "sum":
        return losses.sum()
    return losses


def transducer_loss(
    logits: Tensor,
    targets: Tensor,
    input_lens: Tensor,
    target_lens: Tensor,
    blank_index: int,
    reduction: str = "mean",
    use_torchaudio: bool = False,
) -> Tensor:
    r"""SpeechBrain's ``transducer_loss``: the same arguments and values, on the CPU and CUDA, for 16-bit logits
    without a float32 copy, with the gradient of the value it returns.

    Args:
        logits (Tensor): ``(B, maxT, maxU+1, V)`` scores (``transducer_lin``'s output), float16 / bfloat16 /
            float32 / float64.
        targets (Tensor): ``(B, maxU)`` int32 / int64 labels.
        input_lens (Tensor): ``(B,)`` floating: each utterance's frames relative to ``maxT`` (SpeechBrain's
            ``wav_lens``); ``T_b = round(input_lens[b] * maxT)``.
        target_lens (Tensor): ``(B,)`` floating: each utterance's labels relative to ``targets.size(1)``;
            ``U_b = round(target_lens[b] * targets.size(1))``.
        blank_index (int): the blank's column; negative counts from the end.
        reduction (str, optional): ``"mean"`` (over the batch), ``"sum"`` or ``"none"`` (the ``(B,)`` losses).
            (Default: ``"mean"``)
        use_torchaudio (bool, optional): the convention of the loss SpeechBrain took from torchaudio: each
            utterance's loss is its negative log-likelihood. ``False``: SpeechBrain's numba loss's, the negative
            log-likelihood over T_b. The loss is this library's either way. (Default: ``False``)

    Returns:
        Tensor: float32 (float64 for float64 logits): a scalar, or ``(B,)`` for ``"none"``. The gradient is that of
        this value (SpeechBrain's numba loss gave the gradient of the sum of the negative log-likelihoods).
    """
    check_tensor("logits", logits, FLOAT_DTYPES, (4,), None)
    _check_arguments(blank_index, logits.size(-1), "the vocabulary size is logits.size(-1)", reduction, use_torchaudio)
    frames, labels = _lengths(input_lens, target_lens, logits.size(1), targets, logits, "logits")
    losses = _transducer_loss(logits, targets, frames, labels, blank=blank_index, reduction="none")
    return _reduce(losses, frames, reduction, use_torchaudio)


def fused_transducer_loss(
    encoder_out: Tensor,
    decoder_out: Tensor,
    joint: torch.nn.Module,
    output: torch.nn.Module,
    targets: Tensor,
    input_lens: Tensor,
    target_lens: Tensor,
    blank_index: int,
    reduction: str = "mean",
    use_torchaudio: bool = False,
) -> Tensor:
    r""":func:`transducer_loss` of ``output(joint(encoder_out.unsqueeze(2), decoder_out.unsqueeze(1)))``, computed
    by :func:`transducer.fused_joiner_loss`: no ``(B, maxT, maxU+1, V)`` joint or logits in forward or backward.

    ``joint`` is SpeechBrain's ``Transducer_joint`` with ``joint="sum"`` (its ``joint_network`` is not used then,
    as in SpeechBrain) and a nonlinearity of the fused loss: ``LeakyReLU`` (negative slope 0.01, torch's default
    and SpeechBrain's), ``GELU`` (``approximate="none"``), ``ReLU``, ``Tanh``, ``Sigmoid``, ``SiLU`` or
    ``Identity``. ``output`` is SpeechBrain's ``Linear`` (its ``max_norm`` applied as its forward applies it) or a
    ``torch.nn.Linear``; either may be wrapped in ``DistributedDataParallel`` or ``DataParallel``, as SpeechBrain's
    ``Brain`` wraps the modules with parameters (under ``DistributedDataParallel`` a forward of no rows through the
    wrapper tells it to expect the weight's gradient, which it then reduces across processes as usual).

    Args:
        encoder_out (Tensor): ``(B, maxT, J)``: the projected encoder output (``proj_enc``'s).
        decoder_out (Tensor): ``(B, maxU+1, J)``: the projected decoder output (``proj_dec``'s).
        joint (Transducer_joint): the joint (``modules.Tjoint``).
        output (Linear): the output layer (``modules.transducer_lin``).
        targets, input_lens, target_lens, blank_index, reduction, use_torchaudio: as for :func:`transducer_loss`;
            ``T_b = round(input_lens[b] * encoder_out.size(1))``.

    Returns:
        Tensor: as :func:`transducer_loss`.

    Raises:
        ValueError: a joint or output layer the fused loss cannot stand for (named in the message).
    """
    activation = _fused_activation(joint)
    check_tensor("encoder_out", encoder_out, FLOAT_DTYPES, (3,), None)
    linear = _output_linear(output, encoder_out)
    _check_arguments(
        blank_index, linear.out_features, "the vocabulary size is output's out_features", reduction, use_torchaudio
    )
    frames, labels = _lengths(input_lens, target_lens, encoder_out.size(1), targets, encoder_out, "encoder_out")
    losses = fused_joiner_loss(
        encoder_out,
        decoder_out,
        linear.weight,
        linear.bias,
        targets,
        frames,
        labels,
        activation=activation,
        blank=blank_index,
        reduction="none",
    )
    return _reduce(losses, frames, reduction, use_torchaudio)


def _unwrapped(module):
    """``module`` without its DistributedDataParallel or DataParallel wrapper."""
    if isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return module.module
    return module


# nonlinearities of a Transducer_joint -> the fused loss's activation (GELU and LeakyReLU are handled apart: their
# arguments decide)
_ACTIVATIONS = {
    torch.nn.ReLU: "relu",
    torch.nn.Tanh: "tanh",
    torch.nn.Sigmoid: "sigmoid",
    torch.nn.SiLU: "silu",
    torch.nn.Identity: "identity",
}


def _fused_activation(joint):
    """The fused loss's activation for SpeechBrain's ``Transducer_joint`` ``joint``, or a ValueError."""
    try:
        from speechbrain.nnet.transducer.transducer_joint import Transducer_joint
    except ImportError as e:
        raise ImportError(f"fused_transducer_loss needs speechbrain: pip install -e '.[speechbrain]' ({e})") from e
    joint = _unwrapped(joint)
    if not isinstance(joint, Transducer_joint) or type(joint).forward is not Transducer_joint.forward:
        raise ValueError(f"joint: expected SpeechBrain's Transducer_joint, got {type(joint).__name__}")
    if joint.joint != "sum":
        raise ValueError(
            f"joint: the fused loss sums the encoder and decoder outputs (joint='sum'), got joint={joint.joint!r}"
        )
    act = joint.nonlinearity
    if type(act) is torch.nn.GELU and act.approximate == "none":
        return "gelu"
    if type(act) is torch.nn.LeakyReLU and act.negative_slope == LEAKY_RELU_SLOPE:
        return "leaky_relu"
    if type(act) in _ACTIVATIONS:
        return _ACTIVATIONS[type(act)]
    raise ValueError(
        f"joint: the nonlinearity {act} has no fused counterpart (LeakyReLU(negative_slope="
        f"{LEAKY_RELU_SLOPE}), GELU(approximate='none'), ReLU, Tanh, Sigmoid, SiLU, Identity)"
    )


def _output_linear(output, encoder_out):
    """The ``torch.nn.Linear`` of the output layer ``output`` (SpeechBrain's Linear keeps it as ``.w``), its
    ``max_norm`` applied as SpeechBrain's forward applies it; under DistributedDataParallel, after a forward of no
    rows through the wrapper (see fused_transducer_loss)."""
    from speechbrain.nnet.linear import Linear

    module = _unwrapped(output)
    if isinstance(module, Linear) and type(module).forward is Linear.forward:
        if module.combine_dims:
            raise ValueError("output: a Linear with combine_dims=True does not take the joint's rows")
        if module.max_norm is not None:
            module.w.weight.data = torch.renorm(module.w.weight.data, p=2, dim=0, maxnorm=module.max_norm)
        linear = module.w
    elif type(module) is torch.nn.Linear:
        linear = module
    else:
        raise ValueError(f"output: expected SpeechBrain's Linear or a torch.nn.Linear, got {type(module).__name__}")
    if isinstance(output, torch.nn.parallel.DistributedDataParallel) and torch.is_grad_enabled():
        output(encoder_out.new_empty(0, linear.in_features))
    return linear
