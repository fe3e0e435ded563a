"""transducer.integrations.transformers against transformers' own Parakeet losses and models: every reduction of
the RNN-T and TDT losses (durations with and without 0, 16-bit scores, T_b = 1 and U_b = 0 utterances); both
models, fused and not, in float32 and under bf16 autocast: the loss and every parameter's gradient; decoding,
gradient checkpointing, DDP, return_dict=False; refused models and activations."""

import copy
import sys
import types

import pytest
import torch
from _batches import DEVICES, random_batch
from _cpu import autocast_lstms
from _imports import require

from transducer import tdt_loss_reference, transducer_loss_reference
from transducer.integrations.transformers import ParakeetForRNNTLoss, ParakeetForTDTLoss, apply

transformers = require("transformers", "test")
require("torchaudio", "test")  # transformers' RNN-T loss, the witness here, is torchaudio's
from transformers.loss.loss_rnnt import ParakeetForRNNTLoss as hf_rnnt_loss  # noqa: E402
from transformers.loss.loss_tdt import ParakeetForTDTLoss as hf_tdt_loss  # noqa: E402

REDUCTIONS = ["mean_volume", "mean_batch", "mean", "sum", "none"]
DURATIONS = {"tdt": [0, 1, 2, 3, 4], "tdt_no0": [1, 2, 4]}


def reduce(losses, lengths, reduction):
    """transformers' reductions, written out (NeMo's formulas)."""
    lengths = lengths.float()
    return {
        "mean_volume": lambda: losses.sum() / lengths.sum(),
        "mean_batch": losses.mean,
        "mean": lambda: (losses / lengths).mean(),
        "sum": losses.sum,
        "none": lambda: losses,
    }[reduction]()


def scores_batch(seed, V, D=0, B=5, max_t=6, max_u=4):
    """random_batch's padded (B, maxT, maxU+1, V + D) scores in float32, with labels as transformers gives them:
    avoiding 0 and V - 1 (the blanks tested), padded with V - 1; lengths with T_b = 1 (utterance 1) and U_b = 0
    (utterance 2), the others at least 2 and 1; torchaudio wants maxT = max T_b and maxU = max U_b."""
    gen = torch.Generator().manual_seed(seed)
    logits, labels, T, U = random_batch(
        gen, B, max_t, max_u, V, (0, V - 1), dtype=torch.float32, scale=2.0, min_t=2, min_u=1, edges=True, extra=D
    )
    labels[torch.arange(max_u) >= U[:, None]] = V - 1
    return logits, labels, T, U


