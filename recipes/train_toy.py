#!/usr/bin/env python
"""Train a tiny speech recogniser end to end with this library's losses (RNN-T, RNA, TDT or multi-blank RNN-T).

    python recipes/train_toy.py                    # eSpeak NG toy corpus, made on the first run
    python recipes/train_toy.py --quick            # a smoke test: tiny corpus, tiny model, seconds
    python recipes/train_toy.py --manifest train.jsonl --test-manifest test.jsonl   # your data
    python recipes/train_toy.py --quick --write-manifests   # the toy corpus as such manifests, in data/
    torchrun --nproc_per_node=2 recipes/train_toy.py   # DDP: NCCL on GPUs, gloo on CPU
    torchrun --nproc_per_node=2 recipes/train_toy.py --fsdp   # FSDP2: the model sharded over the processes

Features are 80-dim Kaldi fbank, normalised per utterance, with SpecAugment in
training. The encoder is 4x conv subsampling followed by --encoder-layers layers
of a Conformer (--encoder conformer: torchaudio's, 4 heads, feed-forward
4 x --encoder-dim, convolution kernel 15) or of a bidirectional LSTM
(--encoder lstm: --encoder-dim / 2 units each way). The predictor is an
embedding and a one-layer LSTM (--predictor lstm) or an embedding of the last
2 labels and a Linear (--predictor stateless). The joiner is
out(tanh(enc_proj(enc) + pred_proj(pred))), --joiner-dim wide; by default the
joiner and the loss are fused (``transducer.FusedJoinerLoss``: no logits in
memory), and ``--joiner unfused`` builds compact (sum_b T_b*(U_b+1), V) logits
through ``transducer.pack`` for the loss. ``--loss rnnt|rna|tdt|multiblank`` picks the loss
and the matching greedy decoding. Tokens are characters.
Each epoch writes a checkpoint and a plot of train loss and dev WER to the
run folder (--exp-dir; by default runs/toy/<configuration>, one folder for each
configuration of the model and loss), checked writable with room for a
checkpoint before training; the run ends with greedy-search WER/CER on the test
set, written to results.json there. Under torchrun the processes replicate the
model (DDP), or with --fsdp shard it (FSDP2); a checkpoint holds the whole model
either way, and a run of one kind resumes from the other's.
"""

import argparse
import contextlib
import json
import math
import os
import pickle
import random
import shutil
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import transducer  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(1, str(HERE.parent))

import asr_data  # noqa: E402
import torch  # noqa: E402
from asr_data import BucketSampler, CharTokenizer, SpeechDataset, collate  # noqa: E402
from asr_model import Transducer  # noqa: E402

from transducer.checks import check_big_blank_durations, check_durations  # noqa: E402

QUICK = dict(n_train=96, n_dev=16, n_test=16, max_words=3)


class UsageError(Exception):
    pass


LOSS_NAMES = {"rnnt": "RNN-T", "rna": "RNA", "tdt": "TDT", "multiblank": "multi-blank RNN-T"}


