"""transducer.integrations.espnet against ESPnet itself, on the CPU and without warp-transducer: RNNTLoss against
torchaudio's rnnt_loss, ESPnet's own numba RNN-T loss (its CPU path) and the float64 reference for every reduction
(warp-transducer's "mean" and "sum" of shape (1,), "none"), FastEmit and bf16 joints; MultiblankRNNTLoss against the
float64 reference (ESPnet's numba multi-blank loss runs on CUDA only); install(): both models built and trained as
ESPnet builds them; tiny ESPnetASRModel (RNN-T, multi-blank) and ESPnetASRTransducerModel built from ESPnet's classes
and scaled-down recipe configs, trained a step with and without apply, fused and not: the loss and every parameter's
gradient equal to the step of ESPnet's own joint output on the float64 reference and on torchaudio's loss; bf16
autocast; validation and decoding unchanged; refused models and losses."""

import copy
import importlib.util
import sys

import pytest
import torch
from _batches import random_batch
from _cpu import float32_convs
from _imports import require

from transducer import multiblank_loss_reference, transducer_loss_reference
from transducer.integrations import espnet as integration
from transducer.integrations.espnet import MultiblankRNNTLoss, RNNTLoss, apply, install, rnnt_loss

if importlib.util.find_spec("espnet2") is None:
    pytest.skip(
        "espnet is not installed: pip install -e '.[espnet]' && pip install --no-deps espnet==202511",
        allow_module_level=True,
    )
require("espnet2.asr.espnet_model", "espnet")
from espnet2.asr.ctc import CTC  # noqa: E402
from espnet2.asr.decoder.transducer_decoder import TransducerDecoder  # noqa: E402
from espnet2.asr.encoder.conformer_encoder import ConformerEncoder  # noqa: E402
from espnet2.asr.espnet_model import ESPnetASRModel  # noqa: E402
from espnet2.asr.transducer.rnnt_multi_blank.rnnt_multi_blank import RNNTLossNumba  # noqa: E402
from espnet2.asr_transducer.decoder.rnn_decoder import RNNDecoder  # noqa: E402
from espnet2.asr_transducer.decoder.stateless_decoder import StatelessDecoder  # noqa: E402
from espnet2.asr_transducer.encoder.encoder import Encoder  # noqa: E402
from espnet2.asr_transducer.espnet_transducer_model import ESPnetASRTransducerModel  # noqa: E402
from espnet2.asr_transducer.joint_network import JointNetwork  # noqa: E402

torchaudio = require("torchaudio.functional", "test")

REDUCTIONS = ["mean", "sum", "none"]
TOKENS = ["<blank>", "<unk>", *"abcdefgh", "<sos/eos>"]  # ESPnet's layout: blank 0, unknown 1, sos/eos last
FEATURES = 8
BIG_BLANKS = [2, 3]


@pytest.fixture(autouse=True)
def installed(monkeypatch):
    """install() for each test (the user's one call), undone afterwards."""
    monkeypatch.delitem(sys.modules, "warprnnt_pytorch", raising=False)
    install()
    yield
    monkeypatch.delitem(sys.modules, "warprnnt_pytorch", raising=False)


def warp_reduce(losses, reduction):
    """warp-transducer's reductions, written out."""
    return {
        "mean": lambda: losses.sum().reshape(1) / len(losses),
        "sum": lambda: losses.sum().reshape(1),
        "none": lambda: losses,
    }[reduction]()


class ReferenceLoss(torch.nn.Module):
    """warp-transducer's interface over the float64 references: the witness of ESPnet's own joint output."""

    def __init__(self, blank, reduction="mean", fastemit_lambda=0.0, big_blank_durations=None, sigma=0.0):
        super().__init__()
        self.blank, self.reduction, self.fastemit_lambda = blank, reduction, fastemit_lambda
        self.big_blank_durations, self.sigma = big_blank_durations, sigma

    def forward(self, acts, labels, act_lens, label_lens):
        x = acts.double()
        if self.big_blank_durations:
            losses = multiblank_loss_reference(
                x, labels, act_lens, label_lens, self.big_blank_durations, self.blank, sigma=self.sigma
            )
        else:
            losses = transducer_loss_reference(
                x, labels, act_lens, label_lens, self.blank, fastemit_lambda=self.fastemit_lambda
            )
        return warp_reduce(losses, self.reduction).float()


