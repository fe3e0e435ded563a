"""A small spoken corpus synthesised with eSpeak NG, made on first use and cached.

eSpeak NG comes from the ``espeakng-loader`` wheel (``libespeak-ng`` plus its
voice data); we drive the C library through ctypes in synchronous mode, with a
synthesis callback that collects the 16-bit samples. Each utterance is a random
string of words from a small vocabulary (digits and a few dozen short words),
spoken by a voice = English accent + voice variant, at a random rate, pitch,
pitch range and word gap. Some variants are held out: dev and test are spoken
only by variants never heard in training.

The corpus is a function of its config (seed, sizes): the same config gives the
same text, voices and audio. eSpeak NG keeps state from one utterance to the
next (its pitch flutter runs on), so the same text can come out a few samples
different later in a process; hence utterances are synthesised in fixed chunks,
each in a fresh worker process (which also spreads the work over the cores).
On disk, under ``<data_dir>/``::

    meta.json                 the config it was made from (a mismatch remakes it)
    {train,dev,test}.jsonl    one utterance per line: id, text, voice, rate, pitch, offset, samples
    {train,dev,test}.npy      all the split's 16 kHz int16 samples, concatenated
"""

import ctypes
import json
import os
import random
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
VERSION = 3

SPLITS = ("train", "dev", "test")
#: written into the folders make_corpus and write_manifests write: a later call may replace what a folder holds
#: where it carries its mark (a synthesis cut short leaves its files and the mark, no meta.json), nowhere else
CORPUS_MARK = "toy_corpus_folder.json"
MANIFESTS_MARK = "toy_corpus_manifests.json"


class CorpusError(ValueError):
    """A folder that holds files of other data where the corpus or its manifests would be written."""


DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
WORDS = [
    "yes",
    "no",
    "up",
    "down",
    "left",
    "right",
    "on",
    "off",
    "stop",
    "go",
    "red",
    "green",
    "blue",
    "black",
    "white",
    "cat",
    "dog",
    "bird",
    "fish",
    "house",
    "tree",
    "sun",
    "moon",
    "star",
    "big",
    "small",
    "hot",
    "cold",
    "open",
    "close",
]
VOCABULARY = DIGITS + WORDS