def _number(kind, s):
    """A flag's ``kind`` value, NaN and infinities refused (they would fail only once the data had loaded)."""
    try:
        v = kind(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a {kind.__name__}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {s}")
    return v


def positive(kind):
    def parse(s):
        v = _number(kind, s)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
        return v

    return parse


def finite(s):
    return _number(float, s)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and each flag's default after its help. A flag whose default is
    worked out at run time (None here) says its default in its own help."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser():
    # no abbreviated flags: --quick's defaults give way to the flags a run names, by their full names
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    d = p.add_argument_group("data")
    d.add_argument(
        "--data-dir",
        default=None,
        help="toy corpus cache (default: data/toy_corpus; data/toy_corpus_quick with --quick)",
    )
    d.add_argument(
        "--corpus-size",
        type=positive(int),
        default=5000,
        help="toy corpus: training utterances (default: %(default)s; --quick: 96, whatever is given)",
    )
    d.add_argument(
        "--manifest",
        help="train on this manifest instead of the toy corpus: NeMo's JSON lines "
        "(audio_filepath, duration, text) or TSV (audio path, transcript) (default: none, the toy corpus)",
    )
    d.add_argument("--dev-manifest", help="dev set for the per-epoch WER (default: the test set)")
    d.add_argument("--test-manifest", help="test set (default: 5%% of --manifest, at most 500 utterances)")
    d.add_argument(
        "--write-manifests",
        nargs="?",
        const="",
        metavar="DIR",
        help="write the toy corpus (made first if need be, as --data-dir, --corpus-size, --seed and "
        "--quick say) as NeMo-style JSON-lines manifests DIR/{train,dev,test}.jsonl, the audio as "
        "WAV files in DIR/audio, and exit without training (DIR by default: data/toy_manifests, "
        "data/toy_manifests_quick with --quick)",
    )
    d.add_argument(
        "--bad-lines",
        choices=["skip", "stop"],
        default="skip",
        help="manifest lines that are not UTF-8 or not valid, with missing, unreadable or too short "
        "audio, or with empty text: report them as file:line and skip them, or stop",
    )
    d.add_argument(
        "--workers",
        type=int,
        default=0,
        help="DataLoader worker processes, for training and evaluation (default: %(default)s, the main process)",
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--encoder",
        choices=["conformer", "lstm"],
        default="conformer",
        help="after 4x conv subsampling, conformer: torchaudio's Conformer (4 heads, feed-forward "
        "4 x --encoder-dim, convolution kernel 15); lstm: a bidirectional LSTM "
        "(--encoder-dim / 2 units each way)",
    )
    m.add_argument(
        "--encoder-dim",
        type=positive(int),
        default=144,
        help="encoder width: even, a multiple of 4 for the conformer (default: %(default)s; --quick: 64)",
    )
    m.add_argument(
        "--encoder-layers",
        type=positive(int),
        default=2,
        help="Conformer or LSTM layers (default: %(default)s; --quick: 1)",
    )
    m.add_argument(
        "--predictor",
        choices=["lstm", "stateless"],
        default="lstm",
        help="lstm: an embedding and a one-layer LSTM; stateless: an embedding of the last 2 labels and a Linear",
    )
    m.add_argument(
        "--predictor-dim", type=positive(int), default=128, help="predictor width (default: %(default)s; --quick: 32)"
    )
    m.add_argument(
        "--joiner-dim",
        type=positive(int),
        default=128,
        help="joiner width: out(tanh(enc_proj(enc) + pred_proj(pred))) (default: %(default)s; --quick: 32)",
    )
    m.add_argument(
        "--loss",
        choices=["rnnt", "rna", "tdt", "multiblank"],
        default="rnnt",
        help="rnnt, rna (one symbol per frame), tdt (Token-and-Duration Transducer) or multiblank "
        "(multi-blank RNN-T: big blanks that consume several frames), with the matching greedy "
        "decoding",
    )
    m.add_argument("--rna", action="store_true", help="the same as --loss rna")
    m.add_argument(
        "--joiner",
        choices=["fused", "unfused"],
        default="fused",
        help="fused: joiner and loss in one (transducer.FusedJoinerLoss, no logits in "
        "memory); unfused: compact logits through transducer.pack, then the loss",
    )
    m.add_argument("--durations", help="TDT durations (frames), comma-separated (default: 0,1,2,3,4)")
    m.add_argument(
        "--big-blank-durations",
        help="multi-blank: the big blanks' durations (frames, >= 2), comma-separated (default: 2,4,8)",
    )
    m.add_argument("--sigma", type=finite, help="TDT and multi-blank logit under-normalisation (default: 0.05)")
    m.add_argument("--omega", type=finite, help="TDT: weight of the plain RNN-T loss, in [0, 1) (default: 0)")
    m.add_argument(
        "--fastemit-lambda", type=finite, default=0.0, help="FastEmit regularisation, >= 0 (default: %(default)s, off)"
    )
    m.add_argument(
        "--delay-penalty",
        type=finite,
        default=0.0,
        help="k2's delay penalty on the label log-probs (default: %(default)s, off)",
    )
    t = p.add_argument_group("training")
    t.add_argument(
        "--epochs", type=positive(int), default=12, help="training epochs (default: %(default)s; --quick: 2)"
    )
    t.add_argument(
        "--max-frames",
        type=positive(int),
        default=3000,
        help="padded input frames per batch (default: %(default)s; --quick: 1500)",
    )
    t.add_argument(
        "--lr",
        type=positive(float),
        default=3e-3,
        help="peak learning rate (AdamW; linear warm-up, then cosine decay to 5%% of it)",
    )
    t.add_argument(
        "--warmup",
        type=int,
        default=100,
        help="warm-up steps, at most a fifth of all steps (default: %(default)s; --quick: 5)",
    )
    t.add_argument("--weight-decay", type=finite, default=1e-2, help="AdamW weight decay")
    t.add_argument("--clip", type=positive(float), default=5.0, help="gradient-norm clipping")
    t.add_argument(
        "--max-steps",
        type=positive(int),
        help="at most this many steps in each epoch; the learning-rate schedule spans --epochs "
        "times this (default: every batch of the epoch)",
    )
    t.add_argument("--no-specaug", action="store_true", help="no SpecAugment in training")
    t.add_argument(
        "--no-amp",
        action="store_true",
        help="train in fp32 on a GPU (otherwise bf16 autocast, or fp16 with a gradient scaler where "
        "bf16 is not supported); the CPU trains in fp32 either way",
    )
    t.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun, shard the model over the processes with FSDP2 (torch >= 2.6: "
        "torch.distributed.fsdp.fully_shard), each encoder block, the predictor and the joiner a "
        "unit of its own, then the whole model; otherwise torchrun's processes replicate it (DDP)",
    )
    t.add_argument("--seed", type=int, default=0, help="seed of the toy corpus and of training")
    t.add_argument(
        "--threads",
        type=positive(int),
        default=None,
        help="torch CPU threads per process (default: $OMP_NUM_THREADS, else the cores shared "
        "among local ranks, at most 4 when training on a GPU)",
    )
    t.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    t.add_argument(
        "--exp-dir",
        default=None,
        help="the run folder: checkpoints, plot, results.json and the configuration (config.json: the "
        "model and loss flags); a folder that holds a run of another configuration is refused "
        "(default: the configuration's own folder in runs/toy, runs/toy_quick with --quick, named "
        "by the loss and each model or loss flag that differs from its default, e.g. "
        "runs/toy/tdt_durations=0,1,2_joiner=unfused)",
    )
    t.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        metavar="CKPT",
        help="resume from CKPT, or without CKPT from the latest epoch-N.pt in --exp-dir of the run "
        "that the folder holds (its run.json); a checkpoint of another configuration is refused (default: start afresh, replacing an earlier run of "
        "the configuration in --exp-dir)",
    )
    t.add_argument("--keep-checkpoints", type=positive(int), default=2, help="epoch-N.pt files to keep")
    t.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: a tiny toy corpus (96 training utterances of up to 3 words) and model, "
        "2 epochs; the flags marked '--quick:' take that value unless given",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--show", type=int, default=5, help="reference/hypothesis pairs to print")
    return p


def torch_version():
    """torch's (major, minor)."""
    return tuple(int(x) for x in torch.__version__.split(".")[:2])


def parse_args(argv=None):
    a = parse_flags(argv)
    if a.exp_dir is None:  # the configuration's own folder, named by the settings that differ from their defaults
        defaults = parse_flags(["--loss", a.loss] + ["--quick"] * a.quick)
        a.exp_dir = str(Path(runs_folder(a.quick)) / run_name(run_config(vars(a)), run_config(vars(defaults))))
    return a


