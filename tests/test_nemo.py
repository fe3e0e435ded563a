"""transducer.integrations.nemo against NeMo itself: RNNTLoss against NeMo's RNNTLoss (warprnnt_numba, pytorch,
multiblank_rnnt_pytorch; TDT, which NeMo runs on CUDA only, against the float64 reference) for every reduction,
16-bit joints and options; tiny NeMo models (char, BPE, hybrid char and BPE; RNN-T, multi-blank, TDT; relu, tanh
and sigmoid joints) trained a step with and without apply, fused and not: the loss, every parameter's gradient
and the WER; validation and decoding unchanged; joint dropout reproducible; refused models and losses."""

import importlib.metadata

import pytest
import torch
from _batches import random_batch
from _cpu import autocast_lstms
from _imports import require

from transducer import multiblank_loss_reference, tdt_loss_reference, transducer_loss_reference
from transducer.integrations import nemo as integration
from transducer.integrations.nemo import RNNTLoss, apply

try:  # the nemo-toolkit distribution, not an extract of its numba losses (test_nemo_cuda.py's peer)
    importlib.metadata.version("nemo-toolkit")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("nemo-toolkit is not installed: pip install -e '.[nemo]'", allow_module_level=True)
require("nemo.collections.asr", "nemo")
import _nemo_models as tiny  # noqa: E402
from nemo.collections.asr.losses.rnnt import RNNTLoss as NemoRNNTLoss  # noqa: E402

REDUCTIONS = ["mean_batch", "mean", "sum", "mean_volume", None]


def joint_batch(seed, C, dtype=torch.float32):
    """A padded (B, maxT, maxU+1, C) joint as NeMo's models give it (the blank in column C - 1 or before the extra
    columns), with T_b = 1 and U_b = 0 utterances; labels in [0, C - 8)."""
    gen = torch.Generator().manual_seed(seed)
    logits, targets, T, U = random_batch(
        gen, 5, 6, 4, C - 8, C - 8, dtype=torch.float64, scale=2.0, edges=True, extra=8
    )
    return logits.to(dtype), targets, T, U


def nemo_reduce(losses, lengths, reduction):
    """NeMo's RNNTLoss.reduce, written out."""
    return {
        "mean_batch": losses.mean,
        "mean": lambda: (losses / lengths).mean(),
        "sum": losses.sum,
        "mean_volume": lambda: losses.sum() / lengths.sum(),
        None: lambda: losses,
    }[reduction]()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "loss_name,kwargs",
    [
        ("default", {}),
        ("warprnnt_numba", {"fastemit_lambda": 0.2}),
        ("pytorch", {}),
        ("multiblank_rnnt_pytorch", {"big_blank_durations": [2, 3], "sigma": 0.05}),
    ],
)
def test_loss_equals_nemos(loss_name, kwargs, reduction):
    logits, targets, T, U = joint_batch(3, 30)
    blank = 29
    ours, theirs = (
        cls(blank, reduction=reduction, loss_name=loss_name, loss_kwargs=dict(kwargs))
        for cls in (RNNTLoss, NemoRNNTLoss)
    )
    if reduction == "mean":  # U_b = 0: inf for both
        U = U.clamp(min=1)
    x = logits.clone().requires_grad_()
    want = theirs(log_probs=x, targets=targets, input_lengths=T, target_lengths=U)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    got = ours(log_probs=x, targets=targets, input_lengths=T, target_lengths=U)
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", ["rnnt", "tdt", "multiblank"])
def test_loss_equals_the_float64_reference(kind, reduction):
    """Every kind and reduction, 16-bit joints read as they are: the float64 reference of the same values (TDT:
    the expectation of NeMo's omega)."""
    durations, big = [0, 1, 3], [2, 4]
    name, kwargs, C, blank = {
        "rnnt": ("warprnnt_numba", {"fastemit_lambda": 0.1}, 30, 29),
        "tdt": ("tdt", {"durations": durations, "sigma": 0.05, "omega": 0.25, "fastemit_lambda": 0.1}, 33, 29),
        "multiblank": ("multiblank_rnnt", {"big_blank_durations": big, "sigma": 0.05}, 30, 29),
    }[kind]
    logits, targets, T, U = joint_batch(5, C)
    U = U.clamp(min=1) if reduction == "mean" else U
    reference = {
        "rnnt": lambda x: transducer_loss_reference(x, targets, T, U, blank, fastemit_lambda=0.1),
        "tdt": lambda x: tdt_loss_reference(
            x, targets, T, U, durations, blank, sigma=0.05, omega=0.25, fastemit_lambda=0.1
        ),
        "multiblank": lambda x: multiblank_loss_reference(x, targets, T, U, big, blank, sigma=0.05),
    }[kind]
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype).requires_grad_()
        exact = x.detach().double().requires_grad_()
        losses = reference(exact)
        if "fastemit_lambda" in kwargs:  # NeMo's numba losses return the loss times 1 + fastemit_lambda
            losses = losses + 0.1 * losses.detach()
        want = nemo_reduce(losses, U.double(), reduction)
        (want_grad,) = torch.autograd.grad(want.sum(), exact)
        got = RNNTLoss(blank, reduction=reduction, loss_name=name, loss_kwargs=kwargs)(x, targets, T, U)
        (got_grad,) = torch.autograd.grad(got.sum(), x)
        assert got.dtype == torch.float32 and got_grad.dtype == dtype
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            got_grad.double(),
            want_grad,
            rtol=1e-4 if dtype == torch.float32 else 1e-2,
            atol=1e-5 if dtype == torch.float32 else 2e-3,
        )