ACCENTS = ["en", "en-us", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-us-nyc"]
# Voice variants (espeak-ng-data/voices/!v). The odd ones (whisper, robots,
# croak, ...) are left out: the task is words, not voice effects.
VARIANTS = [
    "m1",
    "m2",
    "m3",
    "m4",
    "m5",
    "m6",
    "m7",
    "m8",
    "f1",
    "f2",
    "f3",
    "f4",
    "f5",
    "adam",
    "Alex",
    "Alicia",
    "Andrea",
    "Andy",
    "anika",
    "Annie",
    "aunty",
    "belinda",
    "benjamin",
    "boris",
    "caleb",
    "david",
    "Denis",
    "Diogo",
    "ed",
    "edward",
    "Gene",
    "grandma",
    "grandpa",
    "gustave",
    "Henrique",
    "Hugo",
    "ian",
    "iven",
    "Jacky",
    "john",
    "Lee",
    "linda",
    "Marco",
    "Mario",
    "max",
    "Michael",
    "michel",
    "miguel",
    "Mike",
    "Nguyen",
    "norbert",
    "pablo",
    "paul",
    "pedro",
    "quincy",
    "Reed",
    "rob",
    "robert",
    "sandro",
    "shelby",
    "steph",
    "travis",
    "victor",
    "zac",
]
# Held out: heard only in dev / only in test.
DEV_VARIANTS = ["m5", "f3", "benjamin", "linda", "Mario", "victor"]
TEST_VARIANTS = ["m6", "f4", "caleb", "grandma", "Hugo", "Michael", "norbert", "steph"]

# espeak_PARAMETER
_RATE, _VOLUME, _PITCH, _RANGE, _WORDGAP = 1, 2, 3, 4, 7
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_CHARS_UTF8 = 1


class Espeak:
    """eSpeak NG through ctypes, synchronous mode. One per process (the C library is global)."""

    _instance = None

    @classmethod
    def get(cls):
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        try:
            import espeakng_loader
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise SystemExit(
                "the toy corpus needs eSpeak NG from the 'espeakng-loader' package: "
                'pip install -e ".[recipes]" (or pass --manifest to train on your own data)'
            ) from e
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        lib.espeak_Synth.restype = ctypes.c_int
        lib.espeak_Synchronize.restype = ctypes.c_int
        # Variants with breath noise draw from a generator seeded from the clock unless seeded.
        self._set_seed = getattr(lib, "espeak_ng_SetRandSeed", None)
        if self._set_seed is not None:
            self._set_seed.argtypes = [ctypes.c_long]
        self.sample_rate = lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0
        )
        if self.sample_rate <= 0:
            raise RuntimeError("espeak_Initialize failed")
        self._chunks = []
        cb_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
        self._callback = cb_type(self._collect)  # keep a reference: the library holds the pointer
        lib.espeak_SetSynthCallback(self._callback)
        self.lib = lib

    def _collect(self, wav, numsamples, events):
        if numsamples > 0 and wav:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(numsamples,)).copy())
        return 0  # 0: go on synthesising

    def has_voice(self, voice):
        return self.lib.espeak_SetVoiceByName(voice.encode()) == 0

    def synth(self, text, voice, rate=175, pitch=50, pitch_range=50, word_gap=0, seed=0):
        """int16 samples at ``self.sample_rate`` (22050 Hz)."""
        lib = self.lib
        if self._set_seed is not None:
            self._set_seed(seed)
        if lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"eSpeak NG has no voice {voice!r}")
        for param, value in (
            (_RATE, rate),
            (_PITCH, pitch),
            (_RANGE, pitch_range),
            (_WORDGAP, word_gap),
            (_VOLUME, 100),
        ):
            lib.espeak_SetParameter(param, int(value), 0)
        self._chunks = []
        data = text.encode()
        err = lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        lib.espeak_Synchronize()
        if err != 0:
            raise RuntimeError(f"espeak_Synth failed ({err}) on {text!r}")
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)


def _trim(x, threshold=200, margin=1600):
    """Cut leading/trailing silence, keeping ``margin`` samples (0.1 s at 16 kHz)."""
    loud = np.flatnonzero(np.abs(x) > threshold)
    if loud.size == 0:
        return x
    return x[max(0, loud[0] - margin) : loud[-1] + margin]


def corpus_config(seed=0, n_train=4000, n_dev=200, n_test=400, min_words=1, max_words=6):
    return dict(
        version=VERSION,
        seed=seed,
        n_train=n_train,
        n_dev=n_dev,
        n_test=n_test,
        min_words=min_words,
        max_words=max_words,
    )


def plan_split(rng, n, voices, min_words, max_words):
    """Text and voice settings of ``n`` utterances (no audio yet)."""
    plan = []
    for _ in range(n):
        k = rng.randint(min_words, max_words)
        plan.append(
            dict(
                text=" ".join(rng.choice(VOCABULARY) for _ in range(k)),
                voice=rng.choice(voices),
                rate=rng.randint(130, 230),
                pitch=rng.randint(25, 75),
                range=rng.randint(20, 80),
                gap=rng.randint(0, 3),
                seed=rng.randrange(2**31),
            )
        )
    return plan


def _available_voices():
    """(accents, {split: variants}) that this eSpeak NG has."""
    espeak = Espeak.get()
    variants = {
        name: [v for v in names if espeak.has_voice(f"en+{v}")]
        for name, names in (
            ("train", [v for v in VARIANTS if v not in DEV_VARIANTS + TEST_VARIANTS]),
            ("dev", DEV_VARIANTS),
            ("test", TEST_VARIANTS),
        )
    }
    return [a for a in ACCENTS if espeak.has_voice(a)], variants