class TorchaudioLoss(torch.nn.Module):
    """warp-transducer's interface over torchaudio's rnnt_loss (float32, on the CPU right for every length)."""

    def __init__(self, blank, reduction="mean"):
        super().__init__()
        self.blank, self.reduction = blank, reduction

    def forward(self, acts, labels, act_lens, label_lens):
        losses = torchaudio.rnnt_loss(
            acts.float(), labels.int(), act_lens.int(), label_lens.int(), blank=self.blank, reduction="none"
        )
        return warp_reduce(losses, self.reduction)


def joint_batch(seed, V=12, dtype=torch.float32):
    """A padded (B, maxT, maxU+1, V) joint with T_b = 1 and U_b = 0 utterances, int32 labels and lengths as ESPnet
    gives them (get_transducer_task_io); blank 0."""
    gen = torch.Generator().manual_seed(seed)
    logits, targets, T, U = random_batch(gen, 5, 6, 4, V, 0, scale=2.0, edges=True)
    return logits.to(dtype), targets.int(), T.int(), U.int()


def loss_and_grad(loss, x, *args):
    x = x.detach().clone().requires_grad_()
    value = loss(x, *args)
    (grad,) = torch.autograd.grad(value.sum(), x)
    return value, grad


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_rnnt_loss_equals_torchaudio_espnets_numba_and_the_reference(reduction):
    acts, labels, T, U = joint_batch(1)
    got, got_grad = loss_and_grad(RNNTLoss(blank=0, fastemit_lambda=0.0, reduction=reduction), acts, labels, T, U)
    assert got.dtype == torch.float32 and got.shape == ((5,) if reduction == "none" else (1,))
    witnesses = [TorchaudioLoss(0, reduction), RNNTLossNumba(blank=0, reduction=reduction), ReferenceLoss(0, reduction)]
    for witness in witnesses:
        want, want_grad = loss_and_grad(witness, acts, labels, T, U)
        assert want.shape == got.shape, type(witness).__name__
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5, msg=type(witness).__name__)
        torch.testing.assert_close(got_grad, want_grad.float(), rtol=1e-4, atol=1e-6, msg=type(witness).__name__)
    # warp-transducer's "mean" is the sum over B, not the mean over labels or frames
    if reduction == "mean":
        none = RNNTLoss(0, 0.0, "none")(acts, labels, T, U)
        torch.testing.assert_close(got, none.sum().reshape(1) / 5)


def test_fastemit_is_warp_transducers():
    """FastEmit scales the label log-probs' gradient and leaves the loss as it is (warp-transducer's; ESPnet's numba
    loss returns the loss times 1 + lambda, with the same gradient). The default lambda is warp-transducer's."""
    assert RNNTLoss().fastemit_lambda == 0.001
    acts, labels, T, U = joint_batch(2)
    got, got_grad = loss_and_grad(RNNTLoss(0, 0.25), acts, labels, T, U)
    want, want_grad = loss_and_grad(ReferenceLoss(0, fastemit_lambda=0.25), acts, labels, T, U)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)
    plain = RNNTLoss(0, 0.0)(acts, labels, T, U)
    torch.testing.assert_close(got, plain)
    numba, numba_grad = loss_and_grad(RNNTLossNumba(blank=0, fastemit_lambda=0.25), acts, labels, T, U)
    torch.testing.assert_close(numba, got * 1.25, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, numba_grad, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(got_grad, loss_and_grad(RNNTLoss(0, 0.0), acts, labels, T, U)[1], atol=1e-4)


def test_rnnt_loss_reads_bf16_joints_and_int64_labels():
    acts, labels, T, U = joint_batch(3)
    want, want_grad = loss_and_grad(ReferenceLoss(0), acts.bfloat16().float(), labels, T, U)
    got, got_grad = loss_and_grad(RNNTLoss(0, 0.0), acts.bfloat16(), labels.long(), T.long(), U.long())
    assert got.dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad.float(), want_grad, rtol=1e-2, atol=2e-3)
    torch.testing.assert_close(
        rnnt_loss(acts, labels, T, U, reduction="sum"), RNNTLoss(0, reduction="sum")(acts, labels, T, U)
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_multiblank_loss_equals_the_reference(reduction):
    """ESPnet's layout: the big blanks just before the blank, big blank i in column blank - 1 - i."""
    acts, labels, T, U = joint_batch(4)
    blank = len(BIG_BLANKS)
    labels = labels.clamp(min=blank + 1)
    loss = MultiblankRNNTLoss(blank, BIG_BLANKS, reduction, sigma=0.05)
    got, got_grad = loss_and_grad(loss, acts, labels, T, U)
    want, want_grad = loss_and_grad(
        ReferenceLoss(blank, reduction, big_blank_durations=BIG_BLANKS, sigma=0.05), acts, labels, T, U
    )
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)
    # FastEmit: the loss returned times 1 + lambda, as ESPnet's numba loss returns it
    scaled = MultiblankRNNTLoss(blank, BIG_BLANKS, reduction, fastemit_lambda=0.5, sigma=0.05)(acts, labels, T, U)
    torch.testing.assert_close(scaled, 1.5 * got.detach(), rtol=1e-5, atol=1e-5)