@pytest.mark.parametrize("reduction", ["mean_batch", "sum"])
def test_clamp_is_nemos_cuda_clamp(reduction):
    """clamp bounds each gradient element for a unit incoming gradient, which the reduction then scales, as NeMo's
    CUDA loss does; NeMo's CPU loss clamps after the reduction's scaling: the two agree for "sum"."""
    logits, targets, T, U = joint_batch(4, 30)
    kwargs = {"fastemit_lambda": 0.2, "clamp": 0.05}
    x = logits.clone().requires_grad_()
    got = RNNTLoss(29, reduction=reduction, loss_name="warprnnt_numba", loss_kwargs=kwargs)(x, targets, T, U)
    (got_grad,) = torch.autograd.grad(got, x)
    nemo = NemoRNNTLoss(29, reduction="sum", loss_name="warprnnt_numba", loss_kwargs=dict(kwargs))
    want = nemo(log_probs=x, targets=targets, input_lengths=T, target_lengths=U)
    (want_grad,) = torch.autograd.grad(want, x)
    scale = 1 / len(T) if reduction == "mean_batch" else 1
    bound = torch.tensor(0.05 * scale)
    assert got_grad.abs().max() <= bound * (1 + 1e-6) and torch.isclose(got_grad.abs(), bound).any()
    torch.testing.assert_close(got * (1 / scale), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad * (1 / scale), want_grad, rtol=1e-4, atol=1e-5)