def grad_of(loss, x):
    return torch.autograd.grad(loss.sum(), x)[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blank", [-1, 39, 0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_rnnt_loss_matches_transformers(device, blank, reduction):
    logits, labels, T, U = scores_batch(1, V=40)
    # transformers' loss on the CPU: torchaudio's CUDA loss is wrong for T_b = 1 and U_b = 0.
    x = logits.clone().requires_grad_()
    want = hf_rnnt_loss(x, labels, T, U, blank, reduction=reduction)
    y = logits.to(device).requires_grad_()
    got = ParakeetForRNNTLoss(y, labels.to(device), T.to(device), U.to(device), blank, reduction=reduction)
    assert got.dtype == torch.float32 and got.shape == want.shape
    if reduction == "mean":  # U_b = 0 divides by 0, in transformers' formula and so in ours
        assert not torch.isfinite(want) and not torch.isfinite(got)
        keep = U > 0
        x, y = logits[keep].clone().requires_grad_(), logits[keep].to(device).requires_grad_()
        want = hf_rnnt_loss(x, labels[keep], T[keep], U[keep], blank, reduction=reduction)
        got = ParakeetForRNNTLoss(y, labels[keep].to(device), T[keep], U[keep], blank, reduction=reduction)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_of(got, y).cpu(), grad_of(want, x), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_rnnt_loss_matches_reference_float64(device):
    logits, labels, T, U = scores_batch(2, V=40)
    x = logits.double().requires_grad_()
    want = transducer_loss_reference(x, labels, T, U, blank=39)
    y = logits.double().to(device).requires_grad_()
    got = ParakeetForRNNTLoss(y, labels, T, U, 39, reduction="none")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad_of(got * U.to(device), y).cpu(), grad_of(want * U, x), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("durations", DURATIONS.values(), ids=DURATIONS.keys())
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_tdt_loss_matches_transformers_and_reference(device, durations, reduction):
    V, D = 40, len(durations)
    logits, labels, T, U = scores_batch(3, V=V, D=D)
    if 0 not in durations:  # every label takes a frame: keep each utterance feasible
        T = torch.maximum(T, U + 1)
        logits = torch.cat([logits, logits], 1)[:, : int(T.max())]
    blank, sigma = V - 1, 0.05
    if reduction == "mean":  # transformers divides by U_b: U_b = 0 gives inf, in its formula and so in ours
        z = logits.to(device)
        got = ParakeetForTDTLoss(z[..., :V], z[..., V:], labels, T, U, blank, durations, sigma, reduction=reduction)
        assert got.isinf()
        U[2], labels[2, 0] = 1, 5
    x = logits.clone().requires_grad_()
    want = hf_tdt_loss(x[..., :V], x[..., V:], labels, T, U, blank, durations, sigma, reduction=reduction)
    want_grad = grad_of(want, x)
    # the float64 reference, reduced by transformers' formula
    r = logits.double().requires_grad_()
    ref = reduce(tdt_loss_reference(r, labels, T, U, durations, blank, sigma), U, reduction)
    ref_grad = grad_of(ref, r)
    # the two heads as column slices of one joint output, read in place
    z = logits.to(device).requires_grad_()
    got = ParakeetForTDTLoss(
        z[..., :V],
        z[..., V:],
        labels.to(device),
        T.to(device),
        U.to(device),
        blank,
        durations,
        sigma,
        reduction=reduction,
    )
    got_grad = grad_of(got, z).cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.cpu().double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
    if 0 in durations:  # transformers' gradient is NaN without a zero duration
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)


def test_tdt_options_refused_as_tdt_loss_refuses_them():
    """Float durations (which an int() would truncate to other durations) and a string sigma are refused, not
    converted; the error names the argument."""
    V = 40
    logits, labels, T, U = scores_batch(3, V=V, D=3)
    tokens, durations = logits[..., :V], logits[..., V:]
    with pytest.raises(ValueError, match=r"durations: expected a sequence of ints, got \[0, 1.7, 2.2\]"):
        ParakeetForTDTLoss(tokens, durations, labels, T, U, V - 1, [0, 1.7, 2.2])
    with pytest.raises(ValueError, match=r"durations: expected a sequence of ints, got \[0, True, 2\]"):
        ParakeetForTDTLoss(tokens, durations, labels, T, U, V - 1, [0, True, 2])
    with pytest.raises(TypeError, match="sigma: expected a number, got str '0.1'"):
        ParakeetForTDTLoss(tokens, durations, labels, T, U, V - 1, [0, 1, 2], sigma="0.1")
    # the same durations as ints give the loss
    assert ParakeetForTDTLoss(tokens, durations, labels, T, U, V - 1, [0, 1, 2], reduction="sum").isfinite()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["rnnt", "tdt"])
def test_16bit_scores(device, dtype, kind):
    """16-bit scores are read as they are: transformers' float32 copy of them gives the same loss."""
    V = 40
    D = len(DURATIONS["tdt"]) if kind == "tdt" else 0
    logits, labels, T, U = scores_batch(4, V=V, D=D)
    logits = logits.to(dtype)
    x, z = logits.clone().requires_grad_(), logits.to(device).requires_grad_()
    if kind == "rnnt":
        want = hf_rnnt_loss(x, labels, T, U, V - 1)
        got = ParakeetForRNNTLoss(z, labels, T, U, V - 1)
    else:
        want = hf_tdt_loss(x[..., :V], x[..., V:], labels, T, U, V - 1, DURATIONS["tdt"], reduction="mean_volume")
        got = ParakeetForTDTLoss(z[..., :V], z[..., V:], labels, T, U, V - 1, DURATIONS["tdt"], reduction="mean_volume")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    got_grad, want_grad = grad_of(got, z), grad_of(want, x)
    assert got_grad.dtype == dtype
    torch.testing.assert_close(got_grad.cpu().float(), want_grad.float(), rtol=1e-2, atol=1e-3)


