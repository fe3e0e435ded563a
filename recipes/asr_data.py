"""Data for the toy recipe: manifests, character tokens, fbank features, length buckets."""

import json
import math
import random
from pathlib import Path

import torch

SAMPLE_RATE = 16000
FRAME_SHIFT = 160  # 10 ms at 16 kHz
FRAME_LENGTH = 400  # 25 ms at 16 kHz
# Per-utterance normalisation needs two fbank frames (one frame has no standard deviation): 35 ms.
MIN_SECONDS = (FRAME_LENGTH + FRAME_SHIFT) / SAMPLE_RATE
AUDIO_KEYS = ("audio", "audio_filepath", "path", "wav")
TEXT_KEYS = ("text", "transcript", "sentence")
JSON_SUFFIXES = (".jsonl", ".json")  # NeMo names its JSON-lines manifests .json


class ManifestError(ValueError):
    """A manifest line that cannot be used; the message names the file and line."""


def normalise_text(text):
    return " ".join(text.lower().split())


# ---------------------------------------------------------------------- manifests


def _parse_seconds(r, key):
    """The field ``key`` of a JSON line in seconds, or None where it is absent."""
    value = r.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"'{key}' must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _parse_line(line, suffix):
    """(audio, text, seconds or None, offset or None) of one manifest line, or raise ValueError saying what is
    wrong."""
    if suffix in JSON_SUFFIXES or (suffix != ".tsv" and line.lstrip().startswith("{")):
        try:
            r = json.loads(line)
        except ValueError as e:
            raise ValueError(f"not valid JSON ({e})") from None
        if not isinstance(r, dict):
            raise ValueError("a JSONL line must be an object with 'audio' and 'text'")
        audio = next((r[k] for k in AUDIO_KEYS if k in r), None)
        text = next((r[k] for k in TEXT_KEYS if k in r), None)
        if audio is None:
            raise ValueError(f"no audio path (one of the keys {', '.join(AUDIO_KEYS)})")
        if text is None:
            raise ValueError(f"no transcript (one of the keys {', '.join(TEXT_KEYS)})")
        return str(audio), str(text), _parse_seconds(r, "duration"), _parse_seconds(r, "offset")
    parts = line.rstrip("\r\n").split("\t")
    if len(parts) < 2:
        raise ValueError("a TSV line must be: audio path <TAB> transcript")
    return parts[0], "\t".join(parts[1:]), None, None


def read_manifest(path, on_error="skip", log=print):
    """Utterances of a JSON-lines or TSV manifest: [(id, audio path, text, seconds, offset or None)].

    JSON lines (NeMo's manifests; .jsonl, .json, or any file whose lines start
    with "{"): one object per line with an audio path ("audio", "audio_filepath",
    "path" or "wav") and a transcript ("text", "transcript" or "sentence").
    TSV: ``path<TAB>transcript``; a first line ``audio<TAB>text`` is a header.
    Relative paths are relative to the manifest's folder. Each file's header
    is read here, so that unreadable audio is found before training; a JSON
    line's "duration" (seconds) is taken as the clip's length when present,
    else the header's. NeMo's "offset" (seconds) makes the utterance the part
    of the file from there: "duration" seconds of it, or to its end. A line
    that is not UTF-8 text, whose file is missing or unreadable, whose clip is
    shorter than two feature frames (``MIN_SECONDS``), or whose transcript is
    empty, is reported as ``file:line: reason`` and skipped
    (``on_error="skip"``) or stops the run (``"stop"``).
    """
    import soundfile as sf

    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest not found: {path}")
    suffix = path.suffix.lower()
    items, skipped = [], 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); manifests are UTF-8"
                    ) from None
                if not line.strip() or line.startswith("#"):
                    continue
                audio, text, seconds, offset = _parse_line(line, suffix)
                if lineno == 1 and suffix not in JSON_SUFFIXES and audio.lower() in AUDIO_KEYS:
                    continue  # TSV header
                text = normalise_text(text)
                if not text:
                    raise ValueError("empty transcript")
                audio_path = Path(audio).expanduser()
                if not audio_path.is_absolute():
                    audio_path = path.parent / audio_path
                if not audio_path.is_file():
                    raise ValueError(f"audio file not found: {audio_path}")
                try:
                    info = sf.info(str(audio_path))
                except Exception as e:  # soundfile raises its own error types
                    raise ValueError(f"unreadable audio {audio_path}: {e}") from None
                # the clip: "duration" seconds from "offset" (or the file's start), or to the file's end; what the
                # file holds of it is what load_audio reads
                file_seconds = info.frames / info.samplerate
                held = file_seconds - (offset or 0.0)
                if held <= 0:
                    raise ValueError(
                        f"'offset' {offset} s is past the end of {audio_path} ({file_seconds:.2f} s)"
                        if offset
                        else f"no audio in {audio_path}"
                    )
                if seconds is None:
                    seconds = held
                if min(seconds, held) < MIN_SECONDS:
                    raise ValueError(
                        f"audio too short: {min(seconds, held) * 1000:.0f} ms in {audio_path} (at least "
                        f"{MIN_SECONDS * 1000:.0f} ms, two feature frames, are needed)"
                    )
            except ValueError as e:
                if on_error == "stop":
                    raise ManifestError(f"{where}: {e}  (--bad-lines skip to skip such lines)") from None
                log(f"warning: {where}: {e}; skipping this line")
                skipped += 1
                continue
            items.append((f"{path.stem}-{lineno}", str(audio_path), text, seconds, offset))
    if skipped:
        log(f"warning: {path}: skipped {skipped} bad line(s), kept {len(items)}")
    if not items:
        raise ManifestError(f"{path}: no usable utterances")
    return items