def parse_flags(argv):
    """The flags with their defaults filled in and checked; --exp-dir as given."""
    p = build_parser()
    a = p.parse_args(argv)
    given = set(str(x).split("=")[0] for x in (argv if argv is not None else sys.argv[1:]))
    # on --resume the checkpoint's learning rate and weight decay hold unless these are given
    a.lr_given, a.weight_decay_given = "--lr" in given, "--weight-decay" in given
    if a.quick:
        for k, v in dict(
            encoder_dim=64, encoder_layers=1, predictor_dim=32, joiner_dim=32, epochs=2, warmup=5, max_frames=1500
        ).items():
            if "--" + k.replace("_", "-") not in given:
                setattr(a, k, v)
    if a.manifest is None and (a.dev_manifest or a.test_manifest):
        p.error("--dev-manifest/--test-manifest need --manifest")
    if a.manifest and a.data_dir:
        p.error("--data-dir is the toy corpus cache; with --manifest it is not used")
    if a.manifest and a.write_manifests is not None:
        p.error("--write-manifests writes the toy corpus; with --manifest there is none")
    if a.write_manifests is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("--write-manifests runs in one process, not under torchrun")
    if a.fsdp:
        if torch_version() < (2, 6):
            p.error(
                f"--fsdp needs torch >= 2.6 (FSDP2's torch.distributed.fsdp.fully_shard); this is torch "
                f"{torch.__version__}: upgrade torch, or leave --fsdp out to train with DDP"
            )
        if "WORLD_SIZE" not in os.environ:
            p.error(
                "--fsdp shards the model over the processes that torchrun starts: run "
                "torchrun --nproc_per_node=N recipes/train_toy.py --fsdp ..."
            )
    if a.encoder_dim % 2 or (a.encoder == "conformer" and a.encoder_dim % 4):
        p.error("--encoder-dim must be even (a multiple of 4 for the conformer's 4 heads)")
    if a.workers < 0 or a.warmup < 0 or a.weight_decay < 0 or a.show < 0:
        p.error("--workers, --warmup, --weight-decay and --show must be >= 0")
    if a.rna and a.loss != "rnnt":
        p.error(f"--rna is --loss rna; it contradicts --loss {a.loss}")
    if a.rna:
        a.loss = "rna"
    if a.omega is not None and not 0 <= a.omega < 1:
        p.error("--omega must be in [0, 1)")
    if a.loss != "tdt" and (a.durations, a.omega) != (None, None):
        p.error("--durations and --omega apply to --loss tdt")
    if a.loss != "multiblank" and a.big_blank_durations is not None:
        p.error("--big-blank-durations applies to --loss multiblank")
    if a.loss not in ("tdt", "multiblank") and a.sigma is not None:
        p.error("--sigma applies to --loss tdt and multiblank")
    try:
        a.big_blank_durations = [int(d) for d in (a.big_blank_durations or "2,4,8").split(",")]
        check_big_blank_durations(a.big_blank_durations, None)
    except ValueError as e:
        p.error(f"--big-blank-durations must be comma-separated distinct ints >= 2 ({e})")
    a.durations = "0,1,2,3,4" if a.durations is None else a.durations
    a.sigma = 0.05 if a.sigma is None else a.sigma
    a.omega = 0.0 if a.omega is None else a.omega
    try:
        a.durations = [int(d) for d in a.durations.split(",")]
    except ValueError:
        p.error(f"--durations must be comma-separated ints, got {a.durations!r}")
    try:
        check_durations(a.durations)
    except ValueError as e:
        p.error(f"--{e}")  # "--durations must be ..."
    if not 0 <= a.omega < 1 or a.fastemit_lambda < 0:
        p.error("--omega must be in [0, 1) and --fastemit-lambda >= 0")
    if a.device and a.device.split(":")[0] not in ("cpu", "cuda"):
        p.error(f"--device must be cpu or cuda, got {a.device!r}")
    if a.device and a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU is available")
    a.data_dir = a.data_dir or ("data/toy_corpus_quick" if a.quick else "data/toy_corpus")
    if a.write_manifests == "":
        a.write_manifests = "data/toy_manifests_quick" if a.quick else "data/toy_manifests"
    return a


# ---------------------------------------------------------------------- run folders

# A run's configuration: the settings that change the model or the loss it is trained with. A run folder holds the
# checkpoints and results of one configuration, written in its config.json; the other flags (the data, --epochs,
# --lr, --seed, --threads, ...) may change from one run of a configuration to the next, and on --resume.
CONFIG = (
    "loss",
    "durations",
    "big_blank_durations",
    "sigma",
    "omega",
    "fastemit_lambda",
    "delay_penalty",
    "joiner",
    "encoder",
    "encoder_dim",
    "encoder_layers",
    "predictor",
    "predictor_dim",
    "joiner_dim",
)
# the losses that read each loss setting; the others are read by every loss
LOSSES_OF = dict(durations=("tdt",), omega=("tdt",), big_blank_durations=("multiblank",), sigma=("tdt", "multiblank"))


def runs_folder(quick):
    """The folder of the run folders."""
    return "runs/toy_quick" if quick else "runs/toy"


def run_config(flags):
    """The configuration of the run that ``flags`` (a dict of parsed flags) describe: {setting: value}, without
    the settings that its loss does not read."""
    return {k: flags.get(k) for k in CONFIG if flags["loss"] in LOSSES_OF.get(k, (flags["loss"],))}


def flag_value(value):
    """A setting's value as its flag is written: 0,1,2 for a list."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def run_name(config, defaults):
    """The folder name of a configuration: the loss, then flag=value for each setting that differs from its
    default, in CONFIG's order; for example rnnt, tdt_durations=0,1,2 or rna_joiner=unfused_encoder=lstm."""
    return "_".join(
        [config["loss"]]
        + [f"{k.replace('_', '-')}={flag_value(v)}" for k, v in config.items() if k != "loss" and v != defaults.get(k)]
    )


def config_differences(there, here):
    """The settings in which configuration ``here`` differs from ``there``: "--loss rnnt there, tdt here; ..."."""
    both = [k for k in CONFIG if k in there and k in here and there[k] != here[k]]
    keys = both or [k for k in CONFIG if there.get(k) != here.get(k)]  # or a setting only one side has
    return "; ".join(
        f"--{k.replace('_', '-')} {flag_value(there[k]) if k in there else 'not set'} there, "
        f"{flag_value(here[k]) if k in here else 'not set'} here"
        for k in keys
    )