def test_bad_reduction():
    logits, labels, T, U = scores_batch(5, V=40, D=2)
    with pytest.raises(ValueError, match="mean_volume"):
        ParakeetForRNNTLoss(logits[..., :40], labels, T, U, 39, reduction="avg")
    with pytest.raises(ValueError, match="mean_volume"):
        ParakeetForTDTLoss(logits[..., :40], logits[..., 40:], labels, T, U, 39, [1, 2], reduction="mean_frames")


# The models: a tiny Parakeet encoder, no dropout (the runs compared must be the same function of the weights),
# weights 10x transformers' default scale (so that every part of the model gets a gradient well above rounding).
ENCODER = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    num_mel_bins=16,
    subsampling_factor=4,
    subsampling_conv_channels=8,
    conv_kernel_size=3,
    dropout=0.0,
    dropout_positions=0.0,
    layerdrop=0.0,
    activation_dropout=0.0,
    attention_dropout=0.0,
    initializer_range=0.2,
)
PAD = 2


def make_model(kind, hidden_act="relu", seed=0):
    """ParakeetForRNNT (vocabulary 48) or ParakeetForTDT (vocabulary 64, durations 0-4 or 1, 2, 4), blank last."""
    torch.manual_seed(seed)
    V = 48 if kind == "rnnt" else 64
    options = dict(
        encoder_config=ENCODER,
        vocab_size=V,
        decoder_hidden_size=32,
        num_decoder_layers=1,
        blank_token_id=V - 1,
        pad_token_id=PAD,
        hidden_act=hidden_act,
    )
    if kind == "rnnt":
        return transformers.ParakeetForRNNT(transformers.ParakeetRNNTConfig(**options))
    return transformers.ParakeetForTDT(transformers.ParakeetTDTConfig(durations=DURATIONS[kind], **options))


# Per utterance: feature frames (the encoder's 4x subsampling makes them 10, 8, 1, 5 frames) and labels.
FRAMES = [40, 29, 2, 20]
LABELS = {"rnnt": [5, 0, 3, 2], "tdt": [5, 2, 3, 1], "tdt_no0": [5, 2, 0, 4]}
# Forward options reaching the loss: without a zero duration the 1-frame utterance can have no label, and U_b = 0
# would make the default "mean" (each loss over its U_b) infinite.
OPTIONS = {"rnnt": {}, "tdt": {}, "tdt_no0": dict(reduction="sum", sigma=0.05)}


def model_batch(model, kind, seed=0):
    """input_features, attention_mask, decoder_input_ids (blank, then the labels) and labels padded as the model
    counts them: ParakeetForRNNT with blank (it counts labels != blank), ParakeetForTDT with pad_token_id."""
    config, gen = model.config, torch.Generator().manual_seed(seed)
    blank, B, S = config.blank_token_id, len(FRAMES), max(LABELS[kind])
    tokens = torch.tensor([v for v in range(config.vocab_size) if v not in (blank, PAD)])
    labels = tokens[torch.randint(0, len(tokens), (B, S), generator=gen)]
    lengths = torch.tensor(LABELS[kind])
    labels[torch.arange(S) >= lengths[:, None]] = blank if kind == "rnnt" else PAD
    counted = (labels != blank) if kind == "rnnt" else (labels != config.pad_token_id)
    assert counted.sum(-1).tolist() == LABELS[kind]
    features = torch.randn(B, max(FRAMES), ENCODER["num_mel_bins"], generator=gen)
    attention_mask = (torch.arange(max(FRAMES)) < torch.tensor(FRAMES)[:, None]).long()
    decoder_input_ids = torch.cat([torch.full((B, 1), blank), labels], 1)
    return dict(
        input_features=features, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, labels=labels
    )