def test_losses_refuse_what_warp_transducer_would_not_take():
    with pytest.raises(ValueError, match=r"reduction: expected one of 'mean', 'sum', 'none'"):
        RNNTLoss(reduction="mean_batch")
    with pytest.raises(TypeError, match="blank: expected an int"):
        RNNTLoss(blank=0.0)
    with pytest.raises(ValueError, match="reduction: expected one of"):
        MultiblankRNNTLoss(2, BIG_BLANKS, reduction=None)
    # what the losses refuse is refused, not converted (an int() would make 2.9 a big blank of 2)
    with pytest.raises(ValueError, match=r"big_blank_durations: expected a sequence of ints, got \[2.9\]"):
        MultiblankRNNTLoss(4, [2.9])
    with pytest.raises(ValueError, match="big_blank_durations: 2 big blanks .* the blank's column 1"):
        MultiblankRNNTLoss(1, [2, 3])
    with pytest.raises(TypeError, match="clamp: expected a number, got bool True"):
        MultiblankRNNTLoss(4, [2], clamp=True)
    with pytest.raises(TypeError, match="fastemit_lambda: expected a number, got str '0.1'"):
        MultiblankRNNTLoss(4, [2], fastemit_lambda="0.1")
    with pytest.raises(TypeError, match="sigma: expected a number, got str '0.05'"):
        MultiblankRNNTLoss(4, [2], sigma="0.05")
    with pytest.raises(TypeError, match="fastemit_lambda: expected a number, got str '0.1'"):
        RNNTLoss(fastemit_lambda="0.1")
    with pytest.raises(ValueError, match=r"fastemit_lambda: expected a number in \[0, 65503\]"):
        RNNTLoss(fastemit_lambda=-0.1)
    loss = MultiblankRNNTLoss(4, [2, 3], clamp=1, sigma=0)
    assert (loss.big_blank_durations, loss.clamp, loss.sigma) == ((2, 3), 1.0, 0.0)