def checkpoint_config(ckpt):
    """A checkpoint's configuration (from its flags where it predates the "config" entry)."""
    return ckpt["config"] if "config" in ckpt else run_config(ckpt["args"])


def folder_config(exp):
    """The configuration of the run in folder ``exp``: its config.json, else its latest checkpoint's; None where
    it holds no run."""
    path = Path(exp) / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            raise UsageError(f"{path} is not valid JSON: delete it if {exp} holds no run you want to keep") from None
    latest = latest_checkpoint(exp)
    return None if latest is None else checkpoint_config(load_checkpoint(latest))


def check_run_folder(exp, config, quick):
    """Refuse a folder that holds a run of another configuration: its checkpoints would mix with this run's."""
    found = folder_config(exp)
    if found is not None and found != config:
        raise UsageError(
            f"--exp-dir {exp} holds a run of another configuration ({config_differences(found, config)}); "
            f"a run folder keeps the checkpoints and results of one configuration. Give --exp-dir "
            f"another folder (without --exp-dir each configuration has its own in {runs_folder(quick)}/), "
            f"or delete {exp} to reuse it"
        )


def earlier_checkpoints(exp, resumed_from, ckpt):
    """The checkpoints in ``exp`` that this run does not continue: all of them when it starts afresh or resumes
    from a checkpoint elsewhere; when it resumes from ``ckpt`` in ``exp``, those of other runs and those after the
    resumed epoch."""
    found = checkpoints(exp)
    if resumed_from is not None and resumed_from.resolve().parent == Path(exp).resolve():
        return [c for c in found if checkpoint_epoch(c) > ckpt["epoch"] or checkpoint_run(c) != ckpt.get("run_id")]
    return found


# ---------------------------------------------------------------------- distributed


def default_threads(threads, device):
    """CPU threads: too many per process (cores x ranks) makes small ops crawl."""
    if threads:
        return threads
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    n = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return min(n, 4) if device.startswith("cuda") else n


class Dist:
    def __init__(self, device, fsdp=False):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device(device)
        self.group = self.world > 1 or fsdp  # FSDP needs a process group even for one process
        if self.group:
            import torch.distributed as dist

            if self.device.type == "cuda":
                self.device = torch.device("cuda", self.local_rank)
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    @property
    def main(self):
        return self.rank == 0

    def sum(self, values):
        """Sum a list of numbers over ranks."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t.tolist()

    def broadcast(self, value):
        """The first process's ``value`` (a picklable object), on every process."""
        if self.world > 1:
            import torch.distributed as dist

            box = [value]
            dist.broadcast_object_list(box, 0, device=self.device if self.device.type == "cuda" else None)
            return box[0]
        return value

    def sync_buffers(self, model):
        """Give every rank rank 0's buffers (BatchNorm statistics move with each rank's own data)."""
        if self.world > 1:
            import torch.distributed as dist

            for b in model.buffers():
                dist.broadcast(b.data, 0)

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def close(self, ok=True):
        """Tear the process group down on every rank together. Whatever holds it (DDP's reducer) must be
        gone first: a gloo group destroyed at interpreter exit can abort the process ("terminate called
        without an active exception"), so the caller drops its references and we collect them here."""
        if self.group:
            import gc

            import torch.distributed as dist

            gc.collect()
            if ok:
                dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)
            dist.destroy_process_group()


# ---------------------------------------------------------------------- FSDP2


def shard(model):
    """FSDP2 over all processes: each encoder block (a Conformer layer, or the LSTM), the predictor and the joiner
    (the loss and its output Linear, whose weight the fused loss reads in the joiner's forward) a unit of its own,
    then the model (the subsampling and the joiner's input projections)."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    # the LSTM predictor's output is a view; FSDP warns that an in-place op on it would skip a hook, and the
    # model reads it out of place only
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPPredictor\) returned a view tensor")
    encoder = model.encoder
    blocks = list(encoder.conformer.conformer_layers) if encoder.kind == "conformer" else [encoder.rnn]
    for unit in [*blocks, model.predictor, model.joiner]:
        fully_shard(unit)
    fully_shard(model)


def units(model):
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model, fsdp):
    """Every FSDP unit's parameters whole, and kept whole across forward calls, for greedy search: it calls the
    joiner's and the predictor's layers outside their modules' forward, where FSDP would not gather them."""
    if not fsdp:
        yield
        return
    for unit in units(model):
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units(model):
            unit.reshard()
            if unit is not model:  # the root keeps FSDP's default for it: not resharded after forward
                unit.set_reshard_after_forward(True, recurse=False)


def full_model_state(model, fsdp):
    """The model's state dict, whole: under FSDP gathered from every process (all must call) onto the first
    process's CPU (the others get an empty dict)."""
    if not fsdp:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_state(model, optimizer, fsdp):
    """The model's and the optimiser's state dicts, whole and on the CPU, as torch's own state_dict() gives them
    (the optimiser's keyed by parameter index): under FSDP gathered from every process (all must call), on the
    first process only (the others get empty dicts)."""
    if not fsdp:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model_state = full_model_state(model, fsdp)
    optimizer_state = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not optimizer_state:
        return model_state, optimizer_state
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return model_state, dict(
        state={index[k]: v for k, v in optimizer_state["state"].items()},
        param_groups=[dict(g, params=[index[n] for n in g["params"]]) for g in optimizer_state["param_groups"]],
    )


def load_optimizer_state(model, optimizer, state, fsdp):
    """Load a whole optimiser state dict (torch's, keyed by parameter index) into ``optimizer``; under FSDP each
    process keeps its shards of it."""
    if not fsdp:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [name for name, _ in model.named_parameters()]
    by_name = dict(
        state={names[i]: v for i, v in state["state"].items()},
        param_groups=[dict(g, params=[names[i] for i in g["params"]]) for g in state["param_groups"]],
    )
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------- data