def transformers_rnnt_on_cpu(logits, labels, logit_lengths, label_lengths, blank_token_id, **kwargs):
    """transformers' RNN-T loss with torchaudio's CPU loss (its CUDA loss is wrong for T_b = 1 and U_b = 0)."""
    return hf_rnnt_loss(
        logits.cpu(), labels.cpu(), logit_lengths.cpu(), label_lengths.cpu(), blank_token_id, **kwargs
    ).to(logits.device)


def reference_tdt(
    token_logits,
    duration_logits,
    labels,
    logit_lengths,
    label_lengths,
    blank_token_id,
    durations,
    sigma=0.0,
    reduction="mean",
    **kwargs,
):
    """The float64 TDT reference with transformers' reduction (its own loss gives NaN gradients without a zero
    duration)."""
    z = torch.cat([token_logits, duration_logits], -1).double()
    losses = tdt_loss_reference(z, labels, logit_lengths, label_lengths, durations, blank_token_id, sigma)
    return reduce(losses, label_lengths, reduction).float()


def witness(model, kind):
    """The unpatched model, with the right loss where transformers' own is wrong on this batch and device."""
    model = copy.deepcopy(model)
    if kind == "rnnt":
        model.loss_function = transformers_rnnt_on_cpu
    elif kind == "tdt_no0":
        model.loss_function = reference_tdt
    return model


def step(model, batch, device, autocast=False, **kwargs):
    """One forward and backward on device; the output and each parameter's gradient. Under CPU bf16 autocast the
    decoder's LSTM runs outside autocast where this CPU cannot run it there (tests/_cpu.py)."""
    model = model.to(device).train()
    batch = {k: v.to(device) for k, v in batch.items()}
    model.zero_grad()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast), autocast_lstms(model):
        out = model(**batch, **kwargs)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


# Parameters whose exact gradient is 0, so that both runs hold rounding noise alone: an attention key bias
# (softmax ignores a shift) and a convolution bias before a training-mode BatchNorm (it subtracts the batch mean).
EXACTLY_ZERO = ("self_attn.k_proj.bias", "conv.depthwise_conv.bias")


def assert_same_gradients(got, want, rtol):
    """Each parameter's gradient within rtol of its largest element; those in EXACTLY_ZERO within 1% of the largest
    gradient of all."""
    assert got.keys() == want.keys()
    largest = max(float(g.abs().max()) for g in want.values())
    for name, g in want.items():
        atol = 1e-2 * largest if name.endswith(EXACTLY_ZERO) else rtol * float(g.abs().max())
        assert atol > 0
        torch.testing.assert_close(got[name].cpu(), g.cpu(), rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("kind", ["rnnt", "tdt", "tdt_no0"])
def test_model_matches_transformers(device, autocast, fused, kind):
    """One training step after apply against the unpatched model's: the loss and every parameter's gradient."""
    model = make_model(kind)
    batch = model_batch(model, kind)
    options = OPTIONS[kind]
    want, want_grads = step(witness(model, kind), batch, device, autocast, **options)
    got, got_grads = step(apply(copy.deepcopy(model), fused=fused), batch, device, autocast, **options)
    assert got.loss.dtype == torch.float32 and torch.isfinite(got.loss)
    # bf16 autocast: rounding the logits' gradient to bf16 turns float32-level differences between two right losses
    # into differences of a few 1e-3 (up to 2e-2 in the first layer) once amplified through the encoder in bf16;
    # fp32 on CUDA: cuDNN's LSTM backward leaves up to 1.4e-4 in an element of its recurrent weights' gradient
    rtol = 5e-2 if autocast else 1e-3 if device == "cuda" else 1e-4
    torch.testing.assert_close(got.loss, want.loss, rtol=rtol / 10, atol=0)
    assert_same_gradients(got_grads, want_grads, rtol)
    assert (got.logits is None) == fused
    if not fused:
        assert torch.equal(got.logits, want.logits)
    for key in ("last_hidden_state", "pooler_output"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["rnnt", "tdt"])
def test_model_forward_options(kind):
    """reduction= and sigma= reach the loss through the forward; return_dict=False gives transformers' tuple less
    the logits."""
    model = make_model(kind)
    batch = model_batch(model, kind)
    options = dict(reduction="sum", sigma=0.1) if kind == "tdt" else dict(reduction="mean_batch")
    want, want_grads = step(witness(model, kind), batch, "cpu", **options)
    got, got_grads = step(apply(copy.deepcopy(model)), batch, "cpu", **options)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    assert_same_gradients(got_grads, want_grads, 1e-4)
    fused = apply(copy.deepcopy(model))
    as_tuple, as_dict = fused(**batch, return_dict=False), fused(**batch)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 3  # last_hidden_state, pooler_output, loss
    torch.testing.assert_close(as_tuple[2], as_dict.loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match="mean_volume"):
        fused(**batch, reduction="avg")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["rnnt", "tdt"])
