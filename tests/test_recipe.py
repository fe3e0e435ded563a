"""recipes/train_toy.py: quick mode learns, resume round-trips, DDP on gloo, bad input is reported."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _cpu import autocast_lstms
from _imports import require

for _mod in ("torchaudio", "soundfile", "espeakng_loader", "tqdm", "matplotlib"):
    require(_mod, "recipes")

import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
sys.path.insert(0, str(RECIPES))

import asr_data  # noqa: E402
import toy_corpus  # noqa: E402
import train_toy  # noqa: E402

FAST = ["--quick", "--no-progress", "--threads", "1", "--show", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy_corpus_quick")
    toy_corpus.ensure_corpus(d, toy_corpus.corpus_config(seed=0, **train_toy.QUICK), log=lambda *_: None)
    return d


def run(args):
    return train_toy.main(FAST + [str(a) for a in args])


def test_corpus_is_deterministic(corpus, tmp_path):
    cfg = toy_corpus.corpus_config(seed=0, **dict(train_toy.QUICK, n_train=8))
    toy_corpus.make_corpus(tmp_path / "a", cfg, log=lambda *_: None)
    toy_corpus.make_corpus(tmp_path / "b", cfg, log=lambda *_: None)
    for split in ("train", "dev", "test"):
        assert (tmp_path / "a" / f"{split}.jsonl").read_text() == (tmp_path / "b" / f"{split}.jsonl").read_text()
        assert np.array_equal(np.load(tmp_path / "a" / f"{split}.npy"), np.load(tmp_path / "b" / f"{split}.npy"))
    train_voices = {json.loads(x)["voice"].split("+")[1] for x in open(corpus / "train.jsonl")}
    test_voices = {json.loads(x)["voice"].split("+")[1] for x in open(corpus / "test.jsonl")}
    assert train_voices and test_voices and not train_voices & test_voices


def test_quick_run_learns_and_resume_round_trips(corpus, tmp_path):
    a = run(["--data-dir", corpus, "--exp-dir", tmp_path / "a", "--epochs", 3])
    losses = [h["train_loss"] for h in a["history"]]
    assert losses[-1] < losses[0], losses
    assert 0 <= a["test_wer"] and 0 <= a["test_cer"]
    res = json.loads((tmp_path / "a" / "results.json").read_text())
    assert res["test_wer"] == pytest.approx(a["test_wer"])
    assert (tmp_path / "a" / "train.png").stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "a").glob("epoch-*.pt")) == ["epoch-2.pt", "epoch-3.pt"]

    # Resuming from the epoch-2 checkpoint reproduces epoch 3 exactly.
    b = run(
        ["--data-dir", corpus, "--exp-dir", tmp_path / "b", "--epochs", 3, "--resume", tmp_path / "a" / "epoch-2.pt"]
    )
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert b["history"] == a["history"][:2] + b["history"][2:]
    assert b["history"][2]["train_loss"] == pytest.approx(a["history"][2]["train_loss"])
    saved = torch.load(tmp_path / "b" / "epoch-3.pt", map_location="cpu", weights_only=True)
    for k in sa:
        assert torch.equal(saved["model"][k], sa[k]), k


def test_tdt_loss_and_decoding(corpus, tmp_path):
    r = run(
        [
            "--data-dir",
            corpus,
            "--exp-dir",
            tmp_path,
            "--epochs",
            1,
            "--max-steps",
            3,
            "--loss",
            "tdt",
            "--durations",
            "0,1,2",
            "--omega",
            "0.1",
        ]
    )
    assert np.isfinite(r["history"][0]["train_loss"]) and r["loss"] == "tdt" and r["joiner"] == "fused"
    assert 0 <= r["test_wer"] and r["decode_s"] > 0


def test_regularisers_train(corpus, tmp_path):
    r = run(
        [
            "--data-dir",
            corpus,
            "--exp-dir",
            tmp_path,
            "--epochs",
            1,
            "--max-steps",
            2,
            "--fastemit-lambda",
            "0.01",
            "--delay-penalty",
            "0.05",
        ]
    )
    assert np.isfinite(r["history"][0]["train_loss"])


def test_rna_stateless_predictor_unfused_joiner(corpus, tmp_path):
    r = run(
        [
            "--data-dir",
            corpus,
            "--exp-dir",
            tmp_path,
            "--epochs",
            1,
            "--max-steps",
            2,
            "--rna",
            "--predictor",
            "stateless",
            "--joiner",
            "unfused",
        ]
    )
    assert np.isfinite(r["history"][0]["train_loss"])


def torchrun(args, timeout=300):
    """The recipe run by torchrun in 2 processes on the CPU (gloo)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(RECIPES / "train_toy.py"),
        *FAST,
        "--device",
        "cpu",
        *map(str, args),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "terminate called" not in p.stderr and "process group has NOT been destroyed" not in p.stderr, p.stderr
    return p


