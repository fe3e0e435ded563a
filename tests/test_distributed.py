"""The fused loss under FSDP2 (fully_shard) and DDP: 2 processes forked, gloo on the CPU, each rank a different
batch. The loss (each rank's mean, averaged over the ranks) and every parameter's gradient must equal one process's
over the whole batch, under every wrap policy: the root alone, the joiner (FusedJoinerLoss) as a unit, its output
Linear as a unit, every Linear a unit (also with bf16 parameters and fp32 reductions), fused_joiner_loss given a
unit's weight and bias without the unit's forward, DDP; and each integration's apply(model, fused=True) with every
Linear a unit. After backward the parameters and their gradients are sharded DTensors again. Refused: DTensor
activations, a weight sharded along dim 1 or over a 2-D mesh.

The cases all run in one pair of processes (forked once for the module; 20-40 s on 2 cores), each rank writing its
results, the tensors compared here. Where there are two CUDA GPUs and NCCL, the same cases run again (marked cuda) in
a pair of processes spawned on NCCL, rank r on cuda:r, the steps under bf16 autocast (the fused loss on the Hopper
kernels where they run), against one GPU's step over the whole batch to bf16's rounding."""

import datetime
import multiprocessing
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from transducer import FusedJoinerLoss, fused_joiner_loss, transducer_loss

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6
    fully_shard = None
needs_fsdp = pytest.mark.skipif(fully_shard is None, reason="this torch has no torch.distributed.fsdp.fully_shard")

WORLD = 2
V, J, FEATS = 7, 8, 5  # V = 7 rows: shards of 4 and 3 rows
BF16_TOL = 3e-2  # the relative tolerance of a step in bf16 (parameters, or GEMMs under autocast)


class Tiny(nn.Module):
    """An encoder, a predictor and FusedJoinerLoss as the joiner (``functional``: a Linear of the model's own whose
    weight and bias are passed to fused_joiner_loss, its forward never called)."""

    def __init__(self, functional=False, unfused=False, **options):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATS, J), nn.Tanh(), nn.Linear(J, J))
        self.embed = nn.Embedding(V, J)
        self.predictor = nn.Linear(J, J)
        self.functional, self.unfused = functional, unfused
        if functional:
            self.out = nn.Linear(J, V + len(options.get("durations", ())))
        else:
            self.joiner = FusedJoinerLoss(J, V, **options)
        self.options = options

    def forward(self, feats, targets, T, U):
        enc = self.encoder(feats)
        pred = self.predictor(self.embed(F.pad(targets, (1, 0))))  # the blank (0) first
        if self.unfused:  # the Linear's own forward: FSDP2 gathers its weight and reduces its gradient
            logits = self.out(torch.tanh(enc[:, :, None] + pred[:, None]))  # the fused default
            return transducer_loss(logits, targets, T, U)
        if self.functional:
            return fused_joiner_loss(enc, pred, self.out.weight, self.out.bias, targets, T, U, **self.options)
        return self.joiner(enc, pred, targets, T, U)


def tiny_batch(seed=0, B=2 * WORLD, max_t=6, max_u=3):
    """feats, targets (labels 1..V-1), T and U of B utterances: the global batch, split in WORLD equal parts."""
    gen = torch.Generator().manual_seed(seed)
    T = torch.randint(2, max_t + 1, (B,), generator=gen)
    U = torch.randint(1, max_u + 1, (B,), generator=gen)
    feats = torch.randn(B, max_t, FEATS, generator=gen) * 2
    targets = torch.randint(1, V, (B, max_u), generator=gen)
    return dict(feats=feats, targets=targets, T=T, U=U)


def split(batch, rank):
    """The rank's part of a global batch (a dict of tensors, the utterances along dim 0)."""
    return {k: v.chunk(WORLD)[rank] for k, v in batch.items()}