def test_decoding_unchanged(device, kind):
    """generate and a forward without labels give what they gave before apply."""
    model = make_model(kind).to(device).eval()
    model.generation_config.decoder_start_token_id = model.config.blank_token_id  # the checkpoints' setting
    batch = {k: v.to(device) for k, v in model_batch(model, kind).items()}
    inputs = dict(input_features=batch["input_features"], attention_mask=batch["attention_mask"])
    with torch.no_grad():
        want = model.generate(**inputs, max_new_tokens=40)
        want_logits = model(**inputs, decoder_input_ids=batch["decoder_input_ids"]).logits
        apply(model)
        got = model.generate(**inputs, max_new_tokens=40)
        got_logits = model(**inputs, decoder_input_ids=batch["decoder_input_ids"]).logits
    assert want.sequences.shape[1] > 1
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.durations, want.durations)
    assert torch.equal(got_logits, want_logits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["rnnt", "tdt"])
def test_gradient_checkpointing(device, kind):
    model = make_model(kind)
    batch = model_batch(model, kind)
    want, want_grads = step(witness(model, kind), batch, device)
    checkpointed = apply(copy.deepcopy(model))
    # transformers 5.24 renames it activation_checkpointing_enable
    getattr(checkpointed, "activation_checkpointing_enable", checkpointed.gradient_checkpointing_enable)()
    assert sum(getattr(m, "gradient_checkpointing", False) for m in checkpointed.encoder.layers) == 2
    got, got_grads = step(checkpointed, batch, device)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    assert_same_gradients(got_grads, want_grads, 1e-3 if device == "cuda" else 1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_ddp(device, tmp_path):
    """DistributedDataParallel around the applied model (one process: gloo on the CPU, NCCL on CUDA)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = make_model("tdt")
    batch = model_batch(model, "tdt")
    want, want_grads = step(witness(model, "tdt"), batch, device)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        ddp = DistributedDataParallel(apply(copy.deepcopy(model)).to(device))
        out = ddp(**{k: v.to(device) for k, v in batch.items()})
        out.loss.backward()
    finally:
        dist.destroy_process_group()
    assert out.logits is None
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=0)
    assert_same_gradients(
        {n: p.grad for n, p in ddp.module.named_parameters()}, want_grads, 1e-3 if device == "cuda" else 1e-4
    )


@pytest.mark.parametrize("hidden_act", ["tanh", "linear", "sigmoid", "gelu", "silu", "swish", "leaky_relu"])
def test_other_activations(hidden_act):
    """The fused joint's other activations (relu, transformers' default, is in test_model_matches_transformers)."""
    model = make_model("tdt", hidden_act=hidden_act)
    batch = model_batch(model, "tdt")
    want, want_grads = step(witness(model, "tdt"), batch, "cpu")
    got, got_grads = step(apply(copy.deepcopy(model)), batch, "cpu")
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    assert_same_gradients(got_grads, want_grads, 1e-4)


def test_unfused_again_and_replaced_loss():
    """apply(model, fused=False) restores transformers' forward; a loss_function set later is the one used."""
    model = make_model("tdt")
    batch = model_batch(model, "tdt")
    apply(model)
    assert model(**batch).logits is None
    apply(model, fused=False)
    assert model.loss_function is ParakeetForTDTLoss and model(**batch).logits is not None
    apply(model)
    model.loss_function = lambda **kwargs: kwargs["token_logits"].sum() * 0 + 7.0
    out = model(**batch)
    assert float(out.loss.detach()) == 7.0 and out.logits is not None