def asr_model(big_blank_durations=(), activation="tanh", **model_conf):
    """An ESPnetASRModel with a transducer decoder, as ASRTask.build_model builds it from a scaled-down copy of the
    LibriSpeech conformer RNN-T recipe's config (egs2/librispeech/asr1/conf/tuning/transducer/
    train_conformer-rnn_transducer.yaml; with big blanks, its multi_blank twin: the big blanks' tokens inserted
    before the blank, no CTC)."""
    tokens = list(TOKENS)
    for duration in big_blank_durations:
        tokens.insert(tokens.index("<blank>"), f"<blank{duration}>")
    V = len(tokens)
    encoder = ConformerEncoder(
        FEATURES,
        output_size=16,
        attention_heads=2,
        linear_units=32,
        num_blocks=1,
        dropout_rate=0.1,
        positional_dropout_rate=0.1,
        attention_dropout_rate=0.1,
        input_layer="conv2d",
        normalize_before=True,
        macaron_style=True,
        rel_pos_type="latest",
        pos_enc_layer_type="rel_pos",
        selfattention_layer_type="rel_selfattn",
        activation_type="swish",
        use_cnn_module=True,
        cnn_module_kernel=3,
    )
    decoder = TransducerDecoder(
        V, embed_pad=0, rnn_type="lstm", num_layers=1, hidden_size=16, dropout=0.1, dropout_embed=0.2
    )
    joint = JointNetwork(
        V, encoder.output_size(), decoder.dunits, joint_space_size=20, joint_activation_type=activation
    )
    conf = dict(ctc_weight=0.3, report_cer=False, report_wer=False)
    if big_blank_durations:
        conf.update(
            ctc_weight=0.0,
            transducer_multi_blank_durations=list(big_blank_durations),
            transducer_multi_blank_sigma=0.05,
        )
    conf.update(model_conf)
    return ESPnetASRModel(
        vocab_size=V,
        token_list=tokens,
        frontend=None,
        specaug=None,
        normalize=None,
        preencoder=None,
        encoder=encoder,
        postencoder=None,
        decoder=decoder,
        ctc=CTC(odim=V, encoder_output_size=16),
        joint_network=joint,
        **conf,
    )


def transducer_model(activation="tanh", decoder="rnn", **model_conf):
    """An ESPnetASRTransducerModel, as ASRTransducerTask.build_model builds it from a scaled-down copy of the
    LibriSpeech-100 conformer transducer recipe's config (egs2/librispeech_100/asr1/conf/tuning/transducer/
    train_conformer-rnn_transducer.yaml, in ESPnet 202511's argument names); ``decoder="stateless"``: ESPnet's
    stateless decoder (an embedding) in place of the LSTM."""
    V = len(TOKENS)
    encoder = Encoder(
        FEATURES,
        body_conf=[
            dict(
                block_type="conformer",
                linear_size=32,
                hidden_size=16,
                heads=2,
                conv_mod_kernel_size=3,
                num_blocks=1,
                dropout_rate=0.1,
                pos_wise_dropout_rate=0.1,
                att_dropout_rate=0.1,
            )
        ],
        input_conf=dict(block_type="conv2d"),
        main_conf=dict(pos_wise_act_type="swish", conv_mod_act_type="swish"),
    )
    if decoder == "rnn":
        decoder = RNNDecoder(
            V, embed_size=16, hidden_size=16, rnn_type="lstm", num_layers=1, dropout_rate=0.1, embed_dropout_rate=0.2
        )
    else:
        decoder = StatelessDecoder(V, embed_size=16, embed_dropout_rate=0.2)
    joint = JointNetwork(
        V, encoder.output_size, decoder.output_size, joint_space_size=20, joint_activation_type=activation
    )
    conf = dict(
        transducer_weight=1.0,
        auxiliary_ctc_weight=0.3,
        auxiliary_lm_loss_weight=0.2,
        report_cer=False,
        report_wer=False,
    )
    conf.update(model_conf)
    return ESPnetASRTransducerModel(V, TOKENS, None, None, None, encoder, decoder, joint, **conf)


def batch(model):
    """Features (B, S, FEATURES) and padded labels (-1) as ESPnet's collate gives them: 9, 7, 5 and 3 encoder frames
    (conv2d subsampling), an utterance without labels; labels are the model's tokens after <unk> and before
    <sos/eos>."""
    tokens = model.token_list
    gen = torch.Generator().manual_seed(0)
    speech_lengths = torch.tensor([40, 33, 25, 17])
    text_lengths = torch.tensor([5, 3, 0, 2])
    speech = torch.randn(4, 40, FEATURES, generator=gen)
    text = torch.randint(tokens.index("<unk>") + 1, len(tokens) - 1, (4, 5), generator=gen)
    text[torch.arange(5) >= text_lengths[:, None]] = -1
    return speech, speech_lengths, text, text_lengths