@pytest.mark.skipif(train_toy.torch_version() < (2, 6), reason="FSDP2's fully_shard is public from torch 2.6")
def test_ddp_and_fsdp_two_gloo_processes(corpus, tmp_path):
    """torchrun's 2 processes replicate the model (DDP) or, with --fsdp, shard it. Each epoch's checkpoint holds
    the whole model and optimiser either way: DDP's epoch 1 resumed under FSDP gives DDP's epoch 2 (to rounding:
    the gradient norm is summed in another order) and a checkpoint of the same form."""
    steps = ["--data-dir", corpus, "--epochs", 2, "--max-steps", 3]
    p = torchrun([*steps, "--exp-dir", tmp_path / "ddp"])
    ddp = json.loads((tmp_path / "ddp" / "results.json").read_text())
    assert ddp["world"] == 2 and "world 2, replicated (DDP)" in p.stdout
    assert len(ddp["param_digests"]) == 2 and ddp["param_digests"][0] == ddp["param_digests"][1]
    assert "parameters agree across 2 ranks" in p.stdout
    losses = [h["train_loss"] for h in ddp["history"]]
    assert all(np.isfinite(losses)) and losses[1] < losses[0], losses

    p = torchrun([*steps, "--exp-dir", tmp_path / "fsdp", "--fsdp", "--resume", tmp_path / "ddp" / "epoch-1.pt"])
    assert "world 2, sharded (FSDP2)" in p.stdout
    fsdp = json.loads((tmp_path / "fsdp" / "results.json").read_text())
    assert fsdp["history"][0] == ddp["history"][0]
    assert fsdp["history"][1]["train_loss"] == pytest.approx(losses[1], rel=1e-5)
    assert 0 <= fsdp["test_wer"] and 0 <= fsdp["test_cer"] and fsdp["decode_s"] > 0
    a, b = (torch.load(tmp_path / run / "epoch-2.pt", map_location="cpu", weights_only=True) for run in ("ddp", "fsdp"))
    assert fsdp["param_digests"] == [train_toy.param_digest(b["model"])]
    assert a["model"].keys() == b["model"].keys()  # whole tensors, the names of the unsharded model
    for k, v in a["model"].items():
        torch.testing.assert_close(b["model"][k], v, rtol=1e-4, atol=1e-6, msg=k)
    assert sorted(b["optimizer"]["state"]) == sorted(a["optimizer"]["state"])  # keyed by parameter index
    assert [dict(g, betas=tuple(g["betas"])) for g in b["optimizer"]["param_groups"]] == a["optimizer"]["param_groups"]
    for i, s in a["optimizer"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(b["optimizer"]["state"][i][k], s[k], rtol=1e-3, atol=1e-8, msg=(i, k))


def test_fsdp_needs_torchrun(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        train_toy.parse_args(["--fsdp"])
    assert "--fsdp shards the model over the processes that torchrun starts" in capsys.readouterr().err
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(SystemExit):
        train_toy.parse_args(["--fsdp"])
    assert (
        "--fsdp needs torch >= 2.6 (FSDP2's torch.distributed.fsdp.fully_shard); this is torch 2.5.1"
        in capsys.readouterr().err
    )


# ---------------------------------------------------------------------- run folders


def run_in(folder, args):
    """A run started in ``folder``: its default run folders are in folder/runs/toy_quick."""
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return run(args)
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def two_runs(corpus, tmp_path_factory):
    """In one place, each in its default run folder: an RNN-T run of 3 epochs, a multi-blank run of 2, and the
    multi-blank run resumed for a third. Returns the folder of the run folders and the three results."""
    base = tmp_path_factory.mktemp("two_runs")
    short = ["--data-dir", corpus, "--max-steps", 1]
    rnnt = run_in(base, [*short, "--epochs", 3])
    multiblank = run_in(base, [*short, "--epochs", 2, "--loss", "multiblank"])
    resumed = run_in(base, [*short, "--epochs", 3, "--loss", "multiblank", "--resume"])
    return base / "runs" / "toy_quick", rnnt, multiblank, resumed


QUICK_MODEL = dict(
    joiner="fused",
    encoder="conformer",
    encoder_dim=64,
    encoder_layers=1,
    predictor="lstm",
    predictor_dim=32,
    joiner_dim=32,
)


def test_configurations_keep_their_own_run_folders(two_runs):
    runs, rnnt, multiblank, resumed = two_runs
    assert sorted(p.name for p in runs.iterdir()) == ["multiblank", "rnnt"]
    configs = {
        "rnnt": dict(loss="rnnt", fastemit_lambda=0.0, delay_penalty=0.0, **QUICK_MODEL),
        "multiblank": dict(
            loss="multiblank",
            big_blank_durations=[2, 4, 8],
            sigma=0.05,
            fastemit_lambda=0.0,
            delay_penalty=0.0,
            **QUICK_MODEL,
        ),
    }
    for name, result, epochs in (("rnnt", rnnt, [2, 3]), ("multiblank", resumed, [2, 3])):
        folder = runs / name
        assert json.loads((folder / "config.json").read_text()) == configs[name] == result["config"]
        # pruning kept two checkpoints of each run, whichever ran last
        assert sorted(p.name for p in folder.glob("epoch-*.pt")) == [f"epoch-{n}.pt" for n in epochs]
        for n in epochs:
            saved = torch.load(folder / f"epoch-{n}.pt", map_location="cpu", weights_only=True)
            assert saved["config"] == configs[name] and saved["epoch"] == n
        results = json.loads((folder / "results.json").read_text())
        assert results["loss"] == name and results["history"] == result["history"]
        assert (folder / "train.png").stat().st_size > 0
    # --resume without a checkpoint took the multi-blank run's latest, not the RNN-T run's
    assert [h["epoch"] for h in resumed["history"]] == [1, 2, 3]
    assert resumed["history"][:2] == multiblank["history"]


def test_resume_refuses_a_checkpoint_of_another_configuration(two_runs, corpus):
    runs, *_ = two_runs
    checkpoint = runs / "rnnt" / "epoch-3.pt"
    for args, differences in [
        (["--loss", "multiblank"], "--loss rnnt there, multiblank here"),
        (
            ["--predictor-dim", 48, "--joiner", "unfused"],
            "--joiner fused there, unfused here; --predictor-dim 32 there, 48 here",
        ),
    ]:
        with pytest.raises(train_toy.UsageError) as e:
            run_in(runs.parent.parent, ["--data-dir", corpus, "--epochs", 4, "--resume", checkpoint, *args])
        assert str(e.value) == (
            f"--resume: {checkpoint} is a checkpoint of another configuration ({differences}); "
            f"resume it with the flags it was trained with, or leave --resume out to start afresh"
        )
    assert sorted(p.name for p in runs.iterdir()) == ["multiblank", "rnnt"]  # the refused runs made no folder


def test_a_folder_of_another_configuration_is_refused(two_runs, corpus, tmp_path):
    runs, *_ = two_runs
    folder = runs / "rnnt"
    before = sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir())
    with pytest.raises(train_toy.UsageError) as e:
        run(["--data-dir", corpus, "--exp-dir", folder, "--loss", "tdt", "--durations", "0,1,2"])
    assert str(e.value) == (
        f"--exp-dir {folder} holds a run of another configuration (--loss rnnt there, tdt here); a run folder keeps "
        f"the checkpoints and results of one configuration. Give --exp-dir another folder (without --exp-dir each "
        f"configuration has its own in runs/toy_quick/), or delete {folder} to reuse it"
    )
    assert sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir()) == before
    # a folder without config.json: its latest checkpoint says what it holds
    (tmp_path / "epoch-3.pt").write_bytes((folder / "epoch-3.pt").read_bytes())
    with pytest.raises(
        train_toy.UsageError,
        match=r"holds a run of another configuration \(--encoder-dim 64 there, "
        r"128 here\)",
    ):
        run(["--data-dir", corpus, "--exp-dir", tmp_path, "--encoder-dim", 128])
    # a run that stops before its first checkpoint leaves no run behind
    with pytest.raises(asr_data.ManifestError, match="manifest not found"):
        run(["--manifest", tmp_path / "missing.jsonl", "--exp-dir", tmp_path / "stopped"])
    assert not (tmp_path / "stopped").exists()