def load_audio(path, offset=None, seconds=None):
    """Mono float32 waveform at 16 kHz: ``seconds`` of the file from ``offset`` (from its start where ``offset``
    is None, to its end where ``seconds`` is None), as NeMo reads a manifest's clip."""
    import soundfile as sf

    with sf.SoundFile(path) as f:
        sr = f.samplerate
        if offset is not None:
            f.seek(round(offset * sr))
        frames = round(seconds * sr) if seconds is not None else -1
        x = f.read(frames, dtype="float32", always_2d=True)
    x = torch.from_numpy(x).mean(1)
    if sr != SAMPLE_RATE:
        import torchaudio.functional as AF

        x = AF.resample(x, sr, SAMPLE_RATE)
    return x


# ---------------------------------------------------------------------- tokens


class CharTokenizer:
    """Characters as tokens; id 0 is the blank."""

    def __init__(self, chars):
        self.chars = list(chars)
        self.index = {c: i + 1 for i, c in enumerate(self.chars)}

    @classmethod
    def from_texts(cls, texts):
        return cls(sorted(set("".join(texts))))

    def __len__(self):
        return len(self.chars) + 1

    def encode(self, text):
        return [self.index[c] for c in text if c in self.index]

    def decode(self, ids):
        return "".join(self.chars[i - 1] for i in ids if 0 < i <= len(self.chars))


# ---------------------------------------------------------------------- features


def fbank(waveform, num_mel_bins=80, dither=0.0):
    """80-dim Kaldi-compatible log-mel fbank, normalised per utterance: (frames, 80), frames >= 2."""
    import torchaudio.compliance.kaldi as kaldi

    if waveform.numel() < MIN_SECONDS * SAMPLE_RATE:
        raise ValueError(
            f"audio too short: {waveform.numel()} samples at {SAMPLE_RATE} Hz (at least "
            f"{MIN_SECONDS * 1000:.0f} ms, two feature frames, are needed)"
        )
    x = kaldi.fbank(
        waveform.unsqueeze(0) * 32768,
        num_mel_bins=num_mel_bins,
        sample_frequency=SAMPLE_RATE,
        dither=dither,
        energy_floor=0.0,
    )
    return (x - x.mean(0)) / (x.std(0) + 1e-5)


