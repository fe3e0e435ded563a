"""ESPnet's transducer models (``ESPnetASRModel`` with a transducer decoder, ``ESPnetASRTransducerModel``) trained on
this library's losses, without warp-transducer.

Example::

    >>> from transducer.integrations import espnet
    >>> espnet.install()                  # ``import warprnnt_pytorch`` now gives this module
    >>> model = ASRTask.build_model(args)  # built by ESPnet as before
    >>> espnet.apply(model)               # the joint's output layer fused with the loss
    >>> loss, stats, weight = model(speech, speech_lengths, text, text_lengths)

:class:`RNNTLoss` (warp-transducer's ``warprnnt_pytorch.RNNTLoss``), :func:`rnnt_loss` and
:class:`MultiblankRNNTLoss` (ESPnet's ``MultiblankRNNTLossNumba``) need torch alone; :func:`apply` imports ESPnet
when called.
"""

import sys
import types
from typing import Sequence

import torch
from torch import Tensor

from .. import fused_joiner_loss, multiblank_loss, transducer_loss
from ..checks import check_big_blank_durations
from .methods import InstanceMethod
from .options import checked

__all__ = ["RNNTLoss", "rnnt_loss", "MultiblankRNNTLoss", "install", "apply", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum", "none")  # warp-transducer's


def reduce(losses, reduction):
    """The ``(B,)`` losses reduced as warp-transducer reduces them: ``"mean"`` (their sum over B) and ``"sum"`` of
    shape ``(1,)``, ``"none"`` as they are."""
    if reduction == "none":
        return losses
    total = losses.sum().unsqueeze(0)
    return total / losses.size(0) if reduction == "mean" else total


class _WarpLoss(torch.nn.Module):
    """warp-transducer's interface, which both losses share: ``forward(acts, labels, act_lens, label_lens)``, its
    reductions, and the loss of a joint fused with its output layer (:meth:`joint_loss`)."""

    def __init__(self, blank, reduction):
        super().__init__()
        if isinstance(blank, bool) or not isinstance(blank, int):
            raise TypeError(f"blank: expected an int (the blank's column), got {type(blank).__name__}")
        if reduction not in REDUCTIONS:
            raise ValueError(
                f"reduction: expected one of {', '.join(map(repr, REDUCTIONS))} (warp-transducer's), got {reduction!r}"
            )
        self.blank = blank
        self.reduction = reduction

    def forward(self, acts: Tensor, labels: Tensor, act_lens: Tensor, label_lens: Tensor) -> Tensor:
        losses = self._loss_function(
            acts, labels, act_lens, label_lens, blank=self.blank, reduction="none", **self.options()
        )
        return reduce(self._as_returned(losses), self.reduction)

    def joint_loss(self, encoder_out, decoder_out, weight, bias, labels, act_lens, label_lens, activation):
        """This loss of the joint ``F.linear(act(encoder_out[b, t] + decoder_out[b, u]), weight, bias)`` by
        :func:`transducer.fused_joiner_loss` (no joint in memory), reduced as :meth:`forward` reduces."""
        losses = fused_joiner_loss(
            encoder_out,
            decoder_out,
            weight,
            bias,
            labels,
            act_lens,
            label_lens,
            activation=activation,
            blank=self.blank,
            reduction="none",
            **self.options(),
        )
        return reduce(self._as_returned(losses), self.reduction)

    def _as_returned(self, losses):
        return losses

    def extra_repr(self):
        return f"blank={self.blank}, reduction={self.reduction!r}, {self.options()}"


class RNNTLoss(_WarpLoss):
    r"""warp-transducer's ``warprnnt_pytorch.RNNTLoss`` (ESPnet's fork, with FastEmit) on
    :func:`transducer.transducer_loss`: the same arguments, defaults, values and gradients, on the CPU and CUDA, for
    16-bit joints without a float32 copy.

    Args:
        blank (int, optional): the blank's column. (Default: ``0``)
        fastemit_lambda (float, optional): FastEmit: the gradient w.r.t. every label log-prob times
            ``1 + fastemit_lambda``; the loss value is unchanged, as warp-transducer's. (Default: ``0.001``)
        reduction (str, optional): ``"mean"`` (the sum of the losses over B, of shape ``(1,)``), ``"sum"`` (of shape
            ``(1,)``) or ``"none"`` (the ``(B,)`` losses). (Default: ``"mean"``)

    ``forward(acts, labels, act_lens, label_lens)``: ``acts`` the ``(B, maxT, maxU+1, V)`` joint's scores, float16,
    bfloat16, float32 or float64 (the loss is that of their log-softmax, as warp-transducer's on both devices),
    ``labels`` ``(B, S)`` with ``S >= max U_b``, the lengths ``(B,)``; int32 (as warp-transducer takes them) or
    int64. Returns float32 (float64 for float64 ``acts``).
    """

    _loss_function = staticmethod(transducer_loss)

    def __init__(self, blank: int = 0, fastemit_lambda: float = 0.001, reduction: str = "mean") -> None:
        super().__init__(blank, reduction)
        self.fastemit_lambda = checked("fastemit_lambda", fastemit_lambda)

    def options(self):
        """The options this loss passes to :func:`transducer.transducer_loss`."""
        return {"fastemit_lambda": self.fastemit_lambda}


def rnnt_loss(
    acts: Tensor,
    labels: Tensor,
    act_lens: Tensor,
    label_lens: Tensor,
    blank: int = 0,
    reduction: str = "mean",
    fastemit_lambda: float = 0.001,
) -> Tensor:
    """warp-transducer's ``warprnnt_pytorch.rnnt_loss``: :class:`RNNTLoss`'s forward, its arguments as there."""
    return RNNTLoss(blank, fastemit_lambda, reduction)(acts, labels, act_lens, label_lens)


class MultiblankRNNTLoss(_WarpLoss):
    r"""ESPnet's ``MultiblankRNNTLossNumba`` (``espnet2.asr.transducer.rnnt_multi_blank``, CUDA only) on
    :func:`transducer.multiblank_loss`: the same arguments, values and gradients, on the CPU and CUDA.

    Args:
        blank (int): the standard blank's column (ESPnet's models put the big blanks just before it).
        big_blank_durations (list of int): the big blanks' durations; big blank i is the column ``blank - 1 - i``.
        reduction (str, optional): as for :class:`RNNTLoss`. (Default: ``"mean"``)
        fastemit_lambda (float, optional): FastEmit's gradient, as for :class:`RNNTLoss`; the loss returned is
            times ``1 + fastemit_lambda``, as the numba loss returns it. (Default: ``0.0``)
        clamp (float, optional): if > 0, each element of the gradient w.r.t. the joint for a unit incoming gradient
            is clamped to ``[-clamp, clamp]``. (Default: ``-1``)
        sigma (float, optional): logit under-normalisation: every log-prob is ``log_softmax - sigma``.
            (Default: ``0.0``)
    """

    _loss_function = staticmethod(multiblank_loss)

    def __init__(
        self,
        blank: int,
        big_blank_durations: Sequence[int],
        reduction: str = "mean",
        fastemit_lambda: float = 0.0,
        clamp: float = -1.0,
        sigma: float = 0.0,
    ) -> None:
        super().__init__(blank, reduction)
        # the losses' own checks, on the values as given: a float duration or a bool clamp is refused
        self.big_blank_durations = check_big_blank_durations(big_blank_durations, blank if blank >= 0 else None)
        self.fastemit_lambda = checked("fastemit_lambda", fastemit_lambda)
        self.clamp = checked("clamp", clamp)
        self.sigma = checked("sigma", sigma)

    def options(self):
        """The options this loss passes to :func:`transducer.multiblank_loss`."""
        return {
            "big_blank_durations": self.big_blank_durations,
            "fastemit_lambda": self.fastemit_lambda,
            "clamp": self.clamp,
            "sigma": self.sigma,
        }

    def _as_returned(self, losses):
        # the numba loss returns the loss times 1 + fastemit_lambda (not its gradient)
        return losses + self.fastemit_lambda * losses.detach() if self.fastemit_lambda else losses


def install() -> types.ModuleType:
    """Make ``import warprnnt_pytorch`` give this module in this process, so that ESPnet builds and trains its
    transducer models on :class:`RNNTLoss` without warp-transducer (whether or not it is installed). Returns the
    module."""
    module = sys.modules[__name__]
    sys.modules["warprnnt_pytorch"] = module
    return module


def _espnet():
    """ESPnet's two transducer model classes, its JointNetwork and Swish, or an ImportError naming what to install."""
    try:
        from espnet2.asr.espnet_model import ESPnetASRModel
        from espnet2.asr_transducer.activation import Swish
        from espnet2.asr_transducer.espnet_transducer_model import ESPnetASRTransducerModel
        from espnet2.asr_transducer.joint_network import JointNetwork
    except ImportError as e:
        raise ImportError(
            f"transducer.integrations.espnet needs ESPnet: pip install -e '.[espnet]' && "
            f"pip install --no-deps espnet==202511 ({e})"
        ) from e
    return ESPnetASRModel, ESPnetASRTransducerModel, JointNetwork, Swish


# the joint's activation modules (exact types) -> the fused joiner's activation; ESPnet's get_activation builds
# Tanh (its default), ReLU, Identity and Swish among them; GELU with approximate="none" is handled apart
_ACTIVATIONS = {
    torch.nn.Tanh: "tanh",
    torch.nn.ReLU: "relu",
    torch.nn.Identity: "identity",
    torch.nn.Sigmoid: "sigmoid",
    torch.nn.SiLU: "silu",
}


def _activation_name(act, swish_class):
    """The fused joiner's name for the activation module ``act``, or None."""
    if type(act) is torch.nn.GELU and act.approximate == "none":
        return "gelu"
    if type(act) is swish_class:
        # ESPnet's Swish is x * sigmoid(x) (silu) for beta <= 1, beta * x * sigmoid(x) above
        return "silu" if act.beta <= 1 else None
    return _ACTIVATIONS.get(type(act))


def _joint_activation(joint, joint_class, swish_class):
    """The fused joiner's activation for ESPnet's joint ``joint``; a ValueError naming what cannot be fused."""
    unfused = "or apply(model, fused=False)"
    if not isinstance(joint, joint_class) or type(joint).forward is not joint_class.forward:
        raise ValueError(
            f"model.joint_network: {type(joint).__name__} is not ESPnet's JointNetwork "
            f"(lin_out(activation(lin_enc(enc) + lin_dec(dec)))); {unfused}"
        )
    name = _activation_name(joint.joint_activation, swish_class)
    if name is None:
        raise ValueError(
            f"model.joint_network: the activation {joint.joint_activation} has no fused counterpart "
            f"(tanh, relu, identity, swish with beta <= 1, and torch's Sigmoid, SiLU, "
            f"GELU(approximate='none')); {unfused}"
        )
    return name


def _loss_of(model):
    """The model's transducer loss as this library's: the criterion ESPnet built, or (ESPnetASRTransducerModel, which
    builds warp-transducer's on its first step) the one it would build."""
    criterion = model.criterion_transducer
    if isinstance(criterion, _WarpLoss):
        return criterion
    if criterion is None:
        return RNNTLoss(blank=0, fastemit_lambda=model.fastemit_lambda, reduction="mean")
    if type(criterion).__name__ == "MultiblankRNNTLossNumba":
        return MultiblankRNNTLoss(
            criterion.blank,
            criterion.big_blank_durations,
            criterion.reduction,
            criterion.fastemit_lambda,
            criterion.clamp if criterion.clamp > 0 else -1.0,
            criterion.sigma,
        )
    if type(criterion).__module__.split(".")[0] == "warprnnt_pytorch":
        return RNNTLoss(criterion.blank, getattr(criterion, "fastemit_lambda", 0.0), criterion.reduction)
    raise ValueError(
        f"model.criterion_transducer: {type(criterion).__name__} has no counterpart in transducer; "
        f"expected warp-transducer's RNNTLoss or ESPnet's MultiblankRNNTLossNumba"
    )


def apply(model: torch.nn.Module, fused: bool = True) -> torch.nn.Module:
    r"""Train an ESPnet transducer model on this library's losses; the model is changed in place and returned.

    ``model.criterion_transducer`` becomes :class:`RNNTLoss` (warp-transducer's, with the model's blank, FastEmit
    and ``"mean"`` reduction) or :class:`MultiblankRNNTLoss` (for ``transducer_multi_blank_durations``, with its
    durations and sigma): the values, shapes and gradients of ESPnet's losses, on the CPU and CUDA (ESPnet's
    multi-blank loss runs on CUDA only). With ``fused`` the training step computes the loss by
    :func:`transducer.fused_joiner_loss` from ``joint_network.lin_enc`` and ``lin_dec``'s outputs, its activation
    and ``lin_out``'s weight and bias, so that the ``(B, T, U+1, V)`` joint is never built: the fused method is
    ``ESPnetASRModel._calc_transducer_loss``, or ``ESPnetASRTransducerModel.forward`` (the same step, auxiliary
    losses, statistics and validation error rates). Decoding, the parameters and their state dict are unchanged.
    ``fused=False`` keeps ESPnet's joint and replaces the loss alone; after ``apply(model)`` it undoes the fused
    method. Call it before wrapping the model in ``DistributedDataParallel``.

    Args:
        model (ESPnetASRModel or ESPnetASRTransducerModel): an ``ESPnetASRModel`` with a transducer decoder, or an
            ``ESPnetASRTransducerModel``; changed in place.
        fused (bool, optional): fuse the joint's output layer with the loss in training. (Default: ``True``)

    Returns:
        the model.

    Raises:
        TypeError: ``model`` is not one of these models.
        ValueError: an ``ESPnetASRModel`` without a transducer decoder, an ``ESPnetASRTransducerModel`` trained on
            k2's pruned loss (``use_k2_pruned_loss``), a criterion with no counterpart here, or (fused) a class
            with its own fused method, a joint other than ESPnet's ``JointNetwork`` or an activation the fused loss
            lacks (``selu``, ``mish``, ``smish``, ``ftswish``, ``hardtanh``, ``leaky_relu``, swish with beta > 1).
        ImportError: ESPnet is not installed.
    """
    asr_class, transducer_class, joint_class, swish_class = _espnet()
    if isinstance(model, transducer_class):
        if model.use_k2_pruned_loss:
            raise ValueError(
                "model: use_k2_pruned_loss: the model trains on k2's pruned loss, which apply does not "
                "replace; build it with use_k2_pruned_loss=False"
            )
        method, espnet_method, fused_method = "forward", transducer_class.forward, _fused_forward
    elif isinstance(model, asr_class):
        if not model.use_transducer_decoder:
            raise ValueError("model: this ESPnetASRModel has no transducer decoder (joint_network is None)")
        method, espnet_method, fused_method = (
            "_calc_transducer_loss",
            asr_class._calc_transducer_loss,
            _fused_calc_transducer_loss,
        )
    else:
        raise TypeError(
            f"model: expected an ESPnet ESPnetASRModel (with a transducer decoder) or "
            f"ESPnetASRTransducerModel, got {type(model).__name__}"
        )
    if fused:
        if getattr(type(model), method) is not espnet_method:
            raise ValueError(
                f"model: {type(model).__name__} has its own {method}, which the fused step would skip; "
                f"or apply(model, fused=False)"
            )
        _joint_activation(model.joint_network, joint_class, swish_class)
    model.criterion_transducer = _loss_of(model)
    if fused:
        setattr(model, method, InstanceMethod(fused_method, model))
    elif getattr(model.__dict__.get(method), "__func__", None) is fused_method:
        delattr(model, method)
    return model


def _joint_loss(model, encoder_out, decoder_out, target, t_len, u_len):
    """The model's transducer loss of its joint over ``encoder_out`` and ``decoder_out``, fused."""
    _, _, joint_class, swish_class = _espnet()
    joint = model.joint_network
    activation = _joint_activation(joint, joint_class, swish_class)
    return model.criterion_transducer.joint_loss(
        joint.lin_enc(encoder_out),
        joint.lin_dec(decoder_out),
        joint.lin_out.weight,
        joint.lin_out.bias,
        target,
        t_len,
        u_len,
        activation,
    )


def _fused_calc_transducer_loss(self, encoder_out, encoder_out_lens, labels):
    """ESPnetASRModel._calc_transducer_loss with the joint fused with the loss (see apply)."""
    from espnet2.asr_transducer.utils import get_transducer_task_io

    decoder_in, target, t_len, u_len = get_transducer_task_io(
        labels, encoder_out_lens, ignore_id=self.ignore_id, blank_id=self.blank_id
    )
    self.decoder.set_device(encoder_out.device)
    decoder_out = self.decoder(decoder_in)
    loss_transducer = _joint_loss(self, encoder_out, decoder_out, target, t_len, u_len)
    cer_transducer, wer_transducer = None, None
    if not self.training and self.error_calculator_trans is not None:
        cer_transducer, wer_transducer = self.error_calculator_trans(encoder_out, target)
    return loss_transducer, cer_transducer, wer_transducer


def _fused_forward(self, speech, speech_lengths, text, text_lengths, **kwargs):
    """ESPnetASRTransducerModel.forward with the joint fused with the loss (see apply)."""
    from espnet2.asr_transducer.utils import get_transducer_task_io
    from espnet2.torch_utils.device_funcs import force_gatherable

    batch_size = speech.shape[0]
    text = text[:, : text_lengths.max()]
    encoder_out, encoder_out_lens = self.encode(speech, speech_lengths)
    decoder_in, target, t_len, u_len = get_transducer_task_io(text, encoder_out_lens, ignore_id=self.ignore_id)
    self.decoder.set_device(encoder_out.device)
    decoder_out = self.decoder(decoder_in)
    loss_trans = _joint_loss(self, encoder_out, decoder_out, target, t_len, u_len)

    loss_ctc, loss_lm = 0.0, 0.0
    if self.use_auxiliary_ctc:
        loss_ctc = self._calc_ctc_loss(encoder_out, target, t_len, u_len)
    if self.use_auxiliary_lm_loss:
        loss_lm = self._calc_lm_loss(decoder_out, target)
    loss = (
        self.transducer_weight * loss_trans
        + self.auxiliary_ctc_weight * loss_ctc
        + self.auxiliary_lm_loss_weight * loss_lm
    )

    cer_transducer, wer_transducer = None, None
    if not self.training and (self.report_cer or self.report_wer):
        if self.error_calculator is None:
            from espnet2.asr_transducer.error_calculator import ErrorCalculator

            self.error_calculator = ErrorCalculator(
                self.decoder,
                self.joint_network,
                self.token_list,
                self.sym_space,
                self.sym_blank,
                nstep=self.validation_nstep,
                report_cer=self.report_cer,
                report_wer=self.report_wer,
            )
        cer_transducer, wer_transducer = self.error_calculator(encoder_out, target, t_len)

    stats = dict(
        loss=loss.detach(),
        loss_transducer=loss_trans.detach(),
        loss_aux_ctc=loss_ctc.detach() if loss_ctc > 0.0 else None,
        loss_aux_lm=loss_lm.detach() if loss_lm > 0.0 else None,
        cer_transducer=cer_transducer,
        wer_transducer=wer_transducer,
    )
    return force_gatherable((loss, stats, batch_size), loss.device)