def toy_corpus_config(a):
    import toy_corpus

    return toy_corpus.corpus_config(seed=a.seed, **(QUICK if a.quick else dict(n_train=a.corpus_size)))


def write_manifests(a):
    """The toy corpus as NeMo-style manifests in --write-manifests (--help); their paths."""
    import toy_corpus

    toy_corpus.ensure_corpus(a.data_dir, toy_corpus_config(a))
    paths = [str(m) for m in toy_corpus.write_manifests(a.data_dir, a.write_manifests)]
    print(
        f"manifests: {', '.join(paths)}; to train on them:\n  python recipes/train_toy.py "
        f"{'--quick ' if a.quick else ''}--manifest {paths[0]} --dev-manifest {paths[1]} --test-manifest {paths[2]}"
    )
    return paths


def load_data(a, dist, log):
    """(train, dev, test) item lists [(id, waveform or path, text, ...)]."""
    if a.manifest:
        read = lambda path: asr_data.read_manifest(path, a.bad_lines, log=log if dist.main else lambda *_: None)  # noqa: E731
        train = read(a.manifest)
        if a.test_manifest:
            test = read(a.test_manifest)
        else:
            train, test = asr_data.split_off(train, 0.05, 500, a.seed)
            log(f"no --test-manifest: holding out {len(test)} training utterances as the test set")
        dev = read(a.dev_manifest) if a.dev_manifest else test
        return train, dev, test
    import toy_corpus

    if dist.main:
        toy_corpus.ensure_corpus(a.data_dir, toy_corpus_config(a), log)
    dist.barrier()
    return tuple(toy_corpus.load_split(a.data_dir, s) for s in ("train", "dev", "test"))


def spec_augment(x):
    """SpecAugment on (B, T, F) normalised features: 2 frequency masks, 2 time masks (masked to 0)."""
    import torchaudio.transforms as AT

    x = x.transpose(1, 2).unsqueeze(1)  # (B, 1, F, T)
    for mask in (
        AT.FrequencyMasking(15, iid_masks=True),
        AT.FrequencyMasking(15, iid_masks=True),
        AT.TimeMasking(20, iid_masks=True, p=0.2),
        AT.TimeMasking(20, iid_masks=True, p=0.2),
    ):
        x = mask(x)
    return x.squeeze(1).transpose(1, 2)


def forward_loss(net, x, xl, y, yl, amp_dtype=None):
    """The training loss of one batch; the model (joiner and loss included) under autocast to ``amp_dtype``
    when given: its GEMMs run in that dtype, the loss arithmetic in fp32 (asr_model.Transducer)."""
    with torch.autocast(x.device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
        return net(x, xl, y, yl)


# ---------------------------------------------------------------------- metrics


def evaluate(model, dataset, tokenizer, a, dist, max_frames):
    """Greedy-search WER and CER (%) over the dataset, summed over ranks; some (ref, hyp) pairs."""
    with gathered(model, a.fsdp):
        return _evaluate(model, dataset, tokenizer, a, dist, max_frames)


def _evaluate(model, dataset, tokenizer, a, dist, max_frames):
    model.eval()
    sampler = BucketSampler(
        [dataset.num_frames(i) for i in range(len(dataset))],
        max_frames,
        shuffle=False,
        rank=dist.rank,
        world=dist.world,
    )
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=a.workers)
    from torchaudio.functional import edit_distance

    counts, pairs = [0, 0, 0, 0], []
    t0 = time.time()
    for batch, (x, xl, _, _, texts) in zip(sampler, loader):
        hyps = model.decode(x.to(dist.device), xl.to(dist.device))
        for i, ref, h in zip(batch, texts, hyps):
            hyp = " ".join(tokenizer.decode(h).split())
            counts[0] += edit_distance(ref.split(), hyp.split())
            counts[1] += len(ref.split())
            counts[2] += edit_distance(ref, hyp)
            counts[3] += len(ref)
            pairs.append((i, ref, hyp))
    we, wn, ce, cn = dist.sum(counts)
    model.train()
    evaluate.seconds = time.time() - t0
    return 100 * we / max(wn, 1), 100 * ce / max(cn, 1), [p[1:] for p in sorted(pairs)]


# ---------------------------------------------------------------------- checkpoints, plot


def rng_state():
    return dict(
        python=random.getstate(),
        torch=torch.get_rng_state(),
        cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    )