def test_applied_model_saves_and_loads_fused():
    """torch.save of a whole applied model loads (its forward bound to the loaded model, as a method of the
    signature transformers' Trainer reads) and trains fused with the same loss; a deep copy is bound to the copy."""
    import inspect
    import io
    import types

    from transducer.integrations.transformers import _fused_forward

    model = apply(make_model("tdt"))
    batch = model_batch(model, "tdt")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (loaded, copy.deepcopy(model)):
        assert other.forward.__self__ is other and other.forward.__func__ is _fused_forward
        got, want = other(**batch), model(**batch)
        assert got.logits is None
        torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    assert inspect.signature(model.forward) == inspect.signature(types.MethodType(_fused_forward, model))
    assert "labels" in inspect.signature(model.forward).parameters
    apply(loaded, fused=False)
    assert loaded(**batch).logits is not None


def test_refused():
    """apply refuses what it cannot fuse (ValueError) and other models (TypeError)."""
    with pytest.raises(ValueError, match="'gelu_new'"):
        apply(make_model("tdt", hidden_act="gelu_new"))
    model = apply(make_model("rnnt", hidden_act="gelu_new"), fused=False)  # unfused takes any activation
    assert model.loss_function is ParakeetForRNNTLoss

    class Subclass(transformers.ParakeetForTDT):
        pass

    class OwnForward(transformers.ParakeetForTDT):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    config = make_model("tdt").config
    subclass = apply(Subclass(config))
    assert subclass.loss_function is ParakeetForTDTLoss and subclass(**model_batch(subclass, "tdt")).logits is None
    with pytest.raises(ValueError, match="OwnForward has its own forward"):
        apply(OwnForward(config))
    assert apply(OwnForward(config), fused=False).loss_function is ParakeetForTDTLoss
    model = make_model("rnnt")
    model.joint = torch.nn.Linear(2, 3)
    with pytest.raises(ValueError, match="model.joint: Linear"):
        apply(model)
    # a joint activation replaced after the config named another: the fused loss would apply the config's
    model = apply(make_model("rnnt", hidden_act="relu"))
    model.joint.activation = torch.nn.Tanh()
    with pytest.raises(ValueError, match=r"model.joint.activation: a Tanh where config.hidden_act \('relu'\)"):
        model(**model_batch(model, "rnnt"))
    ctc = transformers.ParakeetForCTC(transformers.ParakeetCTCConfig(encoder_config=ENCODER, vocab_size=40))
    with pytest.raises(TypeError, match="ParakeetForCTC"):
        apply(ctc)
    with pytest.raises(TypeError, match="Linear"):
        apply(torch.nn.Linear(2, 3))


def test_old_transformers(monkeypatch):
    """A transformers without ParakeetForRNNT: an ImportError naming the version needed."""
    old = types.ModuleType("transformers")
    old.__version__ = "5.11.0"
    monkeypatch.setitem(sys.modules, "transformers", old)
    with pytest.raises(ImportError, match=r"5\.12.*found transformers 5\.11\.0"):
        apply(torch.nn.Linear(2, 3))