class Planted:
    """An object whose unpickling touches a file: what a checkpoint planted in a run folder could carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_a_checkpoint_carrying_an_object_is_refused(two_runs, corpus, tmp_path):
    """Checkpoints are loaded with weights_only=True: one that holds anything but tensors, numbers, strings and
    plain containers is refused, by name, and what it carries never runs; whether found in a run folder without
    config.json or given to --resume."""
    runs, *_ = two_runs
    state = torch.load(runs / "rnnt" / "epoch-3.pt", map_location="cpu", weights_only=True)
    marker = tmp_path / "unpickled"
    folder = tmp_path / "planted"
    folder.mkdir()
    torch.save(dict(state, history=Planted(marker)), folder / "epoch-3.pt")
    refused = (
        r" is not a checkpoint of this recipe: it holds objects other than tensors, numbers, strings and "
        r"plain containers \(Unsupported global: .*\), and those are not loaded: unpickling them could run "
        r"any code"
    )
    for args in (["--exp-dir", folder], ["--exp-dir", tmp_path / "fresh", "--resume", folder / "epoch-3.pt"]):
        with pytest.raises(train_toy.UsageError, match=re.escape(str(folder / "epoch-3.pt")) + refused):
            run(["--data-dir", corpus, *args])
    assert not marker.exists()
    torch.load(folder / "epoch-3.pt", weights_only=False)  # the object, unpickled, would have run
    assert marker.exists()


def test_a_fresh_run_replaces_the_earlier_run_of_its_configuration(two_runs, corpus, tmp_path, capsys):
    """Without --resume, the folder's checkpoints and results.json are the earlier run's: they go once the new
    run has saved its first checkpoint, so that pruning and --resume see this run's only."""
    runs, *_ = two_runs
    folder = tmp_path / "rnnt"
    folder.mkdir()
    for name in ("config.json", "epoch-2.pt", "epoch-3.pt", "results.json"):
        (folder / name).write_bytes((runs / "rnnt" / name).read_bytes())
    r = run(["--data-dir", corpus, "--exp-dir", folder, "--epochs", 1, "--max-steps", 1])
    out = capsys.readouterr().out
    assert (
        f"{folder} holds checkpoints of an earlier run of this configuration (epoch-2.pt, epoch-3.pt): they and "
        f"its results.json are removed once this run has saved its first checkpoint (--resume continues that "
        f"run instead)"
    ) in out
    # the run folder is named once it holds this run's first checkpoint
    assert out.index("epoch 1: train loss") < out.index(
        f"run folder: {folder}/ (epoch-1.pt, config.json, train.png; results.json at the end)"
    )
    assert sorted(p.name for p in folder.glob("epoch-*.pt")) == ["epoch-1.pt"]
    assert json.loads((folder / "results.json").read_text())["history"] == r["history"] and len(r["history"]) == 1


def test_the_run_folder_is_checked_before_training(corpus, tmp_path, monkeypatch, capsys):
    """A run folder that cannot be written, or without room for a checkpoint, stops the run before its first
    step, naming the folder and the cause."""
    (tmp_path / "file").write_text("")
    with pytest.raises(train_toy.UsageError) as e:
        run(["--data-dir", corpus, "--exp-dir", tmp_path / "file" / "run"])
    assert str(e.value) == (
        f"--exp-dir {tmp_path / 'file' / 'run'}: cannot write there: Not a directory; give "
        f"--exp-dir a folder that can be written"
    )
    assert "epoch 1" not in capsys.readouterr().out

    def full(path):
        return shutil._ntuple_diskusage(10 * 2**30, 10 * 2**30 - 2**19, 2**19)

    monkeypatch.setattr(train_toy.shutil, "disk_usage", full)
    with pytest.raises(train_toy.UsageError) as e:
        run(["--data-dir", corpus, "--exp-dir", tmp_path / "full"])
    # 3 copies (the parameters, AdamW's two moments) of the quick model's 4-byte parameters, and 1 MiB
    from asr_model import Transducer

    model = Transducer(27, encoder="conformer", encoder_dim=64, encoder_layers=1, predictor_dim=32, joiner_dim=32)
    size = 3 * 4 * sum(p.numel() for p in model.parameters()) + 2**20
    assert str(e.value) == (
        f"--exp-dir {tmp_path / 'full'}: 0.5 MiB free on its file system, and a checkpoint "
        f"takes about {size / 2**20:.1f} MiB: free some space, or give --exp-dir a folder on "
        f"another file system"
    )
    assert "epoch 1" not in capsys.readouterr().out
    assert list((tmp_path / "full").iterdir()) == []  # the test file is gone