def set_rng_state(s):
    random.setstate(s["python"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def checkpoint_epoch(path):
    try:
        return int(path.stem.split("-")[1])
    except (IndexError, ValueError):
        return -1


def checkpoints(exp):
    """The epoch-N.pt files in ``exp``, by epoch."""
    return sorted(Path(exp).glob("epoch-*.pt"), key=checkpoint_epoch)


RUN_FILE = "run.json"  # the id of the run whose checkpoints the run folder holds


def folder_run(exp):
    """The id of the run in folder ``exp`` (its run.json), or None (a folder of no run, or of a recipe before run
    ids: every checkpoint there is then taken as the run's)."""
    path = Path(exp) / RUN_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["run_id"]
    except (ValueError, KeyError, TypeError):
        raise UsageError(
            f'{path} is not a run id file ({{"run_id": ...}}): delete it if {exp} holds no run you want to keep'
        ) from None


def checkpoint_run(path):
    """The run id in a checkpoint (None in one from before run ids); its tensors are mapped, not read."""
    return load_checkpoint(path, mmap=True).get("run_id")


def latest_checkpoint(exp, run_id=None):
    """The latest checkpoint in ``exp``; with ``run_id``, the latest of that run."""
    for path in reversed(checkpoints(exp)):
        if run_id is None or checkpoint_run(path) == run_id:
            return path
    return None


def param_digest(state):
    """A digest of a model's state dict."""
    import hashlib

    h = hashlib.sha1()
    for _, p in sorted(state.items()):
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_atomically(path, text):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(path, **state):
    """``state`` into ``path`` (through a temporary file): tensors, numbers, strings and plain containers only (the
    state dicts of the model, the optimiser, the scheduler and the scaler are such), which load_checkpoint loads."""
    tmp = Path(str(path) + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


# what every checkpoint holds; "config" too, or in those from before it "args" (checkpoint_config)
CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "history", "rng", "chars")


def torch_reason(e):
    """What torch says is wrong, without its advice: the WeightsUnpickler error, or the paragraphs between its
    first ("Weights only load failed...") and its last ("Check the documentation...")."""
    text = str(e)
    if "WeightsUnpickler error: " in text:
        return text.split("WeightsUnpickler error: ")[-1].split("\n")[0].split(". ")[0].strip()
    paragraphs = [x.strip() for x in text.split("\n\n") if x.strip()]
    if paragraphs and paragraphs[0].startswith("Weights only load failed"):
        paragraphs = [x for x in paragraphs[1:] if not x.startswith("Check the documentation")]
    return " ".join(" ".join(paragraphs).split()).rstrip(".") or type(e).__name__


def load_checkpoint(path, mmap=False):
    """A checkpoint's state, loaded with ``weights_only=True``: a file that holds any object other than tensors,
    numbers, strings and plain containers is refused, since unpickling one could run any code. An empty,
    truncated or incomplete file is refused too; each error names the file and what is wrong with it."""
    path = Path(path)
    if path.is_file() and path.stat().st_size == 0:
        raise UsageError(f"{path} is empty, not a checkpoint (a save cut short?): delete it, or resume from another")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            raise UsageError(
                f"{path} is not a checkpoint of this recipe: it holds objects other than tensors, "
                f"numbers, strings and plain containers ({torch_reason(e)}), and those are not loaded: "
                f"unpickling them could run any code"
            ) from None
        raise UsageError(
            f"{path} cannot be read as a checkpoint ({torch_reason(e)}): truncated, or not written by "
            f"torch.save; delete it, or resume from another"
        ) from None
    except Exception as e:  # torch.load's errors for a truncated or foreign file: RuntimeError, EOFError, ...
        reason = str(e).split(". ")[0].strip() or "no data"
        raise UsageError(
            f"{path} cannot be read as a checkpoint ({type(e).__name__}: {reason}): truncated, or not "
            f"written by torch.save; delete it, or resume from another"
        ) from None
    if not isinstance(state, dict):
        raise UsageError(f"{path} is not a checkpoint of this recipe: it holds a {type(state).__name__}, not a dict")
    missing = [k for k in CHECKPOINT_KEYS if k not in state] + (
        [] if "config" in state or "args" in state else ["config"]
    )
    if missing:
        raise UsageError(
            f"{path} is not a complete checkpoint of this recipe: it has no {', '.join(missing)} "
            f"(a checkpoint holds {', '.join(CHECKPOINT_KEYS)} and config)"
        )
    return state


@contextlib.contextmanager
def loading(path, what):
    """Errors of loading a checkpoint's ``what`` into this run, naming the checkpoint."""
    try:
        yield
    except (RuntimeError, KeyError, ValueError, IndexError, TypeError) as e:
        raise UsageError(
            f"--resume: {path}: its {what} does not fit this run ({type(e).__name__}: {' '.join(str(e).split())[:500]})"
        ) from None


def run_folder_problem(exp, size):
    """Why the run folder ``exp`` cannot take a checkpoint of ``size`` bytes, or None: it is made if need be, a
    file is written there and removed, and its file system's free space is compared with ``size``."""
    exp = Path(exp)
    probe = exp / f".write-test-{os.getpid()}"
    try:
        exp.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        where = f" ({e.filename})" if e.filename and Path(e.filename) not in (exp, probe) else ""
        return (
            f"--exp-dir {exp}: cannot write there: {e.strerror or e}{where}; give --exp-dir a folder that can "
            f"be written"
        )
    free = shutil.disk_usage(exp).free
    if free < size:
        return (
            f"--exp-dir {exp}: {free / 2**20:.1f} MiB free on its file system, and a checkpoint takes about "
            f"{size / 2**20:.1f} MiB: free some space, or give --exp-dir a folder on another file system"
        )
    return None


def plot(history, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, ax1 = plt.subplots(figsize=(6, 4))
    ax1.plot(epochs, [h["train_loss"] for h in history], "o-", color="tab:blue")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("train loss (per utterance)", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(epochs, [h["dev_wer"] for h in history], "s-", color="tab:red")
    ax2.set_ylabel("dev WER (%)", color="tab:red")
    ax1.set_title("train_toy.py")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------- main


def main(argv=None):
    a = parse_args(argv)
    if a.write_manifests:
        return dict(manifests=write_manifests(a))
    t_start = time.time()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(default_threads(a.threads, device))
    dist = Dist(device, a.fsdp)
    ok = False
    try:
        result = train(a, dist, t_start)  # its DDP wrapper and loaders are gone when it returns
        ok = True
    finally:
        dist.close(ok)
    return result


def train(a, dist, t_start):
    device = dist.device
    log = print if dist.main else (lambda *_, **__: None)
    random.seed(a.seed)
    torch.manual_seed(a.seed)

    exp = Path(a.exp_dir)
    config = run_config(vars(a))
    check_run_folder(exp, config, a.quick)
    ckpt = path = None
    if a.resume:
        path = latest_checkpoint(exp, folder_run(exp)) if a.resume == "auto" else Path(a.resume)
        if path is None and latest_checkpoint(exp) is not None:
            raise UsageError(
                f"--resume: {exp} holds no checkpoint of its current run ({folder_run(exp)}, in "
                f"{exp / RUN_FILE}), only of another ({', '.join(c.name for c in checkpoints(exp))}): "
                f"give one of those to --resume to continue that run, or leave --resume out to start "
                f"afresh"
            )
        if path is None or not path.is_file():
            raise UsageError(f"--resume: no checkpoint at {path or exp / 'epoch-N.pt'}")
        ckpt = load_checkpoint(path)
        if checkpoint_config(ckpt) != config:
            raise UsageError(
                f"--resume: {path} is a checkpoint of another configuration "
                f"({config_differences(checkpoint_config(ckpt), config)}); resume it with the flags it "
                f"was trained with, or leave --resume out to start afresh"
            )
    # a run's checkpoints carry its id, and the run folder names the run that its checkpoints continue
    run_id = (ckpt.get("run_id") if ckpt else None) or dist.broadcast(uuid.uuid4().hex)
    earlier = earlier_checkpoints(exp, path, ckpt)
    if ckpt:
        log(f"resuming from {path} (epoch {ckpt['epoch']} done)")
    if earlier:
        log(
            f"{exp} holds checkpoints of an earlier run of this configuration ({', '.join(c.name for c in earlier)}): "
            f"they and its results.json are removed once this run has saved its first checkpoint"
            + ("" if a.resume else " (--resume continues that run instead)")
        )
        earlier.append(exp / "results.json")
    train_items, dev_items, test_items = load_data(a, dist, log)
    if ckpt is not None:
        tokenizer = CharTokenizer(ckpt["chars"])
        unknown = sorted(set("".join(x[2] for x in train_items)) - set(tokenizer.chars))
        if unknown:  # the model's vocabulary is the checkpoint's: these never reach the targets
            log(
                f"warning: the training texts hold {len(unknown)} character(s) the checkpoint's vocabulary lacks "
                f"({''.join(unknown)!r}): they are left out of the targets"
            )
    else:
        tokenizer = CharTokenizer.from_texts(x[2] for x in train_items)
    precompute = not a.manifest
    train_set = SpeechDataset(train_items, tokenizer, precompute=precompute)
    dev_set = SpeechDataset(dev_items, tokenizer, precompute=precompute)
    test_set = dev_set if test_items is dev_items else SpeechDataset(test_items, tokenizer, precompute=precompute)
    t_data = time.time() - t_start
    log(
        f"data: {len(train_set)} train / {len(dev_set)} dev / {len(test_set)} test utterances, "
        f"{len(tokenizer)} tokens ({time.time() - t_start:.1f} s)"
    )

    model = Transducer(
        len(tokenizer),
        encoder=a.encoder,
        encoder_dim=a.encoder_dim,
        encoder_layers=a.encoder_layers,
        predictor=a.predictor,
        predictor_dim=a.predictor_dim,
        joiner_dim=a.joiner_dim,
        joiner=a.joiner,
        loss=a.loss,
        durations=a.durations,
        sigma=a.sigma,
        omega=a.omega,
        fastemit_lambda=a.fastemit_lambda,
        delay_penalty=a.delay_penalty,
        big_blank_durations=a.big_blank_durations,
    ).to(device)
    log(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {a.encoder} encoder, "
        f"{a.predictor} predictor, {a.joiner} joiner, {LOSS_NAMES[a.loss]} loss, device {device}, world {dist.world}"
        + (", sharded (FSDP2)" if a.fsdp else ", replicated (DDP)" if dist.world > 1 else "")
    )
    if ckpt is not None:
        # checkpoints from before the joiner was a module name its output Linear "out"
        state = {("joiner.output." + k[4:] if k.startswith("out.") else k): v for k, v in ckpt["model"].items()}
        with loading(path, "model"):
            model.load_state_dict(state)
    # a checkpoint: the parameters, and AdamW's two moments of each
    size = 3 * sum(p.numel() * p.element_size() for p in model.parameters()) + 2**20
    problem = dist.broadcast(run_folder_problem(exp, size) if dist.main else None)
    if problem:
        raise UsageError(problem)
    if a.fsdp:
        shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    sampler = BucketSampler(
        [train_set.num_frames(i) for i in range(len(train_set))],
        a.max_frames,
        seed=a.seed,
        rank=dist.rank,
        world=dist.world,
    )
    steps_per_epoch = min(len(sampler), a.max_steps or len(sampler))
    total = steps_per_epoch * a.epochs
    warmup = min(a.warmup, max(1, total // 5))

    def lr_factor(step):  # linear warm-up, then cosine decay to 5%
        if step < warmup:
            return (step + 1) / warmup
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    amp = device.type == "cuda" and not a.no_amp
    amp_dtype = torch.bfloat16 if amp and torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=amp and amp_dtype == torch.float16)
    if a.fsdp and scaler.is_enabled():  # its inf checks would see one process's shards only
        raise UsageError(
            "--fsdp trains in bf16 autocast or fp32; this GPU has no bf16, and fp16's gradient scaler "
            "does not work across FSDP's shards: add --no-amp"
        )

    start_epoch, history = 0, []
    if ckpt is not None:
        with loading(path, "optimiser, scheduler, scaler or random-number state"):
            load_optimizer_state(model, optimizer, ckpt["optimizer"], a.fsdp)
            scheduler.load_state_dict(ckpt["scheduler"])
            scaler.load_state_dict(ckpt["scaler"])
            set_rng_state(ckpt["rng"][dist.rank] if dist.rank < len(ckpt["rng"]) else ckpt["rng"][0])
        start_epoch, history = ckpt["epoch"], ckpt["history"]
        # the learning rate and weight decay given to this run over the checkpoint's, and this run's schedule
        # (over its --epochs) at the step the run has reached; the flags saved with its checkpoints as they hold
        if a.lr_given:
            scheduler.base_lrs = [a.lr] * len(optimizer.param_groups)
        for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
            group.update(initial_lr=base, lr=base * lr_factor(scheduler.last_epoch))
            if a.weight_decay_given:
                group["weight_decay"] = a.weight_decay
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        a.lr, a.weight_decay = scheduler.base_lrs[0], optimizer.param_groups[0]["weight_decay"]
    net = model
    if dist.world > 1 and not a.fsdp:
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    loader = torch.utils.data.DataLoader(
        train_set, batch_sampler=sampler, collate_fn=collate, num_workers=a.workers, persistent_workers=a.workers > 0
    )
    step_losses = []
    for epoch in range(start_epoch, a.epochs):
        sampler.set_epoch(epoch)
        net.train()
        t0, sums = time.time(), [0.0, 0, 0]  # loss * utts, utts, frames
        bar = None
        if dist.main and not a.no_progress:
            from tqdm import tqdm

            bar = tqdm(
                total=steps_per_epoch, desc=f"epoch {epoch + 1}/{a.epochs}", unit="step", dynamic_ncols=True, leave=True
            )
        lv = 0.0  # the last step's loss
        for step, (x, xl, y, yl, _) in enumerate(loader):
            if step >= steps_per_epoch:
                break
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            if not a.no_specaug:
                x = spec_augment(x)
            loss = forward_loss(net, x, xl, y, yl, amp_dtype if amp else None)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            lv = loss.item()
            step_losses.append(lv)
            sums[0] += lv * x.size(0)
            sums[1] += x.size(0)
            sums[2] += int(xl.sum())
            if bar is not None:
                el = time.time() - t0
                bar.set_postfix(
                    loss=f"{lv:.3f}",
                    utt_s=f"{sums[1] * dist.world / el:.0f}",
                    audio_x=f"{sums[2] * dist.world / 100 / el:.0f}",
                    lr=f"{scheduler.get_last_lr()[0]:.1e}",
                )
                bar.update()
        if bar is not None:
            bar.close()
        dist.sync_buffers(model)
        loss_sum, n_utts, _ = dist.sum(sums)
        train_loss = loss_sum / max(n_utts, 1)
        # the epoch's last step NaN on any process: NaN weights (fp16's gradient scaler skips a step that
        # overflowed, and an infinite loss is an utterance with no alignment)
        if dist.sum([float(math.isnan(lv))])[0]:
            raise UsageError(
                f"epoch {epoch + 1}: the train loss is NaN (the run diverged); nothing of this epoch is saved: "
                f"lower --lr, or --resume from the last checkpoint"
            )
        dev_wer, dev_cer, _ = evaluate(model, dev_set, tokenizer, a, dist, a.max_frames)
        history.append(
            dict(epoch=epoch + 1, train_loss=train_loss, dev_wer=dev_wer, dev_cer=dev_cer, seconds=time.time() - t0)
        )
        log(
            f"epoch {epoch + 1}: train loss {train_loss:.3f}, dev WER {dev_wer:.2f}% CER {dev_cer:.2f}% "
            f"({time.time() - t0:.0f} s)"
        )
        rngs = [None] * dist.world
        if dist.world > 1:
            import torch.distributed as tdist

            tdist.all_gather_object(rngs, rng_state())
        else:
            rngs = [rng_state()]
        model_state, optimizer_state = full_state(model, optimizer, a.fsdp)
        if dist.main:
            saved = exp / f"epoch-{epoch + 1}.pt"
            exp.mkdir(parents=True, exist_ok=True)
            # the folder names this run before it holds the run's first checkpoint: --resume then takes this run's
            # checkpoints only, also where a kill leaves the earlier run's beside them
            if folder_run(exp) != run_id:
                write_atomically(exp / RUN_FILE, json.dumps(dict(run_id=run_id)) + "\n")
            save_checkpoint(
                saved,
                model=model_state,
                optimizer=optimizer_state,
                scheduler=scheduler.state_dict(),
                scaler=scaler.state_dict(),
                epoch=epoch + 1,
                history=history,
                rng=rngs,
                chars=tokenizer.chars,
                args=vars(a),
                config=config,
                run_id=run_id,
            )
            # the folder holds a run of this configuration from its first checkpoint on
            (exp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
            plot(history, exp / "train.png")
            if epoch == start_epoch:
                log(f"run folder: {exp}/ ({saved.name}, config.json, train.png; results.json at the end)")
            for old in earlier:  # the earlier run's files, now that this run has a checkpoint of its own
                if old.name != saved.name:
                    old.unlink(missing_ok=True)
            earlier = []
            for old in checkpoints(exp)[: -a.keep_checkpoints]:
                old.unlink()
        dist.barrier()

    if a.fsdp:  # each process holds its shards: the digest of the whole model, on the first process
        state = full_model_state(model, a.fsdp)
        digests = [param_digest(state)] if dist.main else []
    elif dist.world > 1:  # DDP keeps replicas in step; check it
        import torch.distributed as tdist

        digests = [None] * dist.world
        tdist.all_gather_object(digests, param_digest(model.state_dict()))
        log(f"DDP: parameters {'agree' if len(set(digests)) == 1 else 'DIFFER'} across {dist.world} ranks")
    else:
        digests = [param_digest(model.state_dict())]
    test_wer, test_cer, pairs = evaluate(model, test_set, tokenizer, a, dist, a.max_frames)
    decode_s = evaluate.seconds
    wall = time.time() - t_start
    log(
        f"test ({len(test_set)} utterances{', held-out voices' if not a.manifest else ''}): "
        f"WER {test_wer:.2f}%  CER {test_cer:.2f}%  ({LOSS_NAMES[a.loss]} greedy decoding {decode_s:.1f} s)"
    )
    for ref, hyp in pairs[: a.show]:  # this rank's first utterances in corpus order
        log(f"  REF: {ref}\n  HYP: {hyp}{'' if ref == hyp else '   <- error'}")
    log(f"total {wall:.0f} s (data {t_data:.0f} s); checkpoint, plot and results in {exp}/")
    result = dict(
        test_wer=test_wer,
        test_cer=test_cer,
        decode_s=decode_s,
        loss=a.loss,
        joiner=a.joiner,
        config=config,
        history=history,
        wall_s=wall,
        data_s=t_data,
        world=dist.world,
        device=str(device),
        param_digests=digests,
        step_losses=step_losses,
    )
    if dist.main:
        exp.mkdir(parents=True, exist_ok=True)  # a run resumed from its last epoch saved no checkpoint here
        (exp / "results.json").write_text(json.dumps({k: v for k, v in result.items() if k != "step_losses"}, indent=1))
    result["model"] = model
    return result


if __name__ == "__main__":
    import toy_corpus

    try:
        main()
    except (UsageError, asr_data.ManifestError, toy_corpus.CorpusError) as e:
        sys.exit(f"error: {e}")