def autocast(device):
    """bf16 autocast on CUDA (as a GPU trains), none on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def shard(model, units, mp_policy=None, root=True):
    """fully_shard on each module of ``units`` (of type, or the module itself), the innermost first, then on the
    root."""
    options = {} if mp_policy is None else dict(mp_policy=mp_policy)
    for module in reversed(list(model.modules())[1:]):
        if any(isinstance(module, u) if isinstance(u, type) else module is u for u in units):
            fully_shard(module, **options)
    if root:
        fully_shard(model, **options)
    return model


def compare(make, wrap, batch, loss_of, rank, device):
    """One process's loss and gradients over ``batch`` beside the wrapped model's over the rank's part (two models
    from ``make()`` under one seed, on ``device``; the forward under ``autocast(device)``): the loss averaged over the
    ranks, each gradient in full; the parameters' and gradients' types and local shapes after backward."""
    batch = {k: v.to(device) for k, v in batch.items()}
    torch.manual_seed(0)
    reference = make().to(device)
    with autocast(device):
        want = loss_of(reference, batch)
    want.backward()
    torch.manual_seed(0)
    wrapped = wrap(make().to(device))
    with autocast(device):
        got = loss_of(wrapped, split(batch, rank))
    got.backward()
    loss = got.detach().clone()
    dist.all_reduce(loss)
    grads, local = {}, {}
    params = dict(wrapped.named_parameters())
    for name, p in reference.named_parameters():
        if p.grad is None:  # not trained (a one-hot embedding's table)
            continue
        q = params.get(name, params.get("module." + name))  # DDP's names
        grad = q.grad
        local[name] = (
            type(q).__name__,
            tuple(getattr(q, "_local_tensor", q).shape),
            type(grad).__name__,
            tuple(getattr(grad, "_local_tensor", grad).shape),
        )
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad, p.grad)
    shards = {name: q.grad._local_tensor.clone() for name, q in params.items() if hasattr(q.grad, "_local_tensor")}
    return dict(
        loss=(loss / WORLD, want.detach()), grads=grads, local=local, shards=shards, autocast=device.type == "cuda"
    )


def tiny_loss(model, batch):
    return model(batch["feats"], batch["targets"], batch["T"], batch["U"])


def tiny_case(units, functional=False, unfused=False, mp_policy=None, **options):
    def run(rank, device):
        unit_of = {
            "joiner": lambda m: [m.joiner],
            "output": lambda m: [m.joiner.output],
            "out": lambda m: [m.out],
            "linears": lambda m: [nn.Linear],
            "root": lambda m: [],
        }[units]
        return compare(
            lambda: Tiny(functional, unfused, **options),
            lambda m: shard(m, unit_of(m), mp_policy),
            tiny_batch(),
            tiny_loss,
            rank,
            device,
        )

    return run


def ddp_case(rank, device):
    from torch.nn.parallel import DistributedDataParallel

    return compare(Tiny, DistributedDataParallel, tiny_batch(), tiny_loss, rank, device)


def transformers_case(kind):
    """transformers' ParakeetForRNNT / ParakeetForTDT (tests/test_transformers.py's tiny models) under
    apply(model, fused=True), every Linear a unit, in eval mode (its BatchNorm then reads no batch statistics)."""

    def run(rank, device):
        import test_transformers as tf

        batch = tf.model_batch(tf.make_model(kind), kind)
        return compare(
            lambda: tf.apply(tf.make_model(kind)).eval(),
            lambda m: shard(m, [nn.Linear]),
            batch,
            lambda m, b: m(**b, reduction="mean_batch").loss,
            rank,
            device,
        )

    return run


def nemo_case(loss):
    """NeMo's tiny char model (tests/_nemo_models.py) under apply(model, fused=True), every Linear a unit: its
    training_step (FSDP2's forward method, as the root's forward) in eval mode (the Conformer's BatchNorm then
    reads no batch statistics), four utterances."""

    def run(rank, device):
        from _imports import require

        require("nemo.collections.asr", "nemo")
        import _nemo_models as tiny
        from torch.distributed.fsdp import register_fsdp_forward_method

        from transducer.integrations.nemo import apply

        def wrap(model):
            shard(model, [nn.Linear])
            register_fsdp_forward_method(model, "training_step")
            return model

        def loss_of(model, data):
            tiny.attach_trainer(model, log_every_n_steps=2)  # no WER: decoding's steps differ between the ranks
            return model.eval().training_step(list(data), 0)["loss"]

        batch = tiny.batch(tiny.build("char", loss), seconds=(0.6, 0.4, 0.5, 0.3), labels=(6, 0, 4, 5))
        batch = dict(zip("signal signal_len transcript transcript_len".split(), batch))
        return compare(
            lambda: apply(tiny.build("char", loss)), wrap, batch, lambda m, b: loss_of(m, b.values()), rank, device
        )

    return run


def espnet_case(kind):
    """ESPnet's tiny models (tests/test_espnet.py) under apply(model, fused=True), every Linear a unit, eval mode
    (no dropout; the Conformer's BatchNorm reads no batch statistics); each rank's part as long as the longest
    utterance (ESPnet cuts the features to the longest, and its convolutions read the padding)."""

    def run(rank, device):
        import test_espnet as es

        from transducer.integrations.espnet import apply

        es.install()
        batch = dict(zip("speech speech_lengths text text_lengths".split(), es.batch(es.MODELS[kind]())))
        batch["speech_lengths"] = torch.tensor([40, 33, 40, 17])
        return compare(
            lambda: apply(es.MODELS[kind]()).eval(),
            lambda m: shard(m, [nn.Linear]),
            batch,
            lambda m, b: m(*(t.clone() for t in b.values()))[0],
            rank,
            device,
        )

    return run


def speechbrain_case(rank, device):
    """SpeechBrain's recipe's joint path (tests/test_speechbrain.py's tiny model, float64) through
    fused_transducer_loss, every torch Linear a unit (transducer_lin's too, whose forward is never called) and each
    of the ModuleDict's modules with parameters, as SpeechBrain's Brain wraps each module with DDP."""
    import test_speechbrain as sb

    from transducer.integrations.speechbrain import fused_transducer_loss

    def loss_of(model, b):
        x, h = sb.encode(model, b["feats"], b["tokens"])
        return fused_transducer_loss(
            x, h, model.Tjoint, model.transducer_lin, b["tokens"], b["wav_lens"], b["token_lens"], blank_index=0
        )

    # four utterances, lengths relative to the padded 6 frames and 3 labels
    feats, tokens, _, _ = sb.batch(seed=1)
    batch = dict(
        feats=torch.cat([feats, feats.flip(1)])[:4],
        tokens=torch.cat([tokens, tokens.flip(1)])[:4],
        wav_lens=torch.tensor([1.0, 0.75, 0.5, 1.0]),
        token_lens=torch.tensor([1.0, 1 / 3, 0.0, 2 / 3]),
    )

    def wrap(model):
        return shard(model, [nn.Linear, *(m for m in model.values() if list(m.parameters()))], root=False)

    return compare(sb.tiny_model, wrap, batch, loss_of, rank, device)


def refusals(rank, device):
    """The messages of the refused DTensor inputs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    batch = {k: v.to(device) for k, v in split(tiny_batch(), rank).items()}
    enc, pred = torch.randn(WORLD, 6, J, device=device), torch.randn(WORLD, 4, J, device=device)
    lin = nn.Linear(J, V, device=device)
    mesh = init_device_mesh(device.type, (WORLD,))
    mesh2 = init_device_mesh(device.type, (WORLD, 1))
    messages = {}
    for name, args in [
        ("encoder_out", (distribute_tensor(enc, mesh, [Replicate()]), pred, lin.weight, lin.bias)),
        ("predictor_out", (enc, distribute_tensor(pred, mesh, [Shard(1)]), lin.weight, lin.bias)),
        ("weight_dim1", (enc, pred, distribute_tensor(lin.weight.detach(), mesh, [Shard(1)]), lin.bias)),
        ("bias_2d", (enc, pred, lin.weight, distribute_tensor(lin.bias.detach(), mesh2, [Shard(0), Replicate()]))),
    ]:
        try:
            fused_joiner_loss(*args, batch["targets"], batch["T"], batch["U"])
            messages[name] = None
        except (TypeError, ValueError) as e:
            messages[name] = f"{type(e).__name__}: {e}"
    return messages


CASES = {
    "ddp": ddp_case,
}
if fully_shard is not None:
    CASES.update(
        {
            "root": tiny_case("root"),
            "joiner": tiny_case("joiner"),
            "output": tiny_case("output"),
            "output_tdt": tiny_case("output", durations=[0, 1, 2]),
            "linears": tiny_case("linears"),
            "linears_bf16": tiny_case(
                "linears", mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            ),
            "functional": tiny_case("out", functional=True),
            "unfused": tiny_case("out", functional=True, unfused=True),
            "output_no_bias": tiny_case("output", bias=False),
            "refusals": refusals,
            "transformers_rnnt": transformers_case("rnnt"),
            "transformers_tdt": transformers_case("tdt"),
            "nemo_rnnt": nemo_case("default"),
            "nemo_tdt": nemo_case("tdt"),
            "espnet_rnnt": espnet_case("rnnt"),
            "espnet_transducer": espnet_case("transducer"),
            "speechbrain": speechbrain_case,
        }
    )


def _process(rank, backend, store, path):
    """One rank: every case, its result or its traceback, saved to ``path``. On gloo the CPU; on NCCL cuda:rank (a
    longer timeout: the first steps compile the Hopper kernels)."""
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=300 if device.type == "cuda" else 60),
    )
    results = {}
    for name, case in CASES.items():
        torch.manual_seed(0)
        try:
            results[name] = case(rank, device)
        except pytest.skip.Exception as e:  # an integration's package not installed
            results[name] = {"skip": str(e)}
        except Exception:  # noqa: BLE001 - the test reports it
            results[name] = traceback.format_exc()
    torch.save(results, path)
    dist.destroy_process_group()
    sys.stdout.flush()


@pytest.fixture(scope="module", params=["gloo", pytest.param("nccl", marks=pytest.mark.cuda)])
def results(request, tmp_path_factory):
    """Each rank's results of every case, on gloo (the CPU) and on NCCL (two GPUs). The gloo processes are forked
    (the imports are done: they start at once); the NCCL ones are spawned, as CUDA cannot be used in a forked
    process once the parent has touched it."""
    backend = request.param
    if backend == "nccl" and (not dist.is_nccl_available() or torch.cuda.device_count() < WORLD):
        pytest.skip(
            f"needs {WORLD} CUDA GPUs and NCCL (this machine: {torch.cuda.device_count()} GPUs, NCCL "
            f"{'available' if dist.is_nccl_available() else 'not available'})"
        )
    tmp = tmp_path_factory.mktemp(f"distributed-{backend}")
    context = multiprocessing.get_context("fork" if backend == "gloo" else "spawn")
    ranks = [
        context.Process(target=_process, args=(rank, backend, tmp / "store", tmp / f"{rank}.pt"))
        for rank in range(WORLD)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300 if backend == "gloo" else 900)
    for p in ranks:
        if p.exitcode is None:
            p.kill()
    assert [p.exitcode for p in ranks] == [0] * WORLD
    return [torch.load(tmp / f"{rank}.pt", map_location="cpu", weights_only=False) for rank in range(WORLD)]


def tolerance(result, tol):
    """``tol``, or bf16's where the case's step ran under bf16 autocast (its loss not float64: autocast leaves
    float64 alone)."""
    return max(tol, BF16_TOL) if result["autocast"] and result["loss"][1].dtype != torch.float64 else tol


def check(results, name, tol=1e-5, sharded=True):
    for rank in range(WORLD):
        result = results[rank][name]
        assert not isinstance(result, str), f"rank {rank}:\n{result}"
        if "skip" in result:
            pytest.skip(result["skip"])
        tol = tolerance(result, tol)
        torch.testing.assert_close(*result["loss"], rtol=tol, atol=0)
        for param, (got, want) in result["grads"].items():
            # every part of the model has a gradient to compare, but attention's key bias (softmax ignores it)
            scale = want.abs().max().item()
            assert scale > 1e-4 or param.endswith(("k_proj.bias", "linear_k.bias")), param
            torch.testing.assert_close(got, want, rtol=tol, atol=tol * max(scale, 1e-3), msg=param)
        for param, (kind, shape, grad_kind, grad_shape) in result["local"].items():
            full = tuple(result["grads"][param][1].shape)
            if sharded:  # each rank holds its rows only: dim 0 split as torch.chunk splits it
                rows = [len(c) for c in torch.arange(full[0]).chunk(WORLD)][rank]
                assert (kind, shape, grad_kind, grad_shape) == ("DTensor", (rows,) + full[1:]) * 2, param
            else:
                assert (kind, shape, grad_kind, grad_shape) == ("Parameter", full, "Tensor", full), param


def test_ddp(results):
    check(results, "ddp", sharded=False)


@needs_fsdp
@pytest.mark.parametrize(
    "units", ["root", "joiner", "output", "output_tdt", "output_no_bias", "linears", "functional", "unfused"]
)
def test_fully_shard(results, units):
    check(results, units)


@needs_fsdp
def test_fully_shard_reduces_as_a_linear_unit(results):
    """The gradient shards of a weight gathered by the loss equal those FSDP2 gives when the Linear's own forward
    runs (the unfused loss over its logits): the mean over the ranks, reduce-scattered."""
    for rank in range(WORLD):
        fused, linear = results[rank]["functional"], results[rank]["unfused"]
        assert not isinstance(fused, str) and not isinstance(linear, str), (fused, linear)
        for name in ("out.weight", "out.bias"):
            scale = linear["shards"][name].abs().max().item()
            rtol, atol = (BF16_TOL, BF16_TOL * scale) if fused["autocast"] else (1e-5, 1e-7)
            torch.testing.assert_close(fused["shards"][name], linear["shards"][name], rtol=rtol, atol=atol)


@needs_fsdp
def test_fully_shard_bf16_parameters(results):
    """bf16 parameters and inputs, fp32 reductions: equal to bf16's rounding."""
    check(results, "linears_bf16", tol=BF16_TOL)


@needs_fsdp
def test_refused(results):
    messages = results[0]["refusals"]
    assert not isinstance(messages, str), messages
    assert messages["encoder_out"].startswith("TypeError: encoder_out: expected a plain torch.Tensor")
    assert "pass encoder_out.full_tensor()" in messages["encoder_out"]
    assert messages["predictor_out"].startswith("TypeError: predictor_out: expected a plain torch.Tensor")
    assert messages["weight_dim1"].startswith(
        "ValueError: weight: a DTensor with placements (Shard(dim=1),) over a 1-D device mesh is not supported"
    )
    assert messages["bias_2d"].startswith(
        "ValueError: bias: a DTensor with placements (Shard(dim=0), Replicate()) "
        "over a 2-D device mesh is not supported"
    )
    assert "the unit holding this Linear" in messages["bias_2d"]


@needs_fsdp
@pytest.mark.parametrize("kind", ["rnnt", "tdt"])
def test_transformers(results, kind):
    check(results, f"transformers_{kind}", tol=1e-4)


@needs_fsdp
@pytest.mark.parametrize("loss", ["rnnt", "tdt"])
def test_nemo(results, loss):
    check(results, f"nemo_{loss}", tol=1e-4)


@needs_fsdp
@pytest.mark.parametrize("kind", ["rnnt", "transducer"])
def test_espnet(results, kind):
    check(results, f"espnet_{kind}", tol=1e-4)


@needs_fsdp
def test_speechbrain(results):
    check(results, "speechbrain", tol=1e-9)
