"""NeMo's transducer models (``EncDecRNNTModel``, ``EncDecRNNTBPEModel``, the hybrid RNN-T + CTC models and their
subclasses) trained on this library's losses.

Example::

    >>> from nemo.collections.asr.models import ASRModel
    >>> from transducer.integrations.nemo import apply
    >>> model = apply(ASRModel.from_pretrained("nvidia/parakeet-tdt-0.6b-v2"))
    >>> trainer.fit(model)    # training_step, validation and decoding as NeMo runs them

:class:`RNNTLoss` takes NeMo's ``RNNTLoss`` arguments and needs torch alone; :func:`apply` imports NeMo
(``MIN_NEMO`` or newer) when called.
"""

import re
import warnings
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from .. import fused_joiner_loss, multiblank_loss, tdt_loss, transducer_loss
from ..checks import check_big_blank_durations
from .methods import InstanceMethod
from .options import checked, spelled
from .reductions import reduce

__all__ = ["RNNTLoss", "apply", "LOSS_NAMES", "MIN_NEMO", "REDUCTIONS"]

REDUCTIONS = ("mean_batch", "mean", "sum", "mean_volume", None)  # NeMo's RNNTLoss's
MIN_NEMO = (2, 0, 0)  # the oldest NeMo tested (2.0.0, 2.2.1, 2.7.3 and 3.0.0 are)

# NeMo's loss names (its RNNT_LOSS_RESOLVER) -> this library's loss and the options NeMo's resolver gives that
# loss from ``{loss_name}_kwargs``, each with NeMo's default; NeMo warns of and ignores the others
_NUMBA = {"fastemit_lambda": 0.0, "clamp": -1.0}
LOSS_NAMES = {
    "default": ("rnnt", _NUMBA),
    "warprnnt_numba": ("rnnt", _NUMBA),
    "warprnnt": ("rnnt", {}),
    "pytorch": ("rnnt", {}),
    "tdt": ("tdt", {"durations": None, "sigma": 0.0, "omega": 0.0, **_NUMBA}),
    "tdt_pytorch": ("tdt", {"durations": None, "sigma": 0.0}),
    "multiblank_rnnt": ("multiblank", {"big_blank_durations": None, "sigma": 0.0, **_NUMBA}),
    "multiblank_rnnt_pytorch": ("multiblank", {"big_blank_durations": None, "sigma": 0.0}),
}