def test_loss_refuses_what_nemo_would_not_run():
    with pytest.raises(ValueError, match="loss_name: 'graph_rnnt' has no counterpart"):
        RNNTLoss(5, loss_name="graph_rnnt")
    with pytest.raises(ValueError, match="the tdt loss needs durations"):
        RNNTLoss(5, loss_name="tdt")
    with pytest.raises(ValueError, match="reduction: expected one of"):
        RNNTLoss(5, reduction="none")  # transformers' name, not NeMo's
    with pytest.raises(ValueError, match="num_classes: expected an int >= 0"):
        RNNTLoss(-1)
    with pytest.raises(TypeError, match="num_classes: expected an int"):
        RNNTLoss(5.0)
    with pytest.warns(UserWarning, match="loss_kwargs: durations ignored: the pytorch loss does not take them"):
        RNNTLoss(5, loss_name="pytorch", loss_kwargs={"durations": [1]})
    # what the losses refuse is refused, not converted (an int() would make 1.7 a duration of 1)
    with pytest.raises(ValueError, match=r"loss_kwargs\['durations'\]: expected a sequence of ints, got \[0, 1.7"):
        RNNTLoss(5, loss_name="tdt", loss_kwargs={"durations": [0, 1.7, 2.2]})
    with pytest.raises(ValueError, match=r"loss_kwargs\['big_blank_durations'\]: expected a sequence of ints"):
        RNNTLoss(5, loss_name="multiblank_rnnt", loss_kwargs={"big_blank_durations": [2.9]})
    with pytest.raises(ValueError, match=r"loss_kwargs\['big_blank_durations'\]: 2 big blanks .* column 1"):
        RNNTLoss(1, loss_name="multiblank_rnnt", loss_kwargs={"big_blank_durations": [2, 3]})
    with pytest.raises(TypeError, match=r"loss_kwargs\['clamp'\]: expected a number, got bool True"):
        RNNTLoss(5, loss_kwargs={"clamp": True})
    with pytest.raises(TypeError, match=r"loss_kwargs\['fastemit_lambda'\]: expected a number, got str '0.1'"):
        RNNTLoss(5, loss_kwargs={"fastemit_lambda": "0.1"})
    with pytest.raises(TypeError, match=r"loss_kwargs\['sigma'\]: expected a number"):
        RNNTLoss(5, loss_name="tdt_pytorch", loss_kwargs={"durations": [0, 1], "sigma": None})
    loss = RNNTLoss(5, loss_name="tdt", loss_kwargs={"durations": [0, 1, 2], "clamp": 1, "fastemit_lambda": 0})
    assert loss.options == {"durations": (0, 1, 2), "sigma": 0.0, "omega": 0.0, "fastemit_lambda": 0.0, "clamp": 1.0}
    # a loss built for another vocabulary: the error names num_classes (V = 5 tokens and the blank: 6 columns)
    targets, T, U = torch.tensor([[1, 2]]), torch.tensor([3]), torch.tensor([2])
    tdt = dict(loss_name="tdt", loss_kwargs={"durations": [0, 1, 2]})
    for num_classes, columns, kwargs in ((6, 6, {}), (5, 5 + 3, tdt), (9, 8, {})):
        with pytest.raises(ValueError, match=f"num_classes: {num_classes} .* token columns of log_probs"):
            RNNTLoss(num_classes, **kwargs)(torch.zeros(1, 3, 3, columns), targets, T, U)
    with pytest.raises(ValueError, match="num_classes: 6 .* not among the 6 token columns of weight"):
        RNNTLoss(6).joint_loss(
            torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), torch.zeros(6, 4), None, targets, T, U, "tanh"
        )
    assert RNNTLoss(5)(torch.zeros(1, 3, 3, 6), targets, T, U) > 0
    assert RNNTLoss(5, **tdt)(torch.zeros(1, 3, 3, 9), targets, T, U) > 0


class ReferenceTDTLoss(torch.nn.Module):
    """NeMo's RNNTLoss interface over the float64 TDT reference: the witness for TDT models on the CPU."""

    def __init__(self, blank, reduction, durations, sigma):
        super().__init__()
        self.blank, self.reduction, self.durations, self.sigma = blank, reduction, durations, sigma

    def forward(self, log_probs, targets, input_lengths, target_lengths):
        losses = tdt_loss_reference(
            log_probs.double(), targets, input_lengths, target_lengths, self.durations, self.blank, sigma=self.sigma
        ).float()
        return self.reduce(losses, target_lengths)

    def reduce(self, losses, target_lengths):
        if isinstance(losses, list):
            losses, target_lengths = torch.cat(losses), torch.cat(target_lengths)
        return nemo_reduce(losses, target_lengths, self.reduction)


def witness_step(kind, loss, data, **options):
    """The unpatched model's step (TDT: NeMo's joint and step with the float64 reference loss)."""
    model = tiny.build(kind, loss, **options)
    if loss == "tdt":
        model.loss = ReferenceTDTLoss(model.loss._blank, model.loss.reduction, tiny.DURATIONS, 0.05)
        if model.joint.fuse_loss_wer:
            model.joint.set_loss(model.loss)
    return tiny.training_step(model, data)


def assert_steps_equal(got, want, rtol=1e-5):
    (loss, grads, logged), (want_loss, want_grads, want_logged) = got, want
    torch.testing.assert_close(loss, want_loss, rtol=rtol, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-3, atol=2e-5, msg=name)
    assert float(logged["training_batch_wer"]) == float(want_logged["training_batch_wer"])


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid"])
@pytest.mark.parametrize("loss", ["default", "multiblank_rnnt_pytorch", "tdt"])
def test_training_step_equals_nemos(loss, activation, fused):
    """The step's loss, every parameter's gradient and the batch WER equal the unpatched model's."""
    data = tiny.batch(tiny.build("char", loss))
    want = witness_step("char", loss, data, activation=activation)
    model = apply(tiny.build("char", loss, activation=activation), fused=fused)
    assert isinstance(model.loss, RNNTLoss)
    assert isinstance(model.joint, integration.FusedJointMixin) == fused and model.joint.fuse_loss_wer == fused
    assert_steps_equal(tiny.training_step(model, data), want)


