"""transducer.integrations.speechbrain against SpeechBrain itself: transducer_loss against SpeechBrain's numba loss
(run on the CPU by numba's CUDA simulator, in a subprocess: its values, and its gradients up to their known
scale), against the float64 reference applied to the joint of a tiny model built from SpeechBrain's classes and
against torchaudio's rnnt_loss (use_torchaudio), every reduction, gradcheck; fused_transducer_loss against the
unfused loss over SpeechBrain's Transducer_joint and Linear (LeakyReLU, GELU, Tanh; max_norm), every parameter's
gradient, bf16 autocast, under DistributedDataParallel; the hparams line; refused arguments."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from _imports import require

from transducer import transducer_loss_reference
from transducer.integrations.speechbrain import absolute_lengths, fused_transducer_loss, transducer_loss

require("speechbrain", "speechbrain")
from speechbrain.nnet.embedding import Embedding  # noqa: E402
from speechbrain.nnet.linear import Linear  # noqa: E402
from speechbrain.nnet.RNN import LSTM  # noqa: E402
from speechbrain.nnet.transducer.transducer_joint import Transducer_joint  # noqa: E402

REDUCTIONS = ["mean", "sum", "none"]
V, J, FEATS = 7, 6, 5  # vocabulary (blank 0), joint width, encoder input width


def tiny_model(nonlinearity=torch.nn.LeakyReLU, max_norm=None, seed=0):
    """The LibriSpeech transducer recipe's joint path from SpeechBrain's classes, tiny, in float64: proj_enc, the
    one-hot embedding, an LSTM decoder, proj_dec, Transducer_joint(joint="sum") and transducer_lin."""
    torch.manual_seed(seed)
    return torch.nn.ModuleDict(
        dict(
            proj_enc=Linear(input_size=FEATS, n_neurons=J, bias=False),
            emb=Embedding(num_embeddings=V, consider_as_one_hot=True, blank_id=0),
            dec=LSTM(input_shape=[None, None, V - 1], hidden_size=8, num_layers=1),
            proj_dec=Linear(input_size=8, n_neurons=J, bias=False),
            Tjoint=Transducer_joint(joint="sum", nonlinearity=nonlinearity),
            transducer_lin=Linear(input_size=J, n_neurons=V, bias=True, max_norm=max_norm),
        )
    ).double()


def batch(seed=1, dtype=torch.float64):
    """(feats, tokens, wav_lens, token_lens) as the recipe's batches give them: lengths relative to the padded
    lengths; T = [6, 4, 3] (4.5 rounds to 4, as torch.round rounds half to even), U = [3, 1, 0]."""
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(3, 6, FEATS, generator=gen, dtype=dtype)
    tokens = torch.randint(1, V, (3, 3), generator=gen)
    return feats, tokens, torch.tensor([1.0, 0.75, 0.5]), torch.tensor([1.0, 1 / 3, 0.0])


def encode(model, feats, tokens):
    """(x, h): the projected encoder and decoder outputs, (B, T, J) and (B, U+1, J), as the recipe computes them."""
    x = model.proj_enc(feats)
    h, _ = model.dec(model.emb(torch.nn.functional.pad(tokens, (1, 0))))
    return x, model.proj_dec(h)


def trained(model):
    """{name: parameter} of the parameters that require grad (the one-hot embedding's table does not)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def joint_logits(model, x, h):
    return model.transducer_lin(model.Tjoint(x.unsqueeze(2), h.unsqueeze(1)))


def test_lengths_rounded_as_speechbrain_rounds():
    _, tokens, wav_lens, token_lens = batch()
    assert absolute_lengths(wav_lens, 6).tolist() == [6, 4, 3]
    assert absolute_lengths(token_lens, tokens.size(1)).tolist() == [3, 1, 0]


# SpeechBrain's own loss under numba's CUDA simulator: the variable must be set before numba is imported
_NUMBA_SCRIPT = """
import sys, torch
from speechbrain.nnet.losses import transducer_loss
logits, targets, wav_lens, token_lens, weights = torch.load(sys.argv[1])
out = {}
for reduction in ("mean", "sum", "none"):
    x = logits.clone().requires_grad_()
    loss = transducer_loss(x, targets, wav_lens, token_lens, blank_index=0, reduction=reduction)
    (loss * weights if reduction == "none" else loss).sum().backward()
    out[reduction] = (loss.detach(), x.grad)
torch.save(out, sys.argv[2])
"""


def test_equals_speechbrains_numba_loss(tmp_path):
    """Values equal SpeechBrain's numba loss's (each NLL over T_b, then the reduction); its gradient is that of the
    sum of the NLLs whatever the reduction: T_b times this loss's for each utterance, and B times for "mean", the
    gradient of this loss with reduction="sum" and use_torchaudio=True."""
    if importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed (SpeechBrain's own loss needs it)")
    _, tokens, wav_lens, token_lens = batch()
    logits = torch.randn(3, 6, 4, V, generator=torch.Generator().manual_seed(2))
    weights = torch.tensor([0.5, 1.0, 2.0])
    torch.save((logits, tokens, wav_lens, token_lens, weights), tmp_path / "inputs.pt")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    subprocess.run(
        [sys.executable, "-c", _NUMBA_SCRIPT, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
        env=env,
        check=True,
        timeout=300,
    )
    theirs = torch.load(tmp_path / "out.pt")
    frames = torch.tensor([6.0, 4.0, 3.0]).view(3, 1, 1, 1)
    for reduction in REDUCTIONS:
        x = logits.clone().requires_grad_()
        loss = transducer_loss(x, tokens, wav_lens, token_lens, blank_index=0, reduction=reduction)
        (grad,) = torch.autograd.grad((loss * weights if reduction == "none" else loss).sum(), x)
        want, want_grad = theirs[reduction]
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        scale = frames * (3 if reduction == "mean" else 1)
        torch.testing.assert_close(grad * scale, want_grad, rtol=1e-4, atol=1e-6)
    # the README's way to keep the numba gradient: reduction="sum" with use_torchaudio=True
    x = logits.clone().requires_grad_()
    transducer_loss(x, tokens, wav_lens, token_lens, blank_index=0, reduction="sum", use_torchaudio=True).backward()
    torch.testing.assert_close(x.grad, theirs["mean"][1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_model_equals_the_float64_reference(reduction):
    """On a tiny model's joint: the loss and every parameter's gradient equal the float64 reference's losses over
    T_b, reduced."""
    model = tiny_model()
    feats, tokens, wav_lens, token_lens = batch()
    T, U = torch.tensor([6, 4, 3]), torch.tensor([3, 1, 0])
    weights = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    results = []
    for loss_fn in (
        lambda z: transducer_loss(z, tokens, wav_lens, token_lens, blank_index=0, reduction=reduction),
        lambda z: reduced(transducer_loss_reference(z, tokens, T, U) / T, reduction),
    ):
        loss = loss_fn(joint_logits(model, *encode(model, feats, tokens)))
        results.append(
            (
                loss.detach(),
                torch.autograd.grad(
                    (loss * weights if reduction == "none" else loss).sum(), list(trained(model).values())
                ),
            )
        )
    (got, got_grads), (want, want_grads) = results
    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def reduced(losses, reduction):
    return {"mean": losses.mean, "sum": losses.sum, "none": lambda: losses}[reduction]()


@pytest.mark.parametrize("use_torchaudio", [False, True])
def test_gradcheck(use_torchaudio):
    """The gradient is that of the returned value (not SpeechBrain's numba gradient), for every reduction."""
    logits = torch.randn(
        2, 3, 3, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64, requires_grad=True
    )
    tokens, wav_lens, token_lens = torch.tensor([[1, 2], [3, 0]]), torch.tensor([1.0, 2 / 3]), torch.tensor([1.0, 0.5])
    for reduction in REDUCTIONS:
        assert torch.autograd.gradcheck(
            lambda z: transducer_loss(z, tokens, wav_lens, token_lens, 0, reduction, use_torchaudio),
            (logits,),
            eps=1e-6,
            atol=1e-7,
            rtol=1e-5,
        )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_use_torchaudio_equals_torchaudio(reduction):
    """use_torchaudio=True: torchaudio's rnnt_loss on the rounded lengths, as SpeechBrain called it."""
    rnnt_loss = require("torchaudio.functional", "test").rnnt_loss
    _, tokens, wav_lens, token_lens = batch()
    logits = torch.randn(3, 6, 4, V, generator=torch.Generator().manual_seed(4), requires_grad=True)
    weights = torch.tensor([0.5, 1.0, 2.0])
    got = transducer_loss(logits, tokens, wav_lens, token_lens, blank_index=0, reduction=reduction, use_torchaudio=True)
    want = rnnt_loss(
        logits,
        tokens.int(),
        absolute_lengths(wav_lens, 6),
        absolute_lengths(token_lens, 3),
        blank=0,
        reduction=reduction,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grads = [torch.autograd.grad((x * weights if reduction == "none" else x).sum(), logits)[0] for x in (got, want)]
    torch.testing.assert_close(*grads, rtol=1e-4, atol=1e-6)


FUSED_CASES = [  # nonlinearity, max_norm, reduction, use_torchaudio
    (torch.nn.LeakyReLU, None, "mean", False),
    (torch.nn.GELU, None, "sum", False),
    (torch.nn.Tanh, 0.5, "none", False),
    (torch.nn.LeakyReLU, None, "mean", True),
]


@pytest.mark.parametrize("case", range(len(FUSED_CASES)))
def test_fused_equals_unfused(case):
    """fused_transducer_loss(x, h, Tjoint, transducer_lin, ...) against transducer_loss over the model's joint: the
    loss and every parameter's gradient, in float64."""
    nonlinearity, max_norm, reduction, use_torchaudio = FUSED_CASES[case]
    feats, tokens, wav_lens, token_lens = batch()
    weights = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    results = []
    for fused in (True, False):
        model = tiny_model(nonlinearity, max_norm)
        x, h = encode(model, feats, tokens)
        options = dict(blank_index=0, reduction=reduction, use_torchaudio=use_torchaudio)
        if fused:
            loss = fused_transducer_loss(
                x, h, model.Tjoint, model.transducer_lin, tokens, wav_lens, token_lens, **options
            )
        else:
            loss = transducer_loss(joint_logits(model, x, h), tokens, wav_lens, token_lens, **options)
        (loss * weights if reduction == "none" else loss).sum().backward()
        results.append((loss.detach(), {n: p.grad for n, p in trained(model).items()}, model))
    (got, got_grads, fused_model), (want, want_grads, _) = results
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        assert want_grads[name].abs().sum() > 0, name
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-9, atol=1e-12, msg=name)
    if max_norm:  # renormed in place, as SpeechBrain's Linear's forward renorms it
        assert fused_model.transducer_lin.w.weight.norm(dim=1).max() <= max_norm + 1e-9


@pytest.mark.parametrize("nonlinearity", [torch.nn.LeakyReLU, torch.nn.GELU])
def test_bf16_autocast_within_the_unfused_bound(nonlinearity):
    """The joint and the loss under CPU bf16 autocast: the fused loss and every gradient are off the float32 ones by
    at most twice what the unfused bf16 path is (plus 1e-3 of the scale)."""
    feats, tokens, wav_lens, token_lens = batch(dtype=torch.float32)

    def run(fused, autocast):
        model = tiny_model(nonlinearity).float()
        x, h = encode(model, feats, tokens)  # oneDNN's bf16 LSTM needs AVX-512 on a CPU: the joint and loss only
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if fused:
                loss = fused_transducer_loss(
                    x, h, model.Tjoint, model.transducer_lin, tokens, wav_lens, token_lens, blank_index=0
                )
            else:
                loss = transducer_loss(joint_logits(model, x, h), tokens, wav_lens, token_lens, blank_index=0)
        assert loss.dtype == torch.float32
        return loss.detach().double(), [g.double() for g in torch.autograd.grad(loss, list(trained(model).values()))]

    ref_loss, ref_grads = run(False, False)
    un_loss, un_grads = run(False, True)
    fu_loss, fu_grads = run(True, True)
    assert abs(fu_loss - ref_loss) <= 2 * abs(un_loss - ref_loss) + 1e-3 * abs(ref_loss)
    for fu, un, ref in zip(fu_grads, un_grads, ref_grads):
        assert (fu - ref).abs().max() <= 2 * (un - ref).abs().max() + 1e-3 * ref.abs().max()


def test_hparams_name():
    """The hparams line: !name: gives transducer_loss with the hparams' arguments bound."""
    from hyperpyyaml import load_hyperpyyaml

    hparams = load_hyperpyyaml(
        "blank_index: 0\n"
        "transducer_cost: !name:transducer.integrations.speechbrain.transducer_loss\n"
        "   blank_index: !ref <blank_index>\n"
    )
    _, tokens, wav_lens, token_lens = batch()
    logits = torch.randn(3, 6, 4, V, generator=torch.Generator().manual_seed(5))
    assert torch.equal(
        hparams["transducer_cost"](logits, tokens, wav_lens, token_lens),
        transducer_loss(logits, tokens, wav_lens, token_lens, 0),
    )


def _ddp_process(rank, port, path):
    """One process of test_fused_under_distributed_data_parallel: its gradient of transducer_lin's weight with
    find_unused_parameters False and True."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    grads = []
    for find_unused in (False, True):
        model = tiny_model()
        lin = torch.nn.parallel.DistributedDataParallel(model.transducer_lin, find_unused_parameters=find_unused)
        feats, tokens, wav_lens, token_lens = batch(seed=10 + rank)
        x, h = encode(model, feats, tokens)
        fused_transducer_loss(x, h, model.Tjoint, lin, tokens, wav_lens, token_lens, blank_index=0).backward()
        grads.append(model.transducer_lin.w.weight.grad)
    torch.save(grads, path)
    dist.destroy_process_group()


def test_fused_under_distributed_data_parallel(tmp_path):
    """transducer_lin wrapped in DistributedDataParallel (as SpeechBrain's Brain wraps it; 2 processes forked,
    gloo): its weight's gradient is the mean of the processes' gradients, with and without
    find_unused_parameters."""
    import multiprocessing

    port = 29500 + os.getpid() % 1000
    context = multiprocessing.get_context("fork")  # the imports are done: a process starts at once
    ranks = [context.Process(target=_ddp_process, args=(rank, port, tmp_path / f"{rank}.pt")) for rank in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
    assert [p.exitcode for p in ranks] == [0, 0]
    alone = []  # each process's gradient without DistributedDataParallel
    for rank in range(2):
        model = tiny_model()
        feats, tokens, wav_lens, token_lens = batch(seed=10 + rank)
        x, h = encode(model, feats, tokens)
        fused_transducer_loss(
            x, h, model.Tjoint, model.transducer_lin, tokens, wav_lens, token_lens, blank_index=0
        ).backward()
        alone.append(model.transducer_lin.w.weight.grad)
    assert (alone[0] - alone[1]).abs().max() > 1e-3
    for rank in range(2):
        for grad in torch.load(tmp_path / f"{rank}.pt"):  # find_unused_parameters False, True
            torch.testing.assert_close(grad, (alone[0] + alone[1]) / 2, rtol=1e-9, atol=1e-12)


def test_refused():
    model = tiny_model()
    feats, tokens, wav_lens, token_lens = batch()
    x, h = encode(model, feats, tokens)
    logits = joint_logits(model, x, h)
    lin = model.transducer_lin

    def fused(joint=model.Tjoint, output=lin, **kwargs):
        return fused_transducer_loss(x, h, joint, output, tokens, wav_lens, token_lens, 0, **kwargs)

    with pytest.raises(ValueError, match="reduction: expected one of 'mean', 'sum', 'none'"):
        transducer_loss(logits, tokens, wav_lens, token_lens, 0, reduction="batchmean")
    with pytest.raises(TypeError, match="input_lens: expected dtype"):
        transducer_loss(logits, tokens, torch.tensor([6, 4, 3]), token_lens, 0)
    with pytest.raises(ValueError, match=r"target_lens: expected lengths relative .* got values in \[0.0, 3.0\]"):
        transducer_loss(logits, tokens, wav_lens, torch.tensor([3.0, 1.0, 0.0]), 0)
    with pytest.raises(ValueError, match=r"input_lens: expected shape \(3,\)"):
        transducer_loss(logits, tokens, wav_lens[:2], token_lens, 0)
    short = torch.tensor([1.0, 0.5, 0.5 / logits.size(1)])  # rounds to 0 frames
    for call in (
        lambda: transducer_loss(logits, tokens, short, token_lens, 0),
        lambda: fused_transducer_loss(x, h, model.Tjoint, lin, tokens, short, token_lens, 0),
    ):
        with pytest.raises(ValueError, match=r"input_lens: an utterance of relative length .* = 0 frames"):
            call()
    with pytest.raises(ValueError, match="joint='sum'"):
        fused(joint=Transducer_joint(Linear(input_size=2 * J, n_neurons=J), joint="concat"))
    with pytest.raises(ValueError, match="LeakyReLU"):
        fused(joint=Transducer_joint(joint="sum", nonlinearity=lambda: torch.nn.LeakyReLU(0.2)))
    with pytest.raises(ValueError, match="GELU"):
        fused(joint=Transducer_joint(joint="sum", nonlinearity=lambda: torch.nn.GELU(approximate="tanh")))
    with pytest.raises(ValueError, match="joint: expected SpeechBrain's Transducer_joint"):
        fused(joint=torch.nn.Tanh())
    with pytest.raises(ValueError, match="combine_dims"):
        fused(output=Linear(input_size=J, n_neurons=V, combine_dims=True).double())
    with pytest.raises(ValueError, match="output: expected SpeechBrain's Linear"):
        fused(output=torch.nn.Sequential(lin.w))
    # the blank and use_torchaudio as the loss checks its options: refused, not converted
    with pytest.raises(TypeError, match="blank_index: expected an int .* got float 0.0"):
        transducer_loss(logits, tokens, wav_lens, token_lens, 0.0)
    with pytest.raises(ValueError, match=r"blank_index: expected an int in \[-7, 7\) \(the vocabulary size is logits"):
        transducer_loss(logits, tokens, wav_lens, token_lens, 7)
    with pytest.raises(ValueError, match=r"blank_index: expected an int in \[-7, 7\) \(the vocabulary size is output"):
        fused_transducer_loss(x, h, model.Tjoint, lin, tokens, wav_lens, token_lens, -8)
    with pytest.raises(TypeError, match="use_torchaudio: expected a bool, got str 'False'"):
        transducer_loss(logits, tokens, wav_lens, token_lens, 0, use_torchaudio="False")
    with pytest.raises(TypeError, match="use_torchaudio: expected a bool, got str 'yes'"):
        fused(use_torchaudio="yes")
    torch.testing.assert_close(fused(output=lin.w), fused())  # a torch.nn.Linear is taken as it is