def training_step(model, data, seed=0):
    """The model's loss, every parameter's gradient and its statistics after one forward and backward."""
    torch.manual_seed(seed)
    model.train()
    model.zero_grad()
    loss, stats, _ = model(*(t.clone() for t in data))
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}, stats


def with_criterion(model, criterion):
    witness = copy.deepcopy(model)
    witness.criterion_transducer = criterion
    return witness


def assert_steps_equal(got, want, rtol=1e-5):
    (loss, grads, stats), (want_loss, want_grads, want_stats) = got, want
    assert loss.shape == want_loss.shape == (1,)
    torch.testing.assert_close(loss, want_loss, rtol=rtol, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-3, atol=2e-5, msg=name)
    assert stats.keys() == want_stats.keys()


MODELS = {
    "rnnt": lambda **kw: asr_model(**kw),
    "multiblank": lambda **kw: asr_model(BIG_BLANKS, **kw),
    "transducer": lambda **kw: transducer_model(fastemit_lambda=0.1, **kw),
    "transducer_stateless": lambda **kw: transducer_model(decoder="stateless", fastemit_lambda=0.1, **kw),
}


def reference_criterion(kind):
    """The float64 reference with the model's own loss options (blank 0, or after the big blanks)."""
    return {
        "rnnt": ReferenceLoss(0),
        "multiblank": ReferenceLoss(2, big_blank_durations=BIG_BLANKS, sigma=0.05),
        "transducer": ReferenceLoss(0, fastemit_lambda=0.1),
        "transducer_stateless": ReferenceLoss(0, fastemit_lambda=0.1),
    }[kind]


def test_install_is_what_espnet_imports():
    """Without warp-transducer ESPnetASRModel cannot be built and ESPnetASRTransducerModel exits on its first step;
    after install() both build and train on RNNTLoss, with ESPnet's own arguments."""
    del sys.modules["warprnnt_pytorch"]
    if importlib.util.find_spec("warprnnt_pytorch") is None:
        with pytest.raises(ModuleNotFoundError, match="warprnnt_pytorch"):
            asr_model()
        model = transducer_model()
        with pytest.raises(SystemExit):
            training_step(model, batch(model))
    assert install() is integration
    import warprnnt_pytorch

    assert warprnnt_pytorch.RNNTLoss is RNNTLoss
    model = asr_model()
    assert isinstance(model.criterion_transducer, RNNTLoss)
    assert (model.criterion_transducer.blank, model.criterion_transducer.fastemit_lambda) == (0, 0.0)
    model = transducer_model(fastemit_lambda=0.1)
    training_step(model, batch(model))
    assert isinstance(model.criterion_transducer, RNNTLoss) and model.criterion_transducer.fastemit_lambda == 0.1


@pytest.mark.parametrize("kind", ["rnnt", "transducer"])
def test_installed_step_equals_the_reference_and_torchaudio(kind):
    """ESPnet's own step with install()'s loss: its loss and every parameter's gradient equal the same step with the
    float64 reference and torchaudio's loss on ESPnet's joint output; no parameter's gradient is zero."""
    torch.manual_seed(0)
    model = MODELS[kind]() if kind == "rnnt" else transducer_model()
    data = batch(model)
    witnesses = [with_criterion(model, ReferenceLoss(0)), with_criterion(model, TorchaudioLoss(0))]
    got = training_step(model, data)
    for witness in witnesses:
        assert_steps_equal(got, training_step(witness, data))
    _, grads, _ = got
    assert grads.keys() == {name for name, _ in model.named_parameters()}
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name