@pytest.mark.parametrize("fused", [True, False])
def test_bf16_autocast_step_near_nemos(fused):
    """Under bf16 autocast NeMo copies the joint to float32 for its loss; this library reads it in bf16 (or fuses
    it): the loss and gradients agree to bf16's precision. The decoders' LSTMs run outside autocast where this CPU
    cannot run them under it (tests/_cpu.py)."""
    data = tiny.batch(tiny.build())
    witness, model = tiny.build(), apply(tiny.build(), fused=fused)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with autocast_lstms(witness):
            want_loss, want_grads, _ = tiny.training_step(witness, data)
        with autocast_lstms(model):
            loss, grads, _ = tiny.training_step(model, data)
    torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=0)
    assert grads.keys() == want_grads.keys()
    got, want = (torch.cat([g[name].float().flatten() for name in sorted(g)]) for g in (grads, want_grads))
    assert (got - want).norm() < 2e-2 * want.norm()
    for name in ("joint.joint_net.1.weight", "joint.enc.weight", "decoder.prediction.embed.weight"):
        assert (grads[name] - want_grads[name]).norm() < 2e-2 * want_grads[name].norm(), name


@pytest.mark.parametrize("reduction", ["mean_batch", "mean", "sum", "mean_volume"])
@pytest.mark.parametrize("kind", ["char", "bpe", "hybrid_char", "hybrid_bpe"])
def test_every_model_and_reduction(kind, reduction):
    """Models built with NeMo's fused joint (fuse_loss_wer, sub-batches of 2). Fused: the step of NeMo's fused joint
    over one sub-batch of the whole batch (NeMo's WER is the mean of its sub-batches'); not fused: NeMo's loop over
    sub-batches of 2 with this library's loss."""
    data = tiny.batch(tiny.build(kind))
    if reduction == "mean":  # NeMo's "mean" is NaN with an utterance without labels
        data = data[:3] + (data[3].clamp(min=1),)
    for fused, witness_batch in ((True, len(data[1])), (False, 2)):
        want = witness_step(
            kind, "default", data, reduction=reduction, fuse_loss_wer=True, fused_batch_size=witness_batch
        )
        model = apply(tiny.build(kind, reduction=reduction, fuse_loss_wer=True, fused_batch_size=2), fused=fused)
        assert model.joint.fuse_loss_wer and model.joint.fused_batch_size == 2
        assert_steps_equal(tiny.training_step(model, data), want)


def texts(hyps):
    """The texts of rnnt_decoder_predictions_tensor's hypotheses (NeMo before 2.2 returns (texts, None))."""
    if isinstance(hyps, tuple):
        hyps = hyps[0]
    return [h if isinstance(h, str) else h.text for h in hyps]


def test_validation_and_decoding_unchanged():
    model = tiny.build("char", "multiblank_rnnt_pytorch", activation="relu")
    data = tiny.batch(model)
    want = tiny.build("char", "multiblank_rnnt_pytorch", activation="relu")
    for m in (model, want):
        tiny.attach_trainer(m)
        m.eval()
    apply(model)
    with torch.no_grad():
        got_val, want_val = model.validation_pass(data, 0), want.validation_pass(data, 0)
        assert got_val.keys() == want_val.keys()
        for key in want_val:
            torch.testing.assert_close(got_val[key].float(), want_val[key].float(), rtol=1e-5, atol=1e-6, msg=key)
        encoded, encoded_len = model(input_signal=data[0], input_signal_length=data[1])
        hyps = model.decoding.rnnt_decoder_predictions_tensor(encoder_output=encoded, encoded_lengths=encoded_len)
        want_hyps = want.decoding.rnnt_decoder_predictions_tensor(encoder_output=encoded, encoded_lengths=encoded_len)
        assert texts(hyps) == texts(want_hyps)
        # a joint call without transcripts gives the joint, as the unfused model's does
        decoder, _, _ = model.decoder(targets=data[2], target_length=data[3])
        assert model.joint.fuse_loss_wer and not want.joint.fuse_loss_wer
        got_joint = model.joint(encoder_outputs=encoded, decoder_outputs=decoder)
        torch.testing.assert_close(got_joint, want.joint(encoder_outputs=encoded, decoder_outputs=decoder))