def _worker(job, out):
    """In a fresh process: synthesise the utterances planned in ``job`` (JSON) into ``out`` (.npz)."""
    espeak = Espeak.get()
    plan = json.loads(Path(job).read_text())
    if plan == "voices":
        Path(out).write_text(json.dumps(_available_voices()))
        return
    xs = [espeak.synth(p["text"], p["voice"], p["rate"], p["pitch"], p["range"], p["gap"], p["seed"]) for p in plan]
    np.savez(out, sample_rate=espeak.sample_rate, lengths=np.array([len(x) for x in xs]), audio=np.concatenate(xs))


def _run_fresh(jobs, workers, tmp):
    """Run each job (a JSON-able plan) in its own new Python process, ``workers`` at a time."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    def run(i):
        job, out = Path(tmp) / f"job{i}.json", Path(tmp) / f"out{i}"
        job.write_text(json.dumps(jobs[i]))
        p = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(job), str(out)],
            capture_output=True,
            text=True,
        )
        if p.returncode != 0:
            raise RuntimeError(f"eSpeak NG worker failed:\n{p.stderr[-3000:]}")
        return out

    with ThreadPoolExecutor(max(1, min(workers, len(jobs)))) as pool:
        return list(pool.map(run, range(len(jobs))))


CHUNK = 250  # utterances per worker process


def _make_folder(folder, flag, given):
    """Make ``folder``; a CorpusError naming ``flag`` and the folder ``given`` where it cannot be made."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CorpusError(f"{flag} {given}: cannot write there: {e.strerror or e}") from None


def make_corpus(data_dir, config, log=print, workers=None):
    """Synthesise the corpus described by ``config`` into ``data_dir``."""
    import tempfile

    import torch
    import torchaudio.transforms as AT

    workers = workers or os.cpu_count() or 1
    data_dir = Path(data_dir)
    _make_folder(data_dir, "--data-dir", data_dir)
    (data_dir / CORPUS_MARK).write_text(json.dumps(dict(made_by="recipes/toy_corpus.py")) + "\n")
    (data_dir / "meta.json").unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir) as tmp:
        accents, variants = json.loads(_run_fresh(["voices"], 1, tmp)[0].read_text())
        rng = random.Random(config["seed"])
        plans = {}
        for split in ("train", "dev", "test"):
            voices = [f"{a}+{v}" for a in accents for v in variants[split]]
            plans[split] = (
                plan_split(rng, config[f"n_{split}"], voices, config["min_words"], config["max_words"]),
                len(voices),
            )
        everything = [p for split in plans for p in plans[split][0]]
        outs = _run_fresh([everything[i : i + CHUNK] for i in range(0, len(everything), CHUNK)], workers, tmp)
        synthesised, sample_rate = [], None
        for out in outs:
            with np.load(Path(str(out) + ".npz")) as z:
                sample_rate = int(z["sample_rate"])
                synthesised += np.split(z["audio"], np.cumsum(z["lengths"])[:-1])
    synthesised = iter(synthesised)
    resample = AT.Resample(sample_rate, SAMPLE_RATE)  # builds its filter once
    for split, (plan, n_voices) in plans.items():
        audio, offset = [], 0
        with open(data_dir / f"{split}.jsonl", "w") as f:
            for i, p in enumerate(plan):
                x = resample(torch.from_numpy(next(synthesised).astype(np.float32)))
                x = _trim(x.round().clamp(-32768, 32767).to(torch.int16).numpy())
                audio.append(x)
                f.write(json.dumps(dict(id=f"{split}-{i:06d}", offset=offset, samples=len(x), **p)) + "\n")
                offset += len(x)
        np.save(data_dir / f"{split}.npy", np.concatenate(audio))
        hours = offset / SAMPLE_RATE / 3600
        speakers = len({p["voice"] for p in plan})
        log(
            f"toy corpus: {split}: {len(plan)} utterances, {hours:.2f} h, spoken by {speakers} of the split's "
            f"{n_voices} voices"
        )
    with open(data_dir / "meta.json", "w") as f:  # written last: its presence marks a complete corpus
        json.dump(config, f)