@pytest.mark.parametrize(
    "kind,activation,fused",
    [
        *[(kind, "tanh", fused) for kind in ("rnnt", "multiblank", "transducer") for fused in (True, False)],
        ("rnnt", "relu", True),
        ("transducer", "swish", True),
        ("transducer_stateless", "identity", True),
    ],
)
def test_applied_step_equals_the_reference_step(kind, activation, fused):
    """apply(model, fused): the step's loss and every parameter's gradient equal ESPnet's step with the float64
    reference on its own joint output (multi-blank: ESPnet's numba loss runs on CUDA only)."""
    torch.manual_seed(0)
    model = MODELS[kind](activation=activation)
    data = batch(model)
    want = training_step(with_criterion(model, reference_criterion(kind)), data)
    apply(model, fused=fused)
    criterion = model.criterion_transducer
    if kind == "multiblank":
        assert isinstance(criterion, MultiblankRNNTLoss)
        assert (criterion.blank, criterion.big_blank_durations, criterion.sigma) == (2, tuple(BIG_BLANKS), 0.05)
    else:
        assert isinstance(criterion, RNNTLoss) and criterion.reduction == "mean"
    method = "forward" if kind.startswith("transducer") else "_calc_transducer_loss"
    assert (method in model.__dict__) == fused
    got = training_step(model, data)
    assert_steps_equal(got, want)
    for name, grad in got[1].items():
        assert grad.abs().max() > 0, name


def test_applied_model_saves_and_loads_fused():
    """torch.save of a whole applied model loads with its fused step bound to the loaded model: the same step."""
    import io

    for model, method in ((asr_model(), "_calc_transducer_loss"), (transducer_model(), "forward")):
        apply(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert method in loaded.__dict__ and getattr(loaded, method).__self__ is loaded
        assert_steps_equal(training_step(loaded, batch(loaded)), training_step(model, batch(model)), rtol=0)


def test_fused_step_builds_no_joint():
    """With fused the joint network's forward (the (B, T, U+1, V) grid) never runs in training."""
    for model in (asr_model(), transducer_model()):
        calls = []
        model.joint_network.register_forward_hook(lambda *args: calls.append(1))
        training_step(apply(model, fused=False), batch(model))
        assert calls
        calls.clear()
        training_step(apply(model), batch(model))
        assert not calls


def lstm_refuses_bf16_autocast():
    """Why this CPU cannot run ESPnet's LSTM decoder under bf16 autocast, or None."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.LSTM(4, 4, batch_first=True)(torch.randn(1, 2, 4))
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", ["rnnt", "transducer", "transducer_stateless"])
def test_bf16_autocast_step_near_the_reference(kind, fused):
    """Under bf16 autocast ESPnet's joint output is bf16 (ESPnetASRTransducerModel copies it to float32 for its
    loss); this library reads it as it is, or fuses it: the loss and gradients agree to bf16's precision. The
    stateless decoder has no LSTM, which some CPUs refuse under bf16 autocast."""
    reason = lstm_refuses_bf16_autocast()
    if reason and kind != "transducer_stateless":
        pytest.skip(f"this CPU runs no bf16 LSTM under autocast: {reason}")
    torch.manual_seed(0)
    model = MODELS[kind]()
    data = batch(model)
    with torch.autocast("cpu", dtype=torch.bfloat16), float32_convs():  # some CPUs' bf16 Conv2d errs (tests/_cpu.py)
        want_loss, want_grads, _ = training_step(with_criterion(model, reference_criterion(kind)), data)
        loss, grads, _ = training_step(apply(model, fused=fused), data)
    torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=0)
    assert grads.keys() == want_grads.keys()
    got, want = (torch.cat([g[name].float().flatten() for name in sorted(g)]) for g in (grads, want_grads))
    assert (got - want).norm() < 3e-2 * want.norm()
    for name in ("joint_network.lin_out.weight", "joint_network.lin_enc.weight", "joint_network.lin_dec.weight"):
        assert (grads[name] - want_grads[name]).norm() < 3e-2 * want_grads[name].norm(), name


@pytest.mark.parametrize("kind", ["rnnt", "transducer"])
def test_validation_and_decoding_unchanged(kind):
    """In eval mode the fused step gives ESPnet's loss and error rates; beam search finds the same hypotheses."""
    torch.manual_seed(0)
    conf = dict(report_cer=True, report_wer=True)
    model = asr_model(**conf) if kind == "rnnt" else transducer_model(**conf)
    data = batch(model)
    witness = with_criterion(model, ReferenceLoss(0))
    apply(model)
    for m in (model, witness):
        m.eval()
    with torch.no_grad():
        loss, stats, _ = model(*(t.clone() for t in data))
        want_loss, want_stats, _ = witness(*(t.clone() for t in data))
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
        assert stats.keys() == want_stats.keys()
        for key in ("cer_transducer", "wer_transducer"):
            assert stats[key] is not None and float(stats[key]) == float(want_stats[key]), key
        if kind == "rnnt":
            from espnet2.asr.transducer.beam_search_transducer import BeamSearchTransducer
        else:
            from espnet2.asr_transducer.beam_search_transducer import BeamSearchTransducer
        encoder_out, _ = model.encode(data[0][:1], data[1][:1])
        hyps = [BeamSearchTransducer(m.decoder, m.joint_network, beam_size=2)(encoder_out[0]) for m in (model, witness)]
        assert [h.yseq for h in hyps[0]] == [h.yseq for h in hyps[1]]