def test_joint_dropout_reproducible_under_a_seed():
    model = apply(tiny.build("char", "default", dropout=0.3))
    data = tiny.batch(model)
    first, again, other = (tiny.training_step(model, data, seed) for seed in (1, 1, 2))
    assert_steps_equal(again, first, rtol=0)
    assert abs(float(other[0]) - float(first[0])) > 1e-4
    # eval mode draws nothing: the loss of the joint without dropout
    model.eval()
    tiny.attach_trainer(model)
    with torch.no_grad():
        state = torch.get_rng_state()
        got = model.validation_pass(data, 0)["val_loss"]
        assert torch.equal(torch.get_rng_state(), state)
        model.joint.joint_net[1].p = 0.0
        torch.testing.assert_close(got, model.validation_pass(data, 0)["val_loss"], rtol=0, atol=0)


def test_joint_dropout_is_the_fused_loss():
    """The fused step with dropout equals the unfused composition with the same mask (joiner.dropout_mask)."""
    from transducer import fused_joiner_loss, pack, transducer_loss
    from transducer.joiner import Dropout, dropout_mask

    model = apply(tiny.build("char", "default", dropout=0.3, activation="sigmoid"))
    seen = {}

    def spy(*args, **kwargs):
        seen.update(dropout=kwargs["dropout"], args=args)
        return fused_joiner_loss(*args, generator=torch.Generator().manual_seed(7), **kwargs)

    integration.fused_joiner_loss, original = spy, integration.fused_joiner_loss
    try:
        loss, _, _ = tiny.training_step(model, tiny.batch(model))
    finally:
        integration.fused_joiner_loss = original
    assert seen["dropout"] == 0.3
    enc, pred, weight, bias, targets, T, U = seen["args"]
    seed = int(torch.randint((1 << 63) - 1, (), generator=torch.Generator().manual_seed(7)))
    h = torch.sigmoid(pack(enc, pred, T, U))
    h = h * dropout_mask(Dropout(0.3, seed), h.size(0), h.size(1))
    want = transducer_loss(
        torch.nn.functional.linear(h, weight, bias), targets, T, U, blank=model.loss.blank, reduction="none"
    ).mean()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind,loss", [("bpe", "multiblank_rnnt_pytorch"), ("char", "default")])
def test_change_vocabulary_applies_again(kind, loss):
    """NeMo's change_vocabulary replaces the joint and the loss (the BPE models' with the default RNN-T loss): the
    applied model's applies again, with the config's loss, and trains as NeMo's model of the new vocabulary."""
    model = apply(tiny.build(kind, loss))
    want = tiny.build(kind, loss)
    for m in (model, want):
        if kind == "bpe":
            m.change_vocabulary(new_tokenizer_dir=tiny.tokenizer_dir(), new_tokenizer_type="bpe")
        else:
            m.change_vocabulary(tiny.LABELS + ["-"])
    assert isinstance(model.joint, integration.FusedJointMixin) and isinstance(model.loss, RNNTLoss)
    # NeMo's char model writes its resolved loss name back ("default" -> "warprnnt_numba"): the same loss
    assert integration.LOSS_NAMES[model.loss.loss_name] == integration.LOSS_NAMES[loss]
    assert model.joint.loss is model.loss and model.joint.wer is model.wer
    assert model.loss.blank == model.joint.num_classes_with_blank - 1
    if kind == "char":  # NeMo's char model keeps its loss: the same step on the same weights
        want.load_state_dict(model.state_dict())
        data = tiny.batch(model)
        assert_steps_equal(tiny.training_step(model, data), tiny.training_step(want, data))