class RNNTLoss(torch.nn.Module):
    r"""NeMo's ``RNNTLoss`` (``nemo.collections.asr.losses.rnnt``) on :func:`transducer.transducer_loss`,
    :func:`transducer.tdt_loss` and :func:`transducer.multiblank_loss`: the same arguments, interface and values,
    on the CPU and CUDA, for 16-bit joints without a float32 copy.

    Args:
        num_classes (int): the blank's column, as NeMo's models give it: the vocabulary size V (RNN-T, TDT: the
            blank follows the V tokens; TDT's duration scores follow the blank), or V plus the number of big
            blanks (multi-blank: the blank is the last column, big blank i the column ``num_classes - 1 - i``).
        reduction (str or None, optional): ``"mean_batch"``, ``"mean"``, ``"mean_volume"``, ``"sum"`` or
            ``None`` (the ``(B,)`` losses); see :mod:`transducer.integrations.reductions`.
            (Default: ``"mean_batch"``)
        loss_name (str, optional): one of ``LOSS_NAMES``: ``"default"``, ``"warprnnt_numba"``, ``"warprnnt"``,
            ``"pytorch"`` (RNN-T), ``"tdt"``, ``"tdt_pytorch"`` (TDT), ``"multiblank_rnnt"``,
            ``"multiblank_rnnt_pytorch"`` (multi-blank). (Default: ``"default"``)
        loss_kwargs (dict, optional): the loss's options, as in NeMo's ``{loss_name}_kwargs``, those NeMo's loss
            of that name takes (``LOSS_NAMES``): ``fastemit_lambda`` and ``clamp`` (``default``,
            ``warprnnt_numba``, ``tdt``, ``multiblank_rnnt``); ``durations`` (required), ``sigma`` (``tdt``,
            ``tdt_pytorch``) and ``omega`` (``tdt``); ``big_blank_durations`` (required) and ``sigma``
            (``multiblank_rnnt``, ``multiblank_rnnt_pytorch``). Others are ignored with a warning, as NeMo
            ignores them. Each is checked as the losses check it (durations are ints, ``clamp`` and
            ``fastemit_lambda`` numbers, not bools or strings); the error names ``loss_kwargs['<name>']``.
            (Default: ``None``)

    FastEmit: NeMo's numba losses return the loss times ``1 + fastemit_lambda`` and FastEmit's gradient (the
    label log-probs' gradient times ``1 + fastemit_lambda``); so does this one, for the same names.

    ``clamp`` bounds each element of the gradient w.r.t. the joint for a unit incoming gradient, which the
    reduction then scales, as NeMo's CUDA losses do (NeMo's CPU loss clamps the gradient after that scaling).

    TDT's ``omega``: NeMo computes, on each call, the plain RNN-T loss of the token scores with probability
    ``omega`` and the TDT loss otherwise; this loss is that choice's expectation, ``(1 - omega) * tdt + omega *
    rnnt``, on every call (the same expected gradient, without the variance).

    ``forward(log_probs, targets, input_lengths, target_lengths)``: ``log_probs`` the ``(B, T, U+1, C)`` joint
    (scores or log-probabilities: the losses normalise them; float16, bfloat16, float32 or float64), ``targets``
    ``(B, S)`` with ``S >= max U_b``, the lengths ``(B,)``. Returns the reduced float32 loss (float64 for float64
    joints).
    """

    def __init__(
        self,
        num_classes: int,
        reduction: str = "mean_batch",
        loss_name: str = "default",
        loss_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().__init__()
        if loss_name not in LOSS_NAMES:
            raise ValueError(
                f"loss_name: {loss_name!r} has no counterpart in transducer; expected one of "
                f"{', '.join(map(repr, LOSS_NAMES))} (graph_rnnt and graph_w_transducer are k2's "
                f"graph losses, which NeMo runs itself)"
            )
        if reduction not in REDUCTIONS:
            raise ValueError(
                f"reduction: expected one of {', '.join(map(repr, REDUCTIONS))} (NeMo's), got {reduction!r}"
            )
        if isinstance(num_classes, bool) or not isinstance(num_classes, int):
            raise TypeError(f"num_classes: expected an int (the blank's column), got {type(num_classes).__name__}")
        if num_classes < 0:
            raise ValueError(f"num_classes: expected an int >= 0 (the blank's column), got {num_classes}")
        self.kind, defaults = LOSS_NAMES[loss_name]
        kwargs = dict(loss_kwargs or {})
        unused = sorted(set(kwargs) - set(defaults))
        if unused:
            warnings.warn(
                f"loss_kwargs: {', '.join(unused)} ignored: the {loss_name} loss does not take them", stacklevel=2
            )
        self.options = {}
        for name, default in defaults.items():
            value = kwargs.get(name, default)
            if value is None and name in ("durations", "big_blank_durations"):
                raise ValueError(f"loss_kwargs: the {loss_name} loss needs {name}")
            # the losses' own checks, on the values as given: a float duration or a bool clamp is refused
            self.options[name] = checked(name, value, f"loss_kwargs['{name}']")
        if "big_blank_durations" in self.options:  # they sit before the blank's column
            with spelled("big_blank_durations", "loss_kwargs['big_blank_durations']"):
                check_big_blank_durations(self.options["big_blank_durations"], num_classes)
        # NeMo's numba losses scale the returned loss (not its gradient) by 1 + fastemit_lambda
        self._value_scale = self.options.get("fastemit_lambda", 0.0)
        self.loss_name = loss_name
        self.reduction = reduction
        self._blank = num_classes

    @property
    def blank(self):
        """The blank's column."""
        return self._blank

    def extra_repr(self):
        return f"loss_name={self.loss_name!r}, blank={self._blank}, reduction={self.reduction!r}, {self.options}"

    def _check_columns(self, columns, scores):
        """ValueError naming num_classes unless the blank's column lies among the ``columns`` score columns of
        ``scores`` (TDT's duration columns excluded): a loss built for another vocabulary."""
        tokens = columns - len(self.options.get("durations", ()))
        if self._blank >= tokens:
            raise ValueError(
                f"num_classes: {self._blank} (the blank's column) is not among the {tokens} token columns of {scores}; "
                f"NeMo's num_classes is the vocabulary without the blank, so {scores} holds num_classes + 1 token "
                f"columns"
            )

    def forward(self, log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor) -> Tensor:
        loss = {"rnnt": transducer_loss, "tdt": tdt_loss, "multiblank": multiblank_loss}[self.kind]
        if isinstance(log_probs, Tensor) and log_probs.dim():
            self._check_columns(log_probs.size(-1), "log_probs")
        losses = loss(
            log_probs, targets, input_lengths, target_lengths, blank=self._blank, reduction="none", **self.options
        )
        return self.reduce(self._as_nemo_returns(losses), target_lengths)

    def _as_nemo_returns(self, losses):
        return losses + self._value_scale * losses.detach() if self._value_scale else losses

    def joint_loss(
        self, encoder_out, predictor_out, weight, bias, targets, logit_lengths, target_lengths, activation, dropout=0.0
    ):
        """The ``(B,)`` losses of the joint ``F.linear(dropout(act(encoder_out[b, t] + predictor_out[b, u])),
        weight, bias)`` by :func:`transducer.fused_joiner_loss` (no joint in memory), with this loss's options."""
        if isinstance(weight, Tensor) and weight.dim():
            self._check_columns(weight.size(0), "weight")
        return self._as_nemo_returns(
            fused_joiner_loss(
                encoder_out,
                predictor_out,
                weight,
                bias,
                targets,
                logit_lengths,
                target_lengths,
                activation=activation,
                dropout=dropout,
                blank=self._blank,
                reduction="none",
                **self.options,
            )
        )

    def reduce(self, losses, target_lengths):
        """NeMo's ``RNNTLoss.reduce``: ``losses`` (a tensor or a list of them, concatenated) by ``self.reduction``."""
        if isinstance(losses, (list, tuple)):
            losses, target_lengths = torch.cat(list(losses)), torch.cat(list(target_lengths))
        return reduce(losses, target_lengths, self.reduction)


# activation modules a joint_net may start with -> the fused joiner's activation (NeMo builds ReLU, Tanh and
# Sigmoid; GELU with approximate="none" is handled apart)
_ACTIVATIONS = {
    torch.nn.ReLU: "relu",
    torch.nn.Tanh: "tanh",
    torch.nn.Sigmoid: "sigmoid",
    torch.nn.SiLU: "silu",
    torch.nn.Identity: "identity",
}


def _joint_net_parts(joint_net):
    """(activation name, dropout rate, output Linear) of a joint_net ``Sequential(act, [Dropout], Linear)``, or a
    string saying why it is not one."""
    layers = list(joint_net) if isinstance(joint_net, torch.nn.Sequential) else []
    if (
        len(layers) not in (2, 3)
        or not isinstance(layers[-1], torch.nn.Linear)
        or (len(layers) == 3 and type(layers[1]) is not torch.nn.Dropout)
    ):
        return f"joint_net is not Sequential(activation, [Dropout], Linear): {joint_net}"
    act = layers[0]
    if isinstance(act, torch.nn.GELU) and act.approximate == "none":
        name = "gelu"
    else:
        name = _ACTIVATIONS.get(type(act))
    if name is None:
        return (
            f"the joint's activation {act} has no fused counterpart (ReLU, Tanh, Sigmoid, "
            f"GELU(approximate='none'), SiLU, Identity)"
        )
    return name, layers[1].p if len(layers) == 3 else 0.0, layers[-1]


class FusedJointMixin:
    """The forward of a NeMo ``RNNTJoint`` whose fused path (``fuse_loss_wer``) computes the loss by
    :meth:`RNNTLoss.joint_loss` over the whole batch (see :func:`apply`); mixed into the joint's own class."""

    def forward(
        self,
        encoder_outputs=None,
        decoder_outputs=None,
        encoder_lengths=None,
        transcripts=None,
        transcript_lengths=None,
        compute_wer=False,
        keep_hypotheses=False,
    ):
        loss_wer = transcripts is not None and encoder_lengths is not None and transcript_lengths is not None
        if self.fuse_loss_wer and not loss_wer and decoder_outputs is not None:
            # the joint itself, as an unfused joint gives it (apply may have turned fusion on)
            return self.joint(encoder_outputs.transpose(1, 2), decoder_outputs.transpose(1, 2))
        if not loss_wer or not self.fuse_loss_wer or not isinstance(self.loss, RNNTLoss) or self.is_adapter_available():
            # NeMo's own forward: fusion turned off (or by export), another loss set, or adapters on the joint;
            # keep_hypotheses only where asked for (NeMo's forward takes it from 3.0)
            extra = {"keep_hypotheses": True} if keep_hypotheses else {}
            return super().forward(
                encoder_outputs=encoder_outputs,
                decoder_outputs=decoder_outputs,
                encoder_lengths=encoder_lengths,
                transcripts=transcripts,
                transcript_lengths=transcript_lengths,
                compute_wer=compute_wer,
                **extra,
            )
        loss = None
        if decoder_outputs is not None:
            f = self.project_encoder(encoder_outputs.transpose(1, 2))  # (B, T, H)
            g = self.project_prednet(decoder_outputs.transpose(1, 2))  # (B, U+1, H)
            masking_prob = getattr(self, "masking_prob", -1.0)
            if self.training and masking_prob > 0:
                # joint_after_projection's mask of the decoder side, drawn as it draws it (on the CPU)
                g = g * torch.gt(torch.rand([g.size(0), 1, g.size(1), 1]).to(g.device), masking_prob)[:, 0]
            activation, dropout, output = _joint_net_parts(self.joint_net)
            losses = self.loss.joint_loss(
                f,
                g,
                output.weight,
                output.bias,
                transcripts,
                encoder_lengths,
                transcript_lengths,
                activation,
                dropout if self.training else 0.0,
            )
            loss = self.loss.reduce(losses, transcript_lengths)
        wer = wer_num = wer_denom = None
        if compute_wer:
            wer, wer_num, wer_denom = self._batch_wer(
                encoder_outputs,
                decoder_outputs is not None,
                encoder_lengths,
                transcripts,
                transcript_lengths,
                keep_hypotheses,
            )
        else:
            self.hypotheses = [] if keep_hypotheses else None
        return loss, wer, wer_num, wer_denom

    def _batch_wer(self, encoder_outputs, narrow, encoder_lengths, transcripts, transcript_lengths, keep_hypotheses):
        """The batch's WER as NeMo's fused joint computes it for a sub-batch holding the whole batch."""
        if narrow:  # NeMo narrows the sub-batch to its longest utterance where it computes the loss
            encoder_outputs = encoder_outputs[:, :, : int(encoder_lengths.max())]
            transcripts = transcripts[:, : int(transcript_lengths.max())]
        sync = None
        if self.training:
            sync, self.wer._to_sync = self.wer._to_sync, False
        try:
            self.wer.update(
                predictions=encoder_outputs.detach(),
                predictions_lengths=encoder_lengths,
                targets=transcripts.detach(),
                targets_lengths=transcript_lengths,
            )
            self.hypotheses = self.wer.get_hypotheses() if keep_hypotheses else None
            wer, wer_num, wer_denom = self.wer.compute()
            self.wer.reset()
        finally:
            if self.training:
                self.wer._to_sync = sync
        return wer, wer_num, wer_denom


_FUSED_CLASSES = {}


def _fused_class(cls):
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(
            f"Fused{cls.__name__}", (FusedJointMixin, cls), {"__module__": __name__, "unfused_class": cls}
        )
    return _FUSED_CLASSES[cls]


def _nemo():
    """NeMo's transducer model class and joint classes, or an ImportError naming the version needed."""
    need = f"transducer.integrations.nemo needs nemo-toolkit[asr] >= {'.'.join(map(str, MIN_NEMO))}"
    try:
        import nemo
        from nemo.collections.asr.models import EncDecRNNTModel
        from nemo.collections.asr.modules.rnnt import RNNTJoint, SampledRNNTJoint
    except ImportError as e:
        raise ImportError(f"{need}: pip install -e '.[nemo]' ({e})") from e
    # the release's leading numbers ("2.0.0rc1" is 2.0.0)
    version = tuple(int(re.match(r"\d*", x).group() or 0) for x in nemo.__version__.split(".")[:3])
    if version < MIN_NEMO:
        raise ImportError(f"{need}; found nemo-toolkit {nemo.__version__}")
    return EncDecRNNTModel, RNNTJoint, SampledRNNTJoint


def _loss_of(model, joint):
    """The model's loss (cfg.loss, cfg.rnnt_reduction) as :class:`RNNTLoss`. The blank: the last column but the
    extra outputs (RNN-T, TDT) or the last (multi-blank); NeMo's models give tdt_pytorch V + D, out of range."""
    loss_name, loss_kwargs = model.extract_rnnt_loss_cfg(model.cfg.get("loss", None))
    if loss_name not in LOSS_NAMES:
        raise ValueError(
            f"model: cfg.loss.loss_name {loss_name!r} has no counterpart in transducer; expected one "
            f"of {', '.join(map(repr, LOSS_NAMES))}"
        )
    kind, _ = LOSS_NAMES[loss_name]
    if loss_kwargs is not None and not isinstance(loss_kwargs, dict):
        from omegaconf import OmegaConf

        loss_kwargs = OmegaConf.to_container(loss_kwargs, resolve=True)
    loss_kwargs = loss_kwargs or {}
    extra = joint.num_extra_outputs
    want = {"tdt": "durations", "multiblank": "big_blank_durations"}.get(kind)
    if want is not None and len(loss_kwargs.get(want) or ()) != extra:
        raise ValueError(
            f"model: cfg.loss.{loss_name}_kwargs.{want} has {len(loss_kwargs.get(want) or ())} "
            f"entries, the joint has {extra} extra outputs (cfg.joint.num_extra_outputs)"
        )
    # the blank: the last column but the extra outputs (TDT's durations), or the last (multi-blank)
    num_classes = joint.num_classes_with_blank - 1 - (extra if kind == "tdt" else 0)
    return RNNTLoss(
        num_classes,
        reduction=model.cfg.get("rnnt_reduction", "mean_batch"),
        loss_name=loss_name,
        loss_kwargs=loss_kwargs,
    )


def apply(model: torch.nn.Module, fused: bool = True) -> torch.nn.Module:
    r"""Train a NeMo transducer model on this library's losses; the model is changed in place and returned.

    ``model.loss`` becomes :class:`RNNTLoss` with the model's own loss (``cfg.loss.loss_name`` and its
    ``{loss_name}_kwargs``, resolved as NeMo resolves them, and ``cfg.rnnt_reduction``): the values and gradients
    of NeMo's loss on every device and dtype, but for TDT's ``omega`` and the CPU's ``clamp`` (see
    :class:`RNNTLoss`), 16-bit joints read as they are (NeMo copies them to float32). With ``fused`` the joint's
    fused path (``fuse_loss_wer``, turned on if the model was built without it) computes the loss by
    :func:`transducer.fused_joiner_loss` from the projected encoder and decoder outputs and ``joint_net``'s
    activation, dropout (in training) and last ``Linear``, over the whole batch: no ``(B, T, U+1, C)`` joint in
    forward or backward and no loop over ``fused_batch_size`` sub-batches. ``training_step`` and validation run
    unchanged: ``model.joint(..., transcripts=..., compute_wer=...)`` returns NeMo's ``(loss, wer, wer_num,
    wer_denom)``, the WER that of the whole batch (NeMo's is the mean of its sub-batches' WERs: a batch's
    ``val_wer`` changes where ``fused_batch_size`` is smaller than the batch; the epoch's, from the sums, does
    not). A joint call without transcripts returns the joint as an unfused model's does; decoding and
    ``transcribe`` never call the joint's forward and are unchanged. The fused loss reads raw scores: a joint
    ``temperature`` other than 1, which NeMo's CPU joint applies before its log-softmax, does not reach it.
    NeMo's export turns the fused path off for good (training then goes through NeMo's joint with this loss).
    ``fused=False`` keeps NeMo's joint (and its fused path, if the model has it) and replaces the loss alone;
    after ``apply(model)`` it also undoes what that changed.

    Joint dropout draws its mask from a seed taken from torch's default CPU generator and the element's (row,
    column) (see :func:`transducer.fused_joiner_loss`), so ``torch.manual_seed`` reproduces a step; the mask is not
    the one ``torch.nn.Dropout`` would draw. TDT's ``omega``: see :class:`RNNTLoss`.

    ``change_vocabulary`` replaces the joint and the loss (the BPE models' reset the loss to the default RNN-T,
    the char models' drop ``cfg.rnnt_reduction``): the model's ``change_vocabulary`` applies this again
    afterwards, so the loss is again the config's. A model restored from a ``.nemo`` file, or built anew, needs
    ``apply`` again.

    Args:
        model (EncDecRNNTModel): a NeMo ``EncDecRNNTModel``, ``EncDecRNNTBPEModel``, ``EncDecHybridRNNTCTCModel``,
            ``EncDecHybridRNNTCTCBPEModel`` or a subclass; changed in place.
        fused (bool, optional): fuse the joint's output layer with the loss in training. (Default: ``True``)

    Returns:
        the model.

    Raises:
        TypeError: ``model`` is not a NeMo transducer model.
        ValueError: the model's loss has no counterpart here (``graph_rnnt``, ``graph_w_transducer``), its
            durations or big blanks do not match the joint's extra outputs, its joint is a ``SampledRNNTJoint``,
            or ``fused`` and the joint is not NeMo's ``RNNTJoint`` (``HATJoint``, another forward) or its
            ``joint_net`` is not ``Sequential(activation, [Dropout], Linear)`` with a fusable activation.
        ImportError: NeMo older than ``MIN_NEMO``, or missing.
    """
    model_class, joint_class, sampled_class = _nemo()
    if not isinstance(model, model_class):
        raise TypeError(
            f"model: expected a NeMo transducer model (an EncDecRNNTModel, EncDecRNNTBPEModel, "
            f"EncDecHybridRNNTCTCModel or EncDecHybridRNNTCTCBPEModel), got {type(model).__name__}"
        )
    joint = model.joint
    base = joint.unfused_class if isinstance(joint, FusedJointMixin) else type(joint)
    if issubclass(base, sampled_class):
        raise ValueError("model.joint: a SampledRNNTJoint trains on its own sampled-vocabulary loss")
    unfused = "or apply(model, fused=False)"
    if fused:
        if not issubclass(base, joint_class):
            raise ValueError(f"model.joint: {base.__name__} is not a NeMo RNNTJoint; {unfused}")
        own = [
            f"{cls.__name__}.{name}"
            for cls in base.__mro__[: base.__mro__.index(joint_class)]
            for name in ("forward", "joint", "joint_after_projection")
            if name in cls.__dict__
        ]
        if own:
            raise ValueError(
                f"model.joint: {base.__name__} has its own {', '.join(own)}, which the fused loss would "
                f"skip (RNNTJoint's: project, add, joint_net); {unfused}"
            )
        parts = _joint_net_parts(joint.joint_net)
        if isinstance(parts, str):
            raise ValueError(f"model.joint: {parts}; {unfused}")
    loss = _loss_of(model, joint)
    model.loss = loss
    # what apply changed of NeMo's fused-path settings, to undo: (fuse_loss_wer, fused_batch_size) before
    before = getattr(joint, "_before_apply", None)
    if fused:
        joint.__class__ = _fused_class(base)
        if before is None:
            joint._before_apply = (joint.fuse_loss_wer, joint.fused_batch_size)
        if not joint.fuse_loss_wer:
            joint.set_fuse_loss_wer(True, loss, model.wer)
        if joint.fused_batch_size is None:  # NeMo's own fused forward (adapters, another loss) needs one
            joint.set_fused_batch_size(1 << 31)  # the whole batch
    else:
        joint.__class__ = base
        if before is not None:
            if not before[0]:
                joint.set_fuse_loss_wer(False)
            joint.set_fused_batch_size(before[1])
            del joint._before_apply
    if joint.fuse_loss_wer:
        joint.set_loss(loss)
        joint.set_wer(model.wer)
    _reapply_after_change_vocabulary(model, fused)
    return model


def _reapply_after_change_vocabulary(model, fused):
    """Make model.change_vocabulary apply(model, fused) again afterwards (it replaces the joint and the loss)."""
    model._transducer_fused = fused
    model.change_vocabulary = InstanceMethod(_change_vocabulary_and_apply, model)


def _change_vocabulary_and_apply(model, *args, **kwargs):
    """The model's change_vocabulary, then :func:`apply` again with the same ``fused``."""
    result = type(model).change_vocabulary(model, *args, **kwargs)
    apply(model, model._transducer_fused)
    return result