def test_apply_twice_and_undo():
    torch.manual_seed(0)
    model = asr_model()
    data = batch(model)
    want = training_step(with_criterion(model, ReferenceLoss(0)), data)
    apply(apply(model))
    assert "_calc_transducer_loss" in model.__dict__
    apply(model, fused=False)
    assert "_calc_transducer_loss" not in model.__dict__ and isinstance(model.criterion_transducer, RNNTLoss)
    assert_steps_equal(training_step(model, data), want)


def test_a_criterion_espnet_built_with_warp_transducer_is_taken_with_its_options():
    model = asr_model()
    warp = type("RNNTLoss", (torch.nn.Module,), {"__module__": "warprnnt_pytorch"})()
    warp.blank, warp.reduction, warp.fastemit_lambda = 0, "sum", 0.2
    model.criterion_transducer = warp
    apply(model)
    criterion = model.criterion_transducer
    assert isinstance(criterion, RNNTLoss)
    assert (criterion.blank, criterion.reduction, criterion.fastemit_lambda) == (0, "sum", 0.2)


def test_apply_refuses():
    with pytest.raises(TypeError, match="model: expected an ESPnet ESPnetASRModel"):
        apply(torch.nn.Linear(2, 2))
    ctc_only = ESPnetASRModel(
        vocab_size=len(TOKENS),
        token_list=TOKENS,
        frontend=None,
        specaug=None,
        normalize=None,
        preencoder=None,
        encoder=None,
        postencoder=None,
        decoder=None,
        ctc=CTC(odim=len(TOKENS), encoder_output_size=16),
        joint_network=None,
        ctc_weight=1.0,
    )
    with pytest.raises(ValueError, match="has no transducer decoder"):
        apply(ctc_only)
    with pytest.raises(ValueError, match="use_k2_pruned_loss: the model trains on k2's pruned loss"):
        apply(transducer_model(use_k2_pruned_loss=True))
    for activation in ("selu", "mish", "hardtanh", "leaky_relu"):
        model = asr_model(activation=activation)
        name = type(model.joint_network.joint_activation).__name__
        with pytest.raises(ValueError, match=rf"(?s)model.joint_network: the activation {name}\(.*\) has no fused"):
            apply(model)
        apply(model, fused=False)  # ESPnet's joint, this library's loss
        assert isinstance(model.criterion_transducer, RNNTLoss) and "_calc_transducer_loss" not in model.__dict__
    model = transducer_model(activation="swish")
    model.joint_network.joint_activation.beta = 2.0
    with pytest.raises(ValueError, match=r"(?s)activation Swish\(.*\) has no fused counterpart"):
        apply(model)
    model = asr_model()
    model.joint_network = torch.nn.Bilinear(16, 16, len(TOKENS))
    with pytest.raises(ValueError, match="model.joint_network: Bilinear is not ESPnet's JointNetwork"):
        apply(model)
    model = asr_model()
    model.__class__ = type("MyModel", (ESPnetASRModel,), {"_calc_transducer_loss": lambda self, *a: None})
    with pytest.raises(ValueError, match="MyModel has its own _calc_transducer_loss"):
        apply(model)
    model = asr_model()
    model.criterion_transducer = torch.nn.MSELoss()
    with pytest.raises(ValueError, match="model.criterion_transducer: MSELoss has no counterpart"):
        apply(model)