def num_frames(samples):
    """The fbank frames of a clip of ``samples`` samples at 16 kHz."""
    return max(1, (samples - FRAME_LENGTH) // FRAME_SHIFT + 1)


class SpeechDataset(torch.utils.data.Dataset):
    """Utterances -> (features, token ids, text). An utterance is (id, waveform tensor, text) or a manifest's
    (id, audio path, text, seconds, offset)."""

    def __init__(self, items, tokenizer, num_mel_bins=80, precompute=False):
        self.items, self.tokenizer, self.num_mel_bins = items, tokenizer, num_mel_bins
        self.tokens = [torch.tensor(tokenizer.encode(item[2]), dtype=torch.long) for item in items]
        self.cache = [self._features(i) for i in range(len(items))] if precompute else None

    def num_frames(self, i):
        audio = self.items[i][1]
        if isinstance(audio, torch.Tensor):
            return num_frames(audio.numel())
        return num_frames(round(self.items[i][3] * SAMPLE_RATE))  # manifest item: seconds

    def _features(self, i):
        item = self.items[i]
        if isinstance(item[1], torch.Tensor):
            return fbank(item[1], self.num_mel_bins)
        try:
            wav = load_audio(item[1], offset=item[4], seconds=item[3])
        except Exception as e:  # soundfile's own error types: a file that changed, or is corrupt past its header
            raise ManifestError(f"unreadable audio {item[1]} (utterance {item[0]}): {e}") from None
        return fbank(wav, self.num_mel_bins)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        feats = self.cache[i] if self.cache is not None else self._features(i)
        return feats, self.tokens[i], self.items[i][2]


def collate(batch):
    feats, tokens, texts = zip(*batch)
    feat_lens = torch.tensor([f.size(0) for f in feats], dtype=torch.long)
    tok_lens = torch.tensor([t.numel() for t in tokens], dtype=torch.long)
    x = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
    y = (
        torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True)
        if max(tok_lens) > 0
        else torch.zeros(len(tokens), 1, dtype=torch.long)
    )
    return x, feat_lens, y, tok_lens, list(texts)


class BucketSampler(torch.utils.data.Sampler):
    """Batches of similar length, at most ``max_frames`` padded frames and ``max_batch`` utterances.

    Lengths are jittered by up to 10% per epoch, so batches differ from epoch to
    epoch, then sorted; the batch order is shuffled. With ``world > 1`` each rank
    takes every ``world``-th batch of the same list, cut to a multiple of ``world``
    batches, so all ranks run the same number of steps. Deterministic given
    (seed, epoch). ``shuffle=False`` keeps sorted order (evaluation).
    """

    def __init__(self, lengths, max_frames, max_batch=512, shuffle=True, seed=0, rank=0, world=1):
        self.lengths, self.max_frames, self.max_batch = list(lengths), max_frames, max_batch
        self.shuffle, self.seed, self.rank, self.world = shuffle, seed, rank, world
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def batches(self):
        rng = random.Random(self.seed * 100003 + self.epoch)
        if self.shuffle:
            keys = [n * (1 + 0.1 * rng.random()) for n in self.lengths]
        else:
            keys = self.lengths
        order = sorted(range(len(self.lengths)), key=lambda i: keys[i])
        batches, cur, longest = [], [], 0
        for i in order:
            n = max(longest, self.lengths[i])
            if cur and (n * (len(cur) + 1) > self.max_frames or len(cur) >= self.max_batch):
                batches.append(cur)
                cur, n = [], self.lengths[i]
            cur.append(i)
            longest = n
        if cur:
            batches.append(cur)
        if self.shuffle:
            rng.shuffle(batches)
        if self.world > 1:
            if self.shuffle:
                batches = batches[: len(batches) // self.world * self.world]
            batches = batches[self.rank :: self.world]
        return batches

    def __iter__(self):
        return iter(self.batches())

    def __len__(self):
        return len(self.batches())


def num_subsampled(n):
    """Frames after the encoder's two stride-2 convolutions (kernel 3, padding 1)."""
    for _ in range(2):
        n = (n - 1) // 2 + 1
    return n


def split_off(items, fraction, max_n, seed):
    """Deterministically move a fraction of items (at most max_n) into a held-out list."""
    idx = list(range(len(items)))
    random.Random(seed).shuffle(idx)
    n = max(1, min(max_n, math.ceil(len(items) * fraction)))
    held = set(idx[:n])
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]
