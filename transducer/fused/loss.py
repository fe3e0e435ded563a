"""The fused joiner loss's public function and module: their arguments checked, the op (transducer/fused/op.py)
called, its per-utterance losses reduced."""

import operator
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..checks import FLOAT_DTYPES, INDEX_DTYPES, check_blank, check_tensor, is_index, plural
from ..entries import Entry, LossModule, Param, check_options, declare
from ..joiner import ACTIVATIONS
from ..lattices import check_supported, kind_of
from ..loss import reduce_losses
from ..options import BY_NAME, LATTICES, REQUIRED, LossOptions, check_device_limits, joint_checks
from ..pack import check_rows_before_copy
from ..sharding import full_parameters
from .op import fused
from .tiles import default_max_rows

__all__ = ["fused_joiner_loss", "FusedJoinerLoss"]


_TENSORS = (
    Param("encoder_out", "Tensor", "``(B, maxT, J)``, ``J >= 1``, float16 / bfloat16 / float32 / float64."),
    Param(
        "predictor_out", "Tensor", "``(B, maxU+1, J)``, a floating dtype (may differ from encoder_out's), same device."
    ),
    Param(
        "weight",
        "Tensor",
        "``(V, J)``, the output projection (a ``Linear(J, V)``'s weight); with ``durations``, "
        "``(V + D, J)``: V token rows then D duration rows (NeMo's joint layout).",
    ),
    Param("bias", "Tensor or None", "``(weight.size(0),)``, or None.", REQUIRED),
    Param("targets", "Tensor", "``(B, S)`` int32 / int64, ``S >= max U_b``, labels in ``[0, V)``, not a blank."),
    Param("logit_lengths", "Tensor", "``(B,)`` int32 / int64, ``1 <= T_b <= maxT``."),
    Param("target_lengths", "Tensor", "``(B,)`` int32 / int64, ``0 <= U_b <= maxU``."),
)
_DOCS = {
    "blank": "the blank's column among the token rows of ``weight``, in ``[-V, V)``; negative counts from the end.",
    "check_inputs": "check lengths and labels against the tensors; sizing the tiles reads the layout on the host "
    "whatever check_inputs (one transfer in forward; the eager backward reuses it, a traced one "
    "reads it again).",
    "durations": "TDT's durations, as for :func:`transducer.tdt_loss`: the loss is TDT's, over ``weight``'s last "
    "D = len(durations) rows (not with one_sym_per_frame).",
    "big_blank_durations": "as for :func:`transducer.multiblank_loss` (with ``sigma``): the multi-blank loss.",
}
FUSED_JOINER_LOSS = Entry("fused_joiner_loss", LATTICES, _TENSORS, exclude=("from_log_softmax",), docs=_DOCS)


def _checked(options, device, blank_columns, columns):
    """The loss's checked options and the joiner's: (LossOptions, call options); ``blank_columns``: the token
    columns the blank is checked against (None: only its type, a module before a call)."""
    o = check_options(options)
    call = {name: o.pop(name) for name in _JOINER_OPTIONS if name in o}
    if blank_columns is not None:
        o["blank"] = check_blank(o["blank"], blank_columns, columns)
    loss_options = LossOptions(**o)
    kind = kind_of(loss_options)
    check_supported(loss_options, kind, device.type if device is not None else None)
    if device is not None:
        check_device_limits(loss_options, device)
    if blank_columns is not None:
        joint_checks(loss_options)
    return loss_options, call


# the options of the call, not of the lattice
_JOINER_OPTIONS = ("reduction", "zero_infinity", "check_inputs", "activation", "dropout", "generator", "max_rows")