def test_resume_takes_the_checkpoints_of_the_folders_run(corpus, tmp_path, monkeypatch, capsys):
    """A new run names itself in the run folder (run.json) before its first checkpoint, and each checkpoint
    names its run: killed before the earlier run's checkpoints are removed, --resume continues the new run,
    not the earlier one; killed before its first checkpoint, --resume says so."""
    folder = tmp_path / "run"
    short = ["--data-dir", corpus, "--exp-dir", folder, "--max-steps", 1]
    first = run([*short, "--epochs", 2])
    first_id = json.loads((folder / "run.json").read_text())["run_id"]
    assert [torch.load(folder / f"epoch-{n}.pt", weights_only=True)["run_id"] for n in (1, 2)] == [first_id] * 2

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # between the new run's first checkpoint and the earlier run's removal

    monkeypatch.setattr(train_toy, "plot", killed)
    with pytest.raises(KeyboardInterrupt):
        run([*short, "--epochs", 2, "--lr", "1e-3"])
    monkeypatch.undo()
    second_id = json.loads((folder / "run.json").read_text())["run_id"]
    new, old = (torch.load(folder / f"epoch-{n}.pt", weights_only=True) for n in (1, 2))
    assert second_id != first_id and new["run_id"] == second_id and old["run_id"] == first_id
    capsys.readouterr()
    resumed = run([*short, "--epochs", 2, "--lr", "1e-3", "--resume"])
    assert f"resuming from {folder / 'epoch-1.pt'} (epoch 1 done)" in capsys.readouterr().out
    assert resumed["history"][0] == new["history"][0] != first["history"][0]
    assert {torch.load(p, weights_only=True)["run_id"] for p in folder.glob("epoch-*.pt")} == {second_id}

    # a run killed after naming itself and before its first checkpoint: the folder's checkpoints are another run's
    monkeypatch.setattr(train_toy, "save_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        run([*short, "--epochs", 1])
    monkeypatch.undo()
    third_id = json.loads((folder / "run.json").read_text())["run_id"]
    with pytest.raises(train_toy.UsageError) as e:
        run([*short, "--epochs", 3, "--resume"])
    assert str(e.value) == (
        f"--resume: {folder} holds no checkpoint of its current run ({third_id}, in "
        f"{folder / 'run.json'}), only of another (epoch-1.pt, epoch-2.pt): give one of those to "
        f"--resume to continue that run, or leave --resume out to start afresh"
    )


def test_a_checkpoint_from_before_the_joiner_module_resumes(two_runs, corpus, tmp_path):
    """Its output Linear named "out" (now "joiner.output"): it loads, and training goes on from it."""
    runs, rnnt, *_ = two_runs
    state = torch.load(runs / "rnnt" / "epoch-3.pt", map_location="cpu", weights_only=True)
    old = {k.replace("joiner.output.", "out."): v for k, v in state["model"].items()}
    assert "out.weight" in old and "joiner.output.weight" not in old
    torch.save(dict({k: v for k, v in state.items() if k != "run_id"}, model=old), tmp_path / "epoch-3.pt")
    r = run(
        [
            "--data-dir",
            corpus,
            "--exp-dir",
            tmp_path / "exp",
            "--max-steps",
            1,
            "--epochs",
            4,
            "--resume",
            tmp_path / "epoch-3.pt",
        ]
    )
    assert r["history"][:3] == rnnt["history"] and len(r["history"]) == 4


def test_bad_checkpoints_are_named_with_what_is_wrong(two_runs, corpus, tmp_path):
    """Empty, truncated, incomplete and foreign checkpoints, and one whose model does not fit: each refused by
    name, saying what is wrong, with torch's reason where torch gives one."""
    import os as os_module

    runs, *_ = two_runs
    good = (runs / "rnnt" / "epoch-3.pt").read_bytes()
    state = torch.load(runs / "rnnt" / "epoch-3.pt", map_location="cpu", weights_only=True)

    class System:
        def __reduce__(self):
            return os_module.system, ("true",)

    cases = {
        "empty.pt": (b"", "is empty, not a checkpoint (a save cut short?): delete it, or resume from another"),
        "truncated.pt": (
            good[: len(good) // 2],
            "cannot be read as a checkpoint (RuntimeError: PytorchStreamReader "
            "failed reading zip archive: failed finding central directory): "
            "truncated, or not written by torch.save; delete it, or resume "
            "from another",
        ),
        "text.pt": (b"hello", "cannot be read as a checkpoint ("),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
    torch.save({k: v for k, v in state.items() if k != "chars"}, tmp_path / "incomplete.pt")
    cases["incomplete.pt"] = (
        None,
        "is not a complete checkpoint of this recipe: it has no chars (a checkpoint "
        "holds model, optimizer, scheduler, scaler, epoch, history, rng, chars and config)",
    )
    torch.save(dict(state, history=System()), tmp_path / "system.pt")
    cases["system.pt"] = (
        None,
        "is not a checkpoint of this recipe: it holds objects other than tensors, numbers, "
        "strings and plain containers (Trying to load unsupported GLOBAL posix.system whose "
        "module posix is blocked)",
    )
    torch.save(
        dict(
            state,
            model={k: v for k, v in state["model"].items() if k != "out.weight" and not k.endswith("output.weight")},
        ),
        tmp_path / "misfit.pt",
    )
    for name, (_, message) in cases.items():
        with pytest.raises(train_toy.UsageError) as e:
            run(["--data-dir", corpus, "--exp-dir", tmp_path / "exp", "--resume", tmp_path / name])
        assert str(e.value).startswith(f"{tmp_path / name} {message}"), str(e.value)
    with pytest.raises(train_toy.UsageError) as e:
        run(["--data-dir", corpus, "--exp-dir", tmp_path / "exp", "--resume", tmp_path / "misfit.pt"])
    assert str(e.value).startswith(
        f"--resume: {tmp_path / 'misfit.pt'}: its model does not fit this run "
        f"(RuntimeError: Error(s) in loading state_dict for Transducer: Missing key(s) in "
        f'state_dict: "joiner.output.weight"'
    ), str(e.value)


@pytest.mark.parametrize(
    "args, folder",
    [
        ([], "runs/toy/rnnt"),
        (
            ["--epochs", "3", "--lr", "1e-3", "--seed", "4", "--max-frames", "2000", "--threads", "1", "--no-specaug"],
            "runs/toy/rnnt",
        ),
        (["--rna", "--joiner", "unfused"], "runs/toy/rna_joiner=unfused"),
        (["--loss", "tdt", "--durations", "0,1,2", "--omega", "0.1"], "runs/toy/tdt_durations=0,1,2_omega=0.1"),
        (["--loss", "tdt", "--durations", "0,1,2,3,4", "--sigma", "0.05"], "runs/toy/tdt"),
        (
            ["--loss", "multiblank", "--big-blank-durations", "2,4", "--encoder", "lstm", "--encoder-dim", "256"],
            "runs/toy/multiblank_big-blank-durations=2,4_encoder=lstm_encoder-dim=256",
        ),
        (
            ["--fastemit-lambda", "0.001", "--predictor", "stateless"],
            "runs/toy/rnnt_fastemit-lambda=0.001_predictor=stateless",
        ),
        (["--quick"], "runs/toy_quick/rnnt"),
        (["--quick", "--encoder-dim", "144"], "runs/toy_quick/rnnt_encoder-dim=144"),
        (["--exp-dir", "mine", "--loss", "tdt"], "mine"),
    ],
)
def test_run_folder_names(args, folder):
    """The loss, then flag=value for each model or loss flag that differs from its default (--quick's with
    --quick); training flags name no folder."""
    assert train_toy.parse_args(args).exp_dir == str(Path(folder))


# ---------------------------------------------------------------------- bad input


def _write_wavs(tmp_path, n=6):
    items = toy_corpus.load_split(toy_corpus_dir_for(tmp_path), "train")[:n]
    paths = []
    for i, (_, x, text) in enumerate(items):
        path = tmp_path / f"utt{i}.wav"
        sf.write(path, x.numpy(), 16000)
        paths.append((path, text))
    return paths


def toy_corpus_dir_for(tmp_path):
    d = tmp_path / "corpus"
    toy_corpus.ensure_corpus(
        d, toy_corpus.corpus_config(seed=1, **dict(train_toy.QUICK, n_train=12)), log=lambda *_: None
    )
    return d


def test_bad_manifest_lines(tmp_path):
    (good, text), (good2, text2) = _write_wavs(tmp_path, 2)
    (tmp_path / "junk.wav").write_bytes(b"this is not audio")
    lines = [
        json.dumps({"audio": good.name, "text": text}),
        json.dumps({"audio": "missing.wav", "text": "one two"}),
        json.dumps({"audio": "junk.wav", "text": "three"}),
        json.dumps({"audio": str(good2), "text": "   "}),
        "{not json",
        json.dumps({"text": "no audio key"}),
        json.dumps({"audio_filepath": str(good2), "transcript": text2.upper()}),
    ]
    m = tmp_path / "train.jsonl"
    m.write_text("\n".join(lines) + "\n")
    msgs = []
    items = asr_data.read_manifest(m, "skip", log=msgs.append)
    assert [(Path(i[1]).name, i[2]) for i in items] == [(good.name, text), (good2.name, text2)]
    joined = "\n".join(msgs)
    for lineno, what in [
        (2, "audio file not found"),
        (3, "unreadable audio"),
        (4, "empty transcript"),
        (5, "not valid JSON"),
        (6, "no audio path"),
    ]:
        assert f"{m}:{lineno}: {what}" in joined, joined
    with pytest.raises(asr_data.ManifestError, match=r"train\.jsonl:2: audio file not found"):
        asr_data.read_manifest(m, "stop")

    tsv = tmp_path / "train.tsv"
    tsv.write_text(f"audio\ttext\n{good}\t{text}\nmissing.wav\tfour\n{good2}\n")
    msgs = []
    assert len(asr_data.read_manifest(tsv, "skip", log=msgs.append)) == 1
    assert f"{tsv}:3: audio file not found" in "\n".join(msgs)
    assert f"{tsv}:4: a TSV line must be" in "\n".join(msgs)


def test_short_clips_and_duration_field(tmp_path):
    ((good, text),) = _write_wavs(tmp_path, 1)
    short = tmp_path / "short.wav"
    sf.write(short, np.zeros(int(0.02 * 16000), dtype=np.float32), 16000)  # 20 ms: one fbank frame
    (tmp_path / "junk.wav").write_bytes(b"not audio, but the manifest gives its duration")
    sf.write(tmp_path / "tiny.wav", np.zeros(300, dtype=np.float32), 16000)  # 19 ms
    sf.write(tmp_path / "empty.wav", np.zeros(0, dtype=np.float32), 16000)
    long = json.dumps({"audio": good.name, "text": text, "duration": 9.5})  # the header says less: trusted
    lines = [
        json.dumps({"audio": short.name, "text": "one"}),
        json.dumps({"audio": good.name, "text": text, "duration": 0.03}),
        json.dumps({"audio": "junk.wav", "text": "two", "duration": 1.25}),
        json.dumps({"audio": good.name, "text": text, "duration": "long"}),
        json.dumps({"audio": good.name, "text": text}),
        long,
        # what the file holds of the clip is what is read: too short, past the end, nothing
        json.dumps({"audio": "tiny.wav", "text": "three", "duration": 1.0}),
        json.dumps({"audio": good.name, "text": text, "offset": 100, "duration": 1.0}),
        json.dumps({"audio": "empty.wav", "text": "four"}),
        json.dumps({"audio": good.name, "text": text, "duration": 0.2}),
    ]
    m = tmp_path / "train.jsonl"
    m.write_text("\n".join(lines) + "\n")
    msgs = []
    items = asr_data.read_manifest(m, "skip", log=msgs.append)
    joined = "\n".join(msgs)
    assert f"{m}:1: audio too short: 20 ms" in joined, joined
    assert f"{m}:2: audio too short: 30 ms" in joined, joined
    # a duration is no reason not to read the file's header: audio that cannot be read is found here
    assert f"{m}:3: unreadable audio {tmp_path / 'junk.wav'}: " in joined, joined
    assert f"{m}:4: 'duration' must be a number of seconds" in joined, joined
    assert f"{m}:7: audio too short: 19 ms in {tmp_path / 'tiny.wav'}" in joined, joined
    assert f"{m}:8: 'offset' 100" in joined and "s is past the end of" in joined, joined
    assert f"{m}:9: no audio in {tmp_path / 'empty.wav'}" in joined, joined
    assert f"{m}: skipped 7 bad line(s), kept 3" in joined, joined
    assert [(Path(i[1]).name, i[3]) for i in items] == [
        (good.name, pytest.approx(sf.info(good).duration)),
        (good.name, 9.5),
        (good.name, 0.2),
    ]
    # a clip of "duration" seconds gives the frames the batches were sized by (NeMo reads that much too)
    data = asr_data.SpeechDataset(items[2:], asr_data.CharTokenizer.from_texts([text]))
    assert sf.info(good).duration > 0.3
    assert data[0][0].size(0) == data.num_frames(0) == asr_data.num_frames(3200)
    with pytest.raises(asr_data.ManifestError, match=r"train\.jsonl:1: audio too short"):
        asr_data.read_manifest(m, "stop")
    with pytest.raises(ValueError, match="audio too short"):
        asr_data.fbank(torch.zeros(500))
    assert torch.isfinite(asr_data.fbank(torch.randn(560))).all()  # two frames: the shortest clip kept


def test_tdt_greedy_decoding_jumps_by_the_predicted_duration():
    """With the joiner's output fixed by its bias, the hypotheses follow from the frame counts: a label with
    duration 2 every other frame; duration 0: max_symbols labels a frame, then a forced step; blank: none."""
    from asr_model import Transducer

    torch.manual_seed(0)
    model = Transducer(
        6,
        num_mel_bins=8,
        encoder="lstm",
        encoder_dim=16,
        encoder_layers=1,
        predictor_dim=8,
        joiner_dim=8,
        loss="tdt",
        durations=(0, 1, 2),
        joiner="unfused",
    ).eval()
    x, xl = torch.randn(2, 40, 8), torch.tensor([40, 23])
    frames = model.encoder(x, xl)[1].tolist()
    assert frames[0] != frames[1]
    for token, duration, expected in ((3, 2, lambda n: (n + 1) // 2), (3, 0, lambda n: 4 * n), (0, 0, lambda n: 0)):
        with torch.no_grad():
            model.out.weight.zero_()
            model.out.bias.zero_()
            model.out.bias[token] = 10.0
            model.out.bias[6 + duration] = 10.0
        hyps = model.greedy_decode_tdt(x, xl, max_symbols=4)
        assert [len(h) for h in hyps] == [expected(n) for n in frames], (token, duration)
        assert all(set(h) <= {token} for h in hyps)


@pytest.mark.parametrize("loss_kind", ["rnnt", "tdt"])
def test_autocast_logits_reach_the_loss_as_they_are(loss_kind):
    """Under bf16 autocast the unfused joiner's logits reach the loss in bf16, not copied to float32, and both joiners
    train; the fused and unfused losses agree in float32."""
    from asr_model import Transducer

    x, xl = torch.randn(2, 40, 8), torch.tensor([40, 31])
    y, yl = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([3, 2])
    losses = {}
    for joiner in ("unfused", "fused"):
        torch.manual_seed(0)
        model = Transducer(
            6,
            num_mel_bins=8,
            encoder="lstm",
            encoder_dim=16,
            encoder_layers=1,
            predictor_dim=8,
            joiner_dim=8,
            joiner=joiner,
            loss=loss_kind,
            durations=(0, 1, 2),
            sigma=0.05,
        ).eval()
        seen = []
        if joiner == "unfused":
            model.joiner.criterion.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
        with autocast_lstms(model):  # the encoder's and predictor's, outside autocast where this CPU needs it
            loss = train_toy.forward_loss(model, x, xl, y, yl, torch.bfloat16)
        loss.backward()
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        assert seen == ([torch.bfloat16] if joiner == "unfused" else [])
        losses[joiner] = float(train_toy.forward_loss(model, x, xl, y, yl).detach())  # fp32
    assert losses["fused"] == pytest.approx(losses["unfused"], rel=1e-5)


def test_manifest_training_run(tmp_path, capsys):
    wavs = _write_wavs(tmp_path, 8)
    m = tmp_path / "train.tsv"
    m.write_text("".join(f"{p}\t{t}\n" for p, t in wavs) + "missing.wav\tseven\n")
    r = run(["--manifest", m, "--exp-dir", tmp_path / "exp", "--epochs", 1, "--max-steps", 2])
    out = capsys.readouterr().out
    assert f"{m}:9: audio file not found" in out
    assert "holding out 1 training utterances" in out
    assert np.isfinite(r["test_wer"])
    with pytest.raises(asr_data.ManifestError, match="train.tsv:9"):
        run(["--manifest", m, "--exp-dir", tmp_path / "exp2", "--bad-lines", "stop"])
    # resumed on texts with characters the checkpoint's vocabulary lacks: said, as they leave the targets
    more = tmp_path / "more.tsv"
    more.write_text("".join(f"{p}\t{t}\n" for p, t in wavs[:7]) + f"{wavs[7][0]}\tzwölf ñ\n")
    run(["--manifest", more, "--exp-dir", tmp_path / "exp", "--epochs", 2, "--max-steps", 1, "--resume"])
    assert "the checkpoint's vocabulary lacks ('ñö')" in capsys.readouterr().out

    # a JSON line's duration with audio that cannot be read: reported and skipped, not met in the epoch
    (tmp_path / "junk.flac").write_bytes(b"fLaC" + bytes(200))
    jsonl = tmp_path / "train.jsonl"
    lines = [dict(audio=str(p), text=t, duration=sf.info(p).duration) for p, t in wavs]
    lines.insert(3, dict(audio="junk.flac", text="seven", duration=1.5))
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = run(["--manifest", jsonl, "--exp-dir", tmp_path / "exp3", "--epochs", 1])
    out = capsys.readouterr().out
    assert f"warning: {jsonl}:4: unreadable audio {tmp_path / 'junk.flac'}: " in out, out
    assert f"{jsonl}: skipped 1 bad line(s), kept 8" in out
    assert len(r["history"]) == 1 and np.isfinite(r["step_losses"]).all() and np.isfinite(r["test_wer"])
    with pytest.raises(asr_data.ManifestError, match=re.escape(f"{jsonl}:4: unreadable audio")):
        run(["--manifest", jsonl, "--exp-dir", tmp_path / "exp4", "--bad-lines", "stop"])
    assert not (tmp_path / "exp4").exists()


def test_a_manifest_line_that_is_not_utf8(tmp_path):
    """A line that is not UTF-8 is a bad line like any other, named by file and line; a UTF-8 byte order mark
    is no part of the first line."""
    ((good, text),) = _write_wavs(tmp_path, 1)
    m = tmp_path / "train.tsv"
    m.write_bytes(b"\xef\xbb\xbf" + f"{good}\t{text}\n".encode() + f"{good}\tcaf".encode() + b"\xe9\n")
    msgs = []
    items = asr_data.read_manifest(m, "skip", log=msgs.append)
    assert [(i[1], i[2]) for i in items] == [(str(good), text)]
    assert (
        f"warning: {m}:2: not UTF-8 text (byte 0xe9 at column {len(str(good)) + 5}); manifests are UTF-8; "
        f"skipping this line" in msgs
    )
    with pytest.raises(asr_data.ManifestError, match=re.escape(f"{m}:2: not UTF-8 text (byte 0xe9")):
        asr_data.read_manifest(m, "stop")


def test_nemo_manifest(tmp_path):
    """NeMo's field names, a .json suffix, paths relative to the manifest's folder, NeMo's offset (a segment of
    the file), and bad lines reported with the manifest's path and line number."""
    ((wav, text),) = _write_wavs(tmp_path, 1)
    folder = tmp_path / "nemo"
    (folder / "wavs").mkdir(parents=True)
    wav = wav.rename(folder / "wavs" / "a.wav")
    seconds = sf.info(wav).duration
    lines = [
        {"audio_filepath": "wavs/a.wav", "duration": seconds, "text": text.upper()},
        {"audio_filepath": "wavs/a.wav", "offset": 0.0625, "duration": 0.25, "text": "one"},
        {"audio_filepath": "wavs/missing.wav", "duration": 1.0, "text": "two"},
        {"audio_filepath": "wavs/a.wav", "offset": seconds + 1, "text": "three"},
        {"audio_filepath": "wavs/a.wav", "offset": 0.25, "text": "four"},
    ]
    m = folder / "train_manifest.json"
    m.write_text("".join(json.dumps(x) + "\n" for x in lines) + "audio.wav\tfive\n")
    msgs = []
    items = asr_data.read_manifest(m, "skip", log=msgs.append)
    joined = "\n".join(msgs)
    assert f"{m}:3: audio file not found: {folder / 'wavs' / 'missing.wav'}" in joined, joined
    assert f"{m}:4: 'offset' {seconds + 1} s is past the end of {wav}" in joined, joined
    assert f"{m}:6: not valid JSON" in joined, joined  # a .json manifest is JSON lines throughout
    assert f"{m}: skipped 3 bad line(s), kept 3" in joined, joined
    assert [(i[1], i[2], i[4]) for i in items] == [
        (str(wav), text, None),
        (str(wav), "one", 0.0625),
        (str(wav), "four", 0.25),
    ]
    assert items[0][3] == seconds and items[1][3] == 0.25 and items[2][3] == pytest.approx(seconds - 0.25)
    whole = asr_data.load_audio(str(wav))
    assert len(whole) > 5000
    assert torch.equal(asr_data.load_audio(str(wav), offset=0.0625, seconds=0.25), whole[1000:5000])
    assert torch.equal(asr_data.load_audio(str(wav), offset=0.25), whole[4000:])
    data = asr_data.SpeechDataset(items, asr_data.CharTokenizer.from_texts(i[2] for i in items))
    assert [data.num_frames(i) for i in range(3)] == [
        asr_data.num_frames(n) for n in (len(whole), 4000, len(whole) - 4000)
    ]
    assert [data[i][0].shape[0] for i in range(3)] == [data.num_frames(i) for i in range(3)]
    with pytest.raises(asr_data.ManifestError, match=r"train_manifest\.json:3: audio file not found"):
        asr_data.read_manifest(m, "stop")


def test_toy_corpus_as_manifests_trains_as_the_corpus(corpus, tmp_path):
    """--write-manifests gives NeMo-style manifests of the toy corpus; a --quick run from them takes the same
    steps as one from the corpus itself (the same audio, the same batches)."""
    manifests = run(["--data-dir", corpus, "--write-manifests", tmp_path / "manifests"])["manifests"]
    assert manifests == [str(tmp_path / "manifests" / f"{s}.jsonl") for s in ("train", "dev", "test")]
    lines = [json.loads(x) for x in open(manifests[0])]
    corpus_lines = [json.loads(x) for x in open(corpus / "train.jsonl")]
    assert len(lines) == len(corpus_lines) == train_toy.QUICK["n_train"]
    assert lines[0] == {
        "audio_filepath": f"audio/{corpus_lines[0]['id']}.wav",
        "duration": corpus_lines[0]["samples"] / 16000,
        "text": corpus_lines[0]["text"],
    }
    steps = ["--epochs", 1, "--max-steps", 3]
    a = run(["--data-dir", corpus, "--exp-dir", tmp_path / "corpus_run", *steps])
    b = run(
        [
            "--manifest",
            manifests[0],
            "--dev-manifest",
            manifests[1],
            "--test-manifest",
            manifests[2],
            "--exp-dir",
            tmp_path / "manifest_run",
            *steps,
        ]
    )
    assert len(b["step_losses"]) == 3 and b["step_losses"] == a["step_losses"]
    assert (b["test_wer"], b["test_cer"]) == (a["test_wer"], a["test_cer"])
    assert json.loads((tmp_path / "manifest_run" / "results.json").read_text())["history"] == b["history"]


def test_manifests_are_written_into_data_by_default():
    """--write-manifests without DIR writes into data/ (beside the corpus it is made from, ignored by git)."""
    assert train_toy.parse_args(["--write-manifests"]).write_manifests == "data/toy_manifests"
    assert train_toy.parse_args(["--quick", "--write-manifests"]).write_manifests == "data/toy_manifests_quick"
    assert train_toy.parse_args(["--write-manifests", "mine"]).write_manifests == "mine"
    assert train_toy.parse_args([]).write_manifests is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--epochs", "0"], "must be > 0"),
        (["--lr", "fast"], "is not a float"),
        (["--encoder", "gru"], "invalid choice: 'gru'"),
        (["--test-manifest", "t.jsonl"], "need --manifest"),
        (
            ["--manifest", "m.jsonl", "--write-manifests", "d"],
            "--write-manifests writes the toy corpus; with --manifest",
        ),
        (["--manifest", "m.jsonl", "--write-manifests"], "--write-manifests writes the toy corpus; with --manifest"),
        (["--encoder-dim", "63"], "--encoder-dim must be even"),
        (["--device", "tpu"], "--device must be cpu or cuda"),
        (["--bad-lines", "ignore"], "invalid choice: 'ignore'"),
        (["--loss", "tdt", "--durations", "0,0"], "--durations: expected distinct"),
        (["--loss", "tdt", "--durations", "a"], "--durations must be comma-separated ints"),
        (["--omega", "1"], "--omega must be in [0, 1)"),
        (["--sigma", "0.3"], "--sigma applies to --loss tdt and multiblank"),
        (["--loss", "rna", "--durations", "1,2"], "--durations and --omega apply to --loss tdt"),
        (["--loss", "multiblank", "--omega", "0.1"], "--durations and --omega apply to --loss tdt"),
        (["--big-blank-durations", "2,4"], "--big-blank-durations applies to --loss multiblank"),
        (["--loss", "multiblank", "--big-blank-durations", "1,4"], "--big-blank-durations must be comma-separated"),
        (["--loss", "tdt", "--rna"], "--rna is --loss rna; it contradicts --loss tdt"),
        (["--loss", "tdt", "--durations", "0"], "--durations: expected distinct ints >= 0 with at least one >= 1"),
        (["--lr", "nan"], "--lr: must be a finite number, got nan"),
        (["--clip", "inf"], "--clip: must be a finite number, got inf"),
        (["--loss", "tdt", "--sigma", "nan"], "--sigma: must be a finite number, got nan"),
        (["--weight-decay", "inf"], "--weight-decay: must be a finite number, got inf"),
        (["--quick", "--epoch", "5"], "unrecognized arguments: --epoch 5"),  # --quick would override it
    ],
)
def test_bad_flags(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_toy.parse_args(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_resume_takes_this_runs_learning_rate_and_weight_decay(corpus, tmp_path):
    """--lr and --weight-decay given on --resume are this run's: the optimiser and its schedule take them over the
    checkpoint's, at the step the run has reached."""
    short = ["--data-dir", corpus, "--max-steps", 2, "--exp-dir", tmp_path]
    run([*short, "--epochs", 1, "--lr", 2e-3, "--weight-decay", 0.05])
    run([*short, "--epochs", 2, "--resume", "--lr", 1e-4, "--weight-decay", 0.2])
    saved = torch.load(tmp_path / "epoch-2.pt", map_location="cpu", weights_only=True)
    (group,) = saved["optimizer"]["param_groups"]
    assert (group["initial_lr"], group["weight_decay"]) == (1e-4, 0.2)
    assert saved["scheduler"]["base_lrs"] == [1e-4] and 0 < group["lr"] <= 1e-4
    # not given on --resume: the checkpoint's hold (not the flags' defaults), and its saved flags say so
    run([*short, "--epochs", 3, "--resume"])
    saved = torch.load(tmp_path / "epoch-3.pt", map_location="cpu", weights_only=True)
    (group,) = saved["optimizer"]["param_groups"]
    assert (group["initial_lr"], group["weight_decay"]) == (1e-4, 0.2)
    assert (saved["args"]["lr"], saved["args"]["weight_decay"]) == (1e-4, 0.2)


def test_a_diverged_run_stops_before_saving(corpus, tmp_path):
    with pytest.raises(train_toy.UsageError, match="epoch 1: the train loss is NaN .* lower --lr"):
        run(["--data-dir", corpus, "--exp-dir", tmp_path, "--epochs", 1, "--max-steps", 2, "--lr", 1e6])
    assert not list(tmp_path.glob("epoch-*.pt"))


def test_folders_of_other_data_are_not_overwritten(corpus, tmp_path):
    """--data-dir and --write-manifests write the corpus's files: into a folder holding files of those names that
    the recipe did not write, they refuse (the folder as it was); their own they replace."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.jsonl").write_text('{"audio": "a.wav", "text": "my labels"}\n')
    with pytest.raises(toy_corpus.CorpusError, match=r"--data-dir .*mine: it holds train.jsonl but no toy corpus"):
        run(["--data-dir", mine, "--exp-dir", tmp_path / "run"])
    with pytest.raises(toy_corpus.CorpusError, match=r"--write-manifests .*mine: it holds train.jsonl, which"):
        toy_corpus.write_manifests(corpus, mine)
    assert (mine / "train.jsonl").read_text() == '{"audio": "a.wav", "text": "my labels"}\n'
    assert sorted(p.name for p in mine.iterdir()) == ["train.jsonl"]
    # a synthesis cut short (its files and its mark, no meta.json) is the recipe's own: made again
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "train.jsonl").write_text("")
    (cut / toy_corpus.CORPUS_MARK).write_text("{}\n")
    toy_corpus.check_corpus_folder(cut)
    assert (corpus / toy_corpus.CORPUS_MARK).exists()
    (tmp_path / "afile").write_text("")
    with pytest.raises(toy_corpus.CorpusError, match=r"--data-dir .*afile/d: cannot write there: Not a directory"):
        run(["--data-dir", tmp_path / "afile" / "d", "--exp-dir", tmp_path / "run"])
    with pytest.raises(toy_corpus.CorpusError, match=r"--write-manifests .*afile/m: cannot write there"):
        toy_corpus.write_manifests(corpus, tmp_path / "afile" / "m")
    written = tmp_path / "written"
    for _ in range(2):  # the recipe's own manifests: replaced
        paths = toy_corpus.write_manifests(corpus, written)
    (written / toy_corpus.MANIFESTS_MARK).unlink()  # as a folder written before the mark: its lines say whose
    paths = toy_corpus.write_manifests(corpus, written)
    assert [p.name for p in paths] == ["train.jsonl", "dev.jsonl", "test.jsonl"]


def test_bad_paths_exit_with_clear_errors(corpus, tmp_path):
    for args, message in [
        (["--manifest", str(tmp_path / "nope.jsonl")], "manifest not found"),
        (["--data-dir", str(corpus), "--exp-dir", str(tmp_path), "--resume"], "--resume: no checkpoint"),
        (["--data-dir", str(corpus), "--resume", str(tmp_path / "x.pt")], "--resume: no checkpoint at"),
    ]:
        p = subprocess.run(
            [sys.executable, str(RECIPES / "train_toy.py"), *FAST, *args], capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 1 and message in p.stderr, (args, p.stderr[-2000:])
        assert "Traceback" not in p.stderr


def test_multiblank_loss_and_decoding(corpus, tmp_path):
    r = run(
        [
            "--data-dir",
            corpus,
            "--exp-dir",
            tmp_path,
            "--epochs",
            1,
            "--max-steps",
            3,
            "--loss",
            "multiblank",
            "--big-blank-durations",
            "2,4",
            "--sigma",
            "0.05",
        ]
    )
    assert np.isfinite(r["history"][0]["train_loss"]) and r["loss"] == "multiblank" and r["joiner"] == "fused"
    assert 0 <= r["test_wer"] and r["decode_s"] > 0


def test_multiblank_greedy_decoding_jumps_by_the_big_blank():
    """With the joiner's output fixed by its bias, the hypotheses follow from the frame counts: a label
    max_symbols times a frame, then a forced step; the blank or a big blank: no label, whatever it skips."""
    from asr_model import Transducer

    torch.manual_seed(0)
    model = Transducer(
        6,
        num_mel_bins=8,
        encoder="lstm",
        encoder_dim=16,
        encoder_layers=1,
        predictor_dim=8,
        joiner_dim=8,
        loss="multiblank",
        big_blank_durations=(2, 3),
        joiner="unfused",
    ).eval()
    assert model.out.out_features == 6 + 2 + 1 and model.blank == 8
    x, xl = torch.randn(2, 40, 8), torch.tensor([40, 23])
    frames = model.encoder(x, xl)[1].tolist()
    for column, expected in ((3, lambda n: 4 * n), (8, lambda n: 0), (7, lambda n: 0), (6, lambda n: 0)):
        with torch.no_grad():
            model.out.weight.zero_()
            model.out.bias.zero_()
            model.out.bias[column] = 10.0
        hyps = model.greedy_decode_multiblank(x, xl, max_symbols=4)
        assert [len(h) for h in hyps] == [expected(n) for n in frames], column
        assert all(set(h) <= {column} for h in hyps)
    # a big blank of duration 3 reaches the end in ceil(T / 3) steps: count them through the joiner's calls
    calls = []
    hook = model.out.register_forward_hook(lambda m, i, o: calls.append(1))
    model.greedy_decode_multiblank(x, xl, max_symbols=4)
    hook.remove()
    assert len(calls) == -(-max(frames) // 3)
    # rows that disagree on a step (one emits a label, another a big blank): each decodes as it does alone.
    # Label 3 wins where w.h is above its median over the first frames' joiner states h, big blank 7 elsewhere.
    x, xl = torch.randn(4, 40, 8), torch.tensor([40, 31, 23, 40])
    with torch.no_grad():
        enc = model.enc_proj(model.encoder(x, xl)[0])
        h = torch.tanh(enc + model.pred_proj(model.predictor.initial(4, "cpu")[0]))
        w = torch.randn(8)
        threshold = (h @ w).median()
        model.out.weight.zero_()
        model.out.bias.zero_()
        model.out.weight[3], model.out.bias[3] = 100 * w, -100 * threshold
        model.out.weight[7], model.out.bias[7] = -100 * w, 100 * threshold
    hyps = model.greedy_decode_multiblank(x, xl, max_symbols=2)
    assert any(hyps) and all(set(h) <= {3} for h in hyps)
    assert hyps == [
        model.greedy_decode_multiblank(x[b : b + 1, :n], xl[b : b + 1], max_symbols=2)[0]
        for b, n in enumerate(xl.tolist())
    ]


def test_rnnt_and_rna_greedy_decoding_count_labels_per_frame():
    """With the joiner's output fixed by its bias: RNN-T emits max_symbols labels a frame, RNA one, the blank
    none."""
    from asr_model import Transducer

    x, xl = torch.randn(2, 40, 8), torch.tensor([40, 23])
    for loss, per_frame in (("rnnt", 4), ("rna", 1)):
        torch.manual_seed(0)
        model = Transducer(
            6,
            num_mel_bins=8,
            encoder="lstm",
            encoder_dim=16,
            encoder_layers=1,
            predictor_dim=8,
            joiner_dim=8,
            loss=loss,
            joiner="unfused",
        ).eval()
        frames = model.encoder(x, xl)[1].tolist()
        for column, expected in ((3, per_frame), (0, 0)):
            with torch.no_grad():
                model.out.weight.zero_()
                model.out.bias.zero_()
                model.out.bias[column] = 10.0
            hyps = model.decode(x, xl, max_symbols=4)
            assert [len(h) for h in hyps] == [expected * n for n in frames], (loss, column)
            assert all(set(h) <= {column} for h in hyps)


@pytest.mark.parametrize("loss_kind", ["rnnt", "rna", "tdt", "multiblank"])
@pytest.mark.parametrize("predictor", ["lstm", "stateless"])
def test_greedy_decoding_of_a_batch_is_each_utterance_alone(loss_kind, predictor):
    """Rows that emit on different steps keep their own predictor state: a batch decodes as each utterance does
    alone. Label 3 wins where w.h is above its mean over the first step's joiner states h, the blank elsewhere.
    Lengths are multiples of 4, where the subsampling sees no padding."""
    from asr_model import Transducer

    torch.manual_seed(1)
    model = Transducer(
        6,
        num_mel_bins=8,
        encoder="lstm",
        encoder_dim=16,
        encoder_layers=1,
        predictor=predictor,
        predictor_dim=8,
        joiner_dim=8,
        loss=loss_kind,
        durations=(0, 1, 2),
        big_blank_durations=(2, 3),
        joiner="unfused",
    ).eval()
    xl = torch.tensor([60, 44, 24, 60, 12])
    x = torch.randn(5, 60, 8) * (torch.arange(60) < xl[:, None])[..., None]  # padded with zeros, as collate does
    with torch.no_grad():
        enc, frames = model.encoder(x, xl)
        h = torch.tanh(model.enc_proj(enc) + model.pred_proj(model.predictor.initial(5, "cpu")[0]))
        w = torch.randn(8)
        threshold = (h @ w).mean()
        tokens = model.blank + 1 if loss_kind == "multiblank" else 6  # TDT's duration columns keep their weights
        model.out.weight[:tokens] = 0
        model.out.bias[:tokens] = 0
        model.out.weight[3], model.out.bias[3] = 100 * w, -100 * threshold
        model.out.weight[model.blank], model.out.bias[model.blank] = -100 * w, 100 * threshold
    hyps = model.decode(x, xl, max_symbols=3)
    most = (1 if loss_kind == "rna" else 3) * int(frames.sum())
    assert 0 < sum(map(len, hyps)) < most and all(set(h) <= {3} for h in hyps)
    assert hyps == [model.decode(x[b : b + 1, :n], xl[b : b + 1], max_symbols=3)[0] for b, n in enumerate(xl.tolist())]