def load_split(data_dir, split):
    """[(id, float32 waveform tensor at 16 kHz, text)] of one split."""
    import torch

    data_dir = Path(data_dir)
    audio = np.load(data_dir / f"{split}.npy", mmap_mode="r")
    items = []
    with open(data_dir / f"{split}.jsonl") as f:
        for line in f:
            r = json.loads(line)
            x = torch.from_numpy(np.asarray(audio[r["offset"] : r["offset"] + r["samples"]], dtype=np.float32) / 32768)
            items.append((r["id"], x, r["text"]))
    return items


def _manifests_of_this_recipe(manifest):
    """Whether ``manifest``'s first line is one write_manifests writes (a folder written before it left its mark)."""
    try:
        with open(manifest) as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return (
        isinstance(first, dict)
        and set(first) == {"audio_filepath", "duration", "text"}
        and str(first["audio_filepath"]).startswith("audio/")
    )


def write_manifests(data_dir, out_dir):
    """Write the corpus in ``data_dir`` as NeMo-style JSON-lines manifests, ``out_dir/{train,dev,test}.jsonl``:
    one line per utterance, ``{"audio_filepath": "audio/<id>.wav", "duration": seconds, "text": ...}``, the path
    relative to the manifest's folder, the audio as 16-bit WAV files in ``out_dir/audio``. Returns the
    manifests' paths."""
    import soundfile as sf

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    others = [f"{split}.jsonl" for split in SPLITS if (out_dir / f"{split}.jsonl").exists()]
    if others and not (out_dir / MANIFESTS_MARK).exists() and not _manifests_of_this_recipe(out_dir / others[0]):
        raise CorpusError(
            f"--write-manifests {out_dir}: it holds {', '.join(others)}, which this recipe did not write; give "
            f"--write-manifests another folder"
        )
    _make_folder(out_dir / "audio", "--write-manifests", out_dir)
    (out_dir / MANIFESTS_MARK).write_text(json.dumps(dict(data_dir=str(data_dir))) + "\n")
    manifests = []
    for split in ("train", "dev", "test"):
        audio = np.load(data_dir / f"{split}.npy", mmap_mode="r")
        manifests.append(out_dir / f"{split}.jsonl")
        with open(data_dir / f"{split}.jsonl") as src, open(manifests[-1], "w") as f:
            for line in src:
                r = json.loads(line)
                wav = f"audio/{r['id']}.wav"
                sf.write(
                    out_dir / wav,
                    np.asarray(audio[r["offset"] : r["offset"] + r["samples"]]),
                    SAMPLE_RATE,
                    subtype="PCM_16",
                )
                f.write(
                    json.dumps(dict(audio_filepath=wav, duration=r["samples"] / SAMPLE_RATE, text=r["text"])) + "\n"
                )
    return manifests


def check_corpus_folder(data_dir):
    """CorpusError where ``data_dir`` holds files of the corpus's names that no synthesis of it wrote."""
    data_dir = Path(data_dir)
    others = [
        f"{split}.{ext}" for split in SPLITS for ext in ("jsonl", "npy") if (data_dir / f"{split}.{ext}").exists()
    ]
    if others and not (data_dir / "meta.json").exists() and not (data_dir / CORPUS_MARK).exists():
        raise CorpusError(
            f"--data-dir {data_dir}: it holds {', '.join(others)} but no toy corpus (no meta.json), which "
            f"synthesising the corpus would overwrite; give --data-dir a new folder, or train on your data with "
            f"--manifest"
        )


def ensure_corpus(data_dir, config, log=print):
    """Make the corpus unless ``data_dir`` already holds one with this config."""
    meta = Path(data_dir) / "meta.json"
    check_corpus_folder(data_dir)
    if meta.exists():
        try:
            if json.loads(meta.read_text()) == config:
                return False
        except ValueError:
            pass
        log(f"toy corpus: {data_dir} holds another config; remaking it")
    log(f"toy corpus: synthesising into {data_dir} (once; cached for later runs)")
    make_corpus(data_dir, config, log)
    return True


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
        sys.exit(0)
    import argparse
    import time

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="data/toy_corpus")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t0 = time.time()
    ensure_corpus(a.data_dir, corpus_config(seed=a.seed))
    print(f"{time.time() - t0:.1f} s")