def _fused_joiner_loss(encoder_out, predictor_out, weight, bias, targets, logit_lengths, target_lengths, options):
    """fused_joiner_loss's work (its arguments checked; ``options``: the options as given)."""
    weight, bias = full_parameters(
        weight,
        bias,
        encoder_out=encoder_out,
        predictor_out=predictor_out,
        targets=targets,
        logit_lengths=logit_lengths,
        target_lengths=target_lengths,
    )  # FSDP2's shards
    check_tensor("encoder_out", encoder_out, FLOAT_DTYPES, (3,), None)
    device = encoder_out.device
    check_tensor("predictor_out", predictor_out, FLOAT_DTYPES, (3,), device, "encoder_out")
    check_tensor("weight", weight, FLOAT_DTYPES, (2,), device, "encoder_out")
    if bias is not None:
        check_tensor("bias", bias, FLOAT_DTYPES, (1,), device, "encoder_out")
    check_tensor("targets", targets, INDEX_DTYPES, (2,), device, "encoder_out")
    check_tensor("logit_lengths", logit_lengths, INDEX_DTYPES, (1,), device, "encoder_out")
    check_tensor("target_lengths", target_lengths, INDEX_DTYPES, (1,), device, "encoder_out")
    B, _, J = encoder_out.shape
    if J == 0:
        raise ValueError(
            f"encoder_out: expected rows of at least one entry (B, maxT, J >= 1), got shape {tuple(encoder_out.shape)}"
        )
    rows = weight.size(0)  # the token columns and, with durations, the duration columns
    durations = options.get("durations")
    D = len(BY_NAME["durations"].check(durations))
    if rows - D < 2:
        before = f" before the {D} duration rows" if D else ""
        raise ValueError(f"weight: expected at least 2 token rows{before}, got shape {tuple(weight.shape)}")
    options, call = _checked(options, device, rows - D, "the token rows of weight")
    if B == 0:
        raise ValueError("encoder_out: expected at least one utterance, got an empty batch")
    if predictor_out.size(0) != B or predictor_out.size(2) != J:
        raise ValueError(
            f"predictor_out: expected shape ({B}, maxU+1, {J}) to match encoder_out "
            f"{tuple(encoder_out.shape)}, got {tuple(predictor_out.shape)}"
        )
    if weight.size(1) != J:
        raise ValueError(f"weight: expected shape (V, {J}) (J = encoder_out.size(2)), got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"bias: expected shape ({rows},) (weight.size(0)), got {tuple(bias.shape)}")
    for name, x in (("logit_lengths", logit_lengths), ("target_lengths", target_lengths), ("targets", targets)):
        if x.size(0) != B:
            raise ValueError(
                f"{name}: expected {plural(B, 'entry', 'entries')} along dim 0 (one per utterance), "
                f"got shape {tuple(x.shape)}"
            )
    dropout, max_rows = call["dropout"], call["max_rows"]
    # the GEMMs' dtype: the autocast dtype, as F.linear under autocast takes it, else the inputs' promoted one
    compute_dtype = torch.promote_types(encoder_out.dtype, predictor_out.dtype)
    if torch.is_autocast_enabled(device.type) and compute_dtype != torch.float64:
        compute_dtype = torch.get_autocast_dtype(device.type)
    if max_rows is None:
        max_rows = default_max_rows(J, rows, torch.finfo(compute_dtype).bits // 8, device.type)
    # dropout's seed: 63 bits from a CPU generator, a CPU tensor (no device work, and torch.compile traces it)
    seed = (
        torch.randint((1 << 63) - 1, (), generator=call["generator"]) if dropout else torch.zeros((), dtype=torch.int64)
    )
    if call["check_inputs"]:
        check_rows_before_copy(encoder_out, predictor_out, logit_lengths, target_lengths)
    inputs = (
        encoder_out.contiguous(),
        predictor_out.contiguous(),
        weight,
        bias,
        targets.contiguous(),
        logit_lengths,
        target_lengths,
        *options.flat(),
        call["activation"],
        dropout,
        seed,
        call["check_inputs"],
        compute_dtype,
        max_rows,
        torch.compiler.is_compiling(),
    )
    with torch.autocast(device.type, enabled=False):  # the op casts for its GEMMs itself
        nll = fused(*inputs)[0]
    return reduce_losses(nll, call["reduction"], call["zero_infinity"])


declare(FUSED_JOINER_LOSS)


def fused_joiner_loss(
    encoder_out: Tensor,
    predictor_out: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    *,
    blank: int = 0,
    reduction: str = "mean",
    one_sym_per_frame: bool = False,
    zero_infinity: bool = False,
    check_inputs: bool = True,
    clamp: float = -1.0,
    fastemit_lambda: float = 0.0,
    delay_penalty: float = 0.0,
    durations: Optional[Sequence[int]] = None,
    sigma: float = 0.0,
    omega: float = 0.0,
    big_blank_durations: Optional[Sequence[int]] = None,
    activation: str = "tanh",
    dropout: float = 0.0,
    generator: Optional[torch.Generator] = None,
    max_rows: Optional[int] = None,
) -> Tensor:
    r"""The joiner ``F.linear(dropout(act(encoder_out[b, t] + predictor_out[b, u])), weight, bias)`` and the
    transducer loss over its logits, without the logits or the joiner's hidden in memory.

    Equal to ``transducer_loss(F.linear(act(pack(encoder_out, predictor_out, T, U)), weight, bias), targets,
    T, U, ...)`` with the same options (:func:`transducer.transducer_loss`); with ``durations``, to
    ``tdt_loss(F.linear(...), targets, T, U, durations, ...)`` (:func:`transducer.tdt_loss`); with
    ``big_blank_durations``, to ``multiblank_loss(F.linear(...), ...)`` (:func:`transducer.multiblank_loss`).
    Gradients flow to ``encoder_out``, ``predictor_out``, ``weight`` and ``bias``, each in its own dtype.

    Args:
        encoder_out (Tensor): ``(B, maxT, J)``, ``J >= 1``, float16 / bfloat16 / float32 / float64.
        predictor_out (Tensor): ``(B, maxU+1, J)``, a floating dtype (may differ from encoder_out's), same device.
        weight (Tensor): ``(V, J)``, the output projection (a ``Linear(J, V)``'s weight); with ``durations``,
            ``(V + D, J)``: V token rows then D duration rows (NeMo's joint layout).
        bias (Tensor or None): ``(weight.size(0),)``, or None.
        targets (Tensor): ``(B, S)`` int32 / int64, ``S >= max U_b``, labels in ``[0, V)``, not a blank.
        logit_lengths (Tensor): ``(B,)`` int32 / int64, ``1 <= T_b <= maxT``.
        target_lengths (Tensor): ``(B,)`` int32 / int64, ``0 <= U_b <= maxU``.
        blank (int, optional): the blank's column among the token rows of ``weight``, in ``[-V, V)``; negative
            counts from the end. (Default: ``0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as torchaudio).
            (Default: ``'mean'``)
        one_sym_per_frame (bool, optional): RNA: a label moves (t, u) -> (t+1, u+1); an utterance with
            ``U_b > T_b - 1`` has no alignment and loss ``+inf``. (Default: ``False``)
        zero_infinity (bool, optional): infinite losses become 0 (their gradient is zero either way); NaN losses
            stay NaN. (Default: ``False``)
        check_inputs (bool, optional): check lengths and labels against the tensors; sizing the tiles reads the
            layout on the host whatever check_inputs (one transfer in forward; the eager backward reuses it, a
            traced one reads it again). (Default: ``True``)
        clamp (float, optional): if > 0, each gradient element for a unit incoming gradient is clamped to
            ``[-clamp, clamp]`` before the incoming gradient scales it (torchaudio's; TDT: the token scores'
            gradient alone, as NeMo's). (Default: ``-1.0``)
        fastemit_lambda (float, optional): FastEmit (Yu et al. 2021): the gradient w.r.t. every label log-prob times
            ``1 + fastemit_lambda``; the loss value is unchanged. In ``[0, 65503]``: the gradient's entries reach
            ``1 + fastemit_lambda``, which stays finite in float16. (Default: ``0.0``)
        delay_penalty (float, optional): k2's delay penalty: the label log-prob of cell (t, u) of utterance b gets
            ``delay_penalty * ((T_b - 1) / 2 - t)`` before the recursion. (Default: ``0.0``)
        durations (list of int, optional): TDT's durations, as for :func:`transducer.tdt_loss`: the loss is TDT's,
            over ``weight``'s last D = len(durations) rows (not with one_sym_per_frame). (Default: ``None``)
        sigma (float, optional): logit under-normalisation: token log-probs are ``log_softmax - sigma``. (Default:
            ``0.0``)
        omega (float, optional): in ``[0, 1)``; the loss is ``(1 - omega) * tdt + omega * rnnt``, rnnt the plain
            RNN-T loss of the token scores without sigma (the expectation of NeMo's sampling it). (Default: ``0.0``)
        big_blank_durations (list of int, optional): as for :func:`transducer.multiblank_loss` (with ``sigma``): the
            multi-blank loss. (Default: ``None``)
        activation (str, optional): the joiner's activation, one of 'identity', 'tanh', 'relu', 'sigmoid', 'gelu',
            'silu', 'leaky_relu' (transducer/joiner.py). (Default: ``'tanh'``)
        dropout (float, optional): the rate of dropout on the joiner's hidden, in [0, 1 - 2^-10], after the
            activation (NeMo's joint); its mask is a hash of a seed drawn from ``generator`` and of each element's
            (row, column), the same in backward's recompute (``transducer.joiner.dropout_mask``); 0 draws nothing.
            (Default: ``0.0``)
        generator (torch.Generator, optional): a CPU generator for dropout's seed (None: torch's default one).
            (Default: ``None``)
        max_rows (int, optional): rows per tile (None: tile buffers of about 256 MiB on CUDA, 16 MiB on the CPU);
            forward's on the Hopper kernels, which hold no logits, take the same bytes. (Default: ``None``)

    Returns:
        Tensor: float32 loss (float64 for float64 inputs): ``(B,)`` for ``"none"``, else a scalar. Memory: a few
        floats per row of the grids (under torch.compile, per row of B * maxT * (maxU+1), a bound known from
        the shapes) plus one tile of ``max_rows * (J + V)``. The sum and the activation run in the inputs'
        promoted dtype (as ``enc + pred``), the GEMMs in the autocast dtype under autocast (else the promoted
        one), the loss arithmetic in fp32.

    Example::

        >>> enc, pred = torch.randn(2, 5, 8, requires_grad=True), torch.randn(2, 4, 8, requires_grad=True)
        >>> joiner = torch.nn.Linear(8, 6)
        >>> loss = fused_joiner_loss(enc, pred, joiner.weight, joiner.bias, torch.tensor([[1, 2, 3], [4, 5, 0]]),
        ...                          torch.tensor([5, 3]), torch.tensor([3, 2]))
        >>> loss.backward()
    """
    return _fused_joiner_loss(
        encoder_out,
        predictor_out,
        weight,
        bias,
        targets,
        logit_lengths,
        target_lengths,
        dict(
            blank=blank,
            reduction=reduction,
            one_sym_per_frame=one_sym_per_frame,
            zero_infinity=zero_infinity,
            check_inputs=check_inputs,
            clamp=clamp,
            fastemit_lambda=fastemit_lambda,
            delay_penalty=delay_penalty,
            durations=durations,
            sigma=sigma,
            omega=omega,
            big_blank_durations=big_blank_durations,
            activation=activation,
            dropout=dropout,
            generator=generator,
            max_rows=max_rows,
        ),
    )


_MODULE_PARAMS = (
    Param("joiner_dim", "int", "J >= 1, the width of ``enc + pred``."),
    Param("vocab_size", "int", "V >= 2, the token columns (blank included)."),
    "activation",
    Param("bias", "bool", "the projection has a bias.", True),
    "blank",
    "reduction",
    "one_sym_per_frame",
    "zero_infinity",
    "check_inputs",
    "max_rows",
    "clamp",
    "fastemit_lambda",
    "delay_penalty",
    "durations",
    "sigma",
    "omega",
    "big_blank_durations",
    "dropout",
    Param("device", "torch.device", "the projection's device.", None),
    Param("dtype", "torch.dtype", "the projection's dtype.", None),
)
_MODULE_DOCS = dict(
    _DOCS,
    blank="the blank's column; negative counts from the end.",
    dropout="the rate of dropout on the joiner's hidden in training mode, as for "
    ":func:`fused_joiner_loss` (its seed drawn from torch's default CPU generator); none in "
    "eval mode.",
)
_MODULE = Entry("FusedJoinerLoss", LATTICES, _MODULE_PARAMS, exclude=("from_log_softmax",), docs=_MODULE_DOCS)


FUSEDJOINERLOSS_MODULE = declare(_MODULE)


class FusedJoinerLoss(LossModule):
    """A joiner ``output(act(enc + pred))`` and the transducer loss over it, fused (:func:`fused_joiner_loss`).

    ``loss = m(encoder_out, predictor_out, targets, T, U)`` trains; ``m.logits(enc, pred)`` gives the joiner's
    logits for decoding, with broadcasting (for example enc ``(B, T, 1, J)`` and pred ``(B, 1, U+1, J)``).
    The module owns the output projection as ``m.output`` (a ``Linear(joiner_dim, vocab_size)``), so a model
    swaps its joiner's last layer for it and keeps the weights. With ``durations`` (TDT) the projection is a
    ``Linear(joiner_dim, vocab_size + len(durations))``: token scores then duration scores, as
    :func:`transducer.tdt_loss` reads them; with ``big_blank_durations`` the big blanks are among the
    ``vocab_size`` columns, before the blank.

    Args:
        joiner_dim (int): J >= 1, the width of ``enc + pred``.
        vocab_size (int): V >= 2, the token columns (blank included).
        activation (str, optional): the joiner's activation, one of 'identity', 'tanh', 'relu', 'sigmoid', 'gelu',
            'silu', 'leaky_relu' (transducer/joiner.py). (Default: ``'tanh'``)
        bias (bool, optional): the projection has a bias. (Default: ``True``)
        blank (int, optional): the blank's column; negative counts from the end. (Default: ``0``)
        reduction (str, optional): ``"none"`` | ``"sum"`` | ``"mean"`` (the mean over the batch, as torchaudio).
            (Default: ``'mean'``)
        one_sym_per_frame (bool, optional): RNA: a label moves (t, u) -> (t+1, u+1); an utterance with
            ``U_b > T_b - 1`` has no alignment and loss ``+inf``. (Default: ``False``)
        zero_infinity (bool, optional): infinite losses become 0 (their gradient is zero either way); NaN losses
            stay NaN. (Default: ``False``)
        check_inputs (bool, optional): check lengths and labels against the tensors; sizing the tiles reads the
            layout on the host whatever check_inputs (one transfer in forward; the eager backward reuses it, a
            traced one reads it again). (Default: ``True``)
        max_rows (int, optional): rows per tile (None: tile buffers of about 256 MiB on CUDA, 16 MiB on the CPU);
            forward's on the Hopper kernels, which hold no logits, take the same bytes. (Default: ``None``)
        clamp (float, optional): if > 0, each gradient element for a unit incoming gradient is clamped to
            ``[-clamp, clamp]`` before the incoming gradient scales it (torchaudio's; TDT: the token scores'
            gradient alone, as NeMo's). (Default: ``-1.0``)
        fastemit_lambda (float, optional): FastEmit (Yu et al. 2021): the gradient w.r.t. every label log-prob times
            ``1 + fastemit_lambda``; the loss value is unchanged. In ``[0, 65503]``: the gradient's entries reach
            ``1 + fastemit_lambda``, which stays finite in float16. (Default: ``0.0``)
        delay_penalty (float, optional): k2's delay penalty: the label log-prob of cell (t, u) of utterance b gets
            ``delay_penalty * ((T_b - 1) / 2 - t)`` before the recursion. (Default: ``0.0``)
        durations (list of int, optional): TDT's durations, as for :func:`transducer.tdt_loss`: the loss is TDT's,
            over ``weight``'s last D = len(durations) rows (not with one_sym_per_frame). (Default: ``None``)
        sigma (float, optional): logit under-normalisation: token log-probs are ``log_softmax - sigma``. (Default:
            ``0.0``)
        omega (float, optional): in ``[0, 1)``; the loss is ``(1 - omega) * tdt + omega * rnnt``, rnnt the plain
            RNN-T loss of the token scores without sigma (the expectation of NeMo's sampling it). (Default: ``0.0``)
        big_blank_durations (list of int, optional): as for :func:`transducer.multiblank_loss` (with ``sigma``): the
            multi-blank loss. (Default: ``None``)
        dropout (float, optional): the rate of dropout on the joiner's hidden in training mode, as for
            :func:`fused_joiner_loss` (its seed drawn from torch's default CPU generator); none in eval mode.
            (Default: ``0.0``)
        device (torch.device, optional): the projection's device. (Default: ``None``)
        dtype (torch.dtype, optional): the projection's dtype. (Default: ``None``)

    Example::

        >>> m = FusedJoinerLoss(8, 6)
        >>> enc, pred = torch.randn(2, 5, 8), torch.randn(2, 4, 8)
        >>> m(enc, pred, torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([5, 3]), torch.tensor([3, 2])).backward()
        >>> m.logits(enc[:, :, None], pred[:, None]).shape
        torch.Size([2, 5, 4, 6])
    """

    def __init__(
        self,
        joiner_dim: int,
        vocab_size: int,
        activation: str = "tanh",
        bias: bool = True,
        blank: int = 0,
        reduction: str = "mean",
        one_sym_per_frame: bool = False,
        zero_infinity: bool = False,
        check_inputs: bool = True,
        max_rows: Optional[int] = None,
        clamp: float = -1.0,
        fastemit_lambda: float = 0.0,
        delay_penalty: float = 0.0,
        durations: Optional[Sequence[int]] = None,
        sigma: float = 0.0,
        omega: float = 0.0,
        big_blank_durations: Optional[Sequence[int]] = None,
        dropout: float = 0.0,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(
            dict(
                activation=activation,
                blank=blank,
                reduction=reduction,
                one_sym_per_frame=one_sym_per_frame,
                zero_infinity=zero_infinity,
                check_inputs=check_inputs,
                max_rows=max_rows,
                clamp=clamp,
                fastemit_lambda=fastemit_lambda,
                delay_penalty=delay_penalty,
                durations=durations,
                sigma=sigma,
                omega=omega,
                big_blank_durations=big_blank_durations,
                dropout=dropout,
            )
        )
        self.build(joiner_dim, vocab_size, bias, device, dtype)

    def build(self, joiner_dim, vocab_size, bias, device=None, dtype=None):
        """The projection, ``Linear(joiner_dim, vocab_size + len(durations))``; the blank checked against
        ``vocab_size``, the options against one another."""
        for name, value, least in (("joiner_dim", joiner_dim, 1), ("vocab_size", vocab_size, 2)):
            if not is_index(value):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
            if value < least:
                raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
        joiner_dim, vocab_size = operator.index(joiner_dim), operator.index(vocab_size)
        loss_options, _ = _checked(self.options, None, vocab_size, "vocab_size")
        self.options["blank"] = loss_options.blank
        self.output = torch.nn.Linear(
            joiner_dim, vocab_size + len(loss_options.durations), bias=bias, device=device, dtype=dtype
        )

    def forward(self, encoder_out, predictor_out, targets, logit_lengths, target_lengths):
        """The loss of the joiner over ``encoder_out`` (B, maxT, J) and ``predictor_out`` (B, maxU+1, J) with the
        module's projection and options (see :func:`fused_joiner_loss`)."""
        options = dict(self.options, dropout=self.options["dropout"] if self.training else 0.0)
        return fused_joiner_loss(
            encoder_out,
            predictor_out,
            self.output.weight,
            self.output.bias,
            targets,
            logit_lengths,
            target_lengths,
            **options,
        )

    def logits(self, encoder_out, predictor_out):
        """``output(act(encoder_out + predictor_out))`` with broadcasting, for decoding."""
        return self.output(ACTIVATIONS[self.options["activation"]].forward(encoder_out + predictor_out))