def test_apply_refuses():
    with pytest.raises(TypeError, match="model: expected a NeMo transducer model"):
        apply(torch.nn.Linear(2, 2))
    model = tiny.build()
    from omegaconf import open_dict

    with open_dict(model.cfg):
        model.cfg.loss.loss_name = "graph_rnnt"
    with pytest.raises(ValueError, match="cfg.loss.loss_name 'graph_rnnt' has no counterpart"):
        apply(model)
    model = tiny.build("char", "tdt")
    with open_dict(model.cfg):
        model.cfg.loss.tdt_kwargs.durations = [0, 1]
    with pytest.raises(ValueError, match="durations has 2 entries, the joint has 5 extra outputs"):
        apply(model)
    model = tiny.build()
    model.joint.joint_net[0] = torch.nn.ELU()
    with pytest.raises(ValueError, match=r"activation ELU\(alpha=1.0\) has no fused counterpart"):
        apply(model)
    apply(model, fused=False)  # NeMo's joint, this library's loss
    assert isinstance(model.loss, RNNTLoss) and not isinstance(model.joint, integration.FusedJointMixin)
    model = tiny.build()
    model.joint.joint_net = torch.nn.Linear(tiny.WIDTH, len(tiny.LABELS) + 1)
    with pytest.raises(ValueError, match=r"joint_net is not Sequential\(activation, \[Dropout\], Linear\)"):
        apply(model)
    model = tiny.build()
    model.joint.__class__ = type("ScaledJoint", (type(model.joint),), {"joint": lambda self, f, g: 2 * f + g})
    with pytest.raises(ValueError, match=r"ScaledJoint has its own ScaledJoint.joint, which the fused loss"):
        apply(model)
    from nemo.collections.asr.modules import HATJoint

    model = tiny.build()
    model.joint.__class__ = HATJoint
    with pytest.raises(ValueError, match=r"HATJoint has its own HATJoint.joint_after_projection"):
        apply(model)


def test_apply_refuses_an_old_nemo(monkeypatch):
    import nemo

    monkeypatch.setattr(nemo, "__version__", "1.23.0")
    with pytest.raises(ImportError, match=r"needs nemo-toolkit\[asr\] >= 2.0.0; found nemo-toolkit 1.23.0"):
        apply(tiny.build())


def test_hainan_masking_drawn_as_nemo_draws_it():
    """A joint with masking_prob > 0 (HAINAN) masks the decoder side in training: the same mask, the same step."""
    data = tiny.batch(tiny.build())
    want_model, model = tiny.build(), apply(tiny.build())
    for m in (want_model, model):
        m.joint.masking_prob = 0.5
    want, got = tiny.training_step(want_model, data, seed=4), tiny.training_step(model, data, seed=4)
    assert_steps_equal(got, want)
    unmasked = tiny.training_step(apply(tiny.build()), data, seed=4)
    assert abs(float(unmasked[0]) - float(got[0])) > 1e-3


def test_calls_without_transcripts_are_nemos():
    model = apply(tiny.build())
    encoded = torch.randn(2, tiny.WIDTH, 7)
    # NeMo's own forward answers, as for a model built with fuse_loss_wer (which apply turns on)
    with pytest.raises(ValueError, match="lengths must be provided"):
        model.joint(encoder_outputs=encoded, decoder_outputs=None)


def test_nemos_own_forward_after_another_loss_is_set():
    """A NeMo loss set on the applied model's joint: the fused joint hands the step to NeMo's own fused forward."""
    data = tiny.batch(tiny.build())
    want = witness_step("char", "default", data, fuse_loss_wer=True)  # NeMo's sub-batches of 2 on both sides
    model = apply(tiny.build("char", "default", fuse_loss_wer=True))
    model.loss = NemoRNNTLoss(model.loss.blank, reduction="mean_batch", loss_name="default")
    model.joint.set_loss(model.loss)
    assert isinstance(model.joint, integration.FusedJointMixin)
    assert_steps_equal(tiny.training_step(model, data), want)


def test_apply_twice_and_undo():
    model = tiny.build("char", "default")
    apply(apply(model))
    assert type(model.joint).__mro__[1] is integration.FusedJointMixin and model.joint.fuse_loss_wer
    apply(model, fused=False)
    assert not isinstance(model.joint, integration.FusedJointMixin) and not model.joint.fuse_loss_wer
    assert model.joint.fused_batch_size == 2  # the config's, as before
    data = tiny.batch(model)
    assert_steps_equal(tiny.training_step(model, data), witness_step("char", "default", data))
