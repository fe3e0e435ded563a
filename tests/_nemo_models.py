"""Tiny NeMo transducer models built from a config on the CPU (no download): a one-layer, 32-wide Conformer, an
LSTM decoder and NeMo's RNNTJoint, as char, BPE (a SentencePiece model trained on the spot), hybrid char and
hybrid BPE models; and their training step outside Lightning."""

import logging
import os
import tempfile
from types import SimpleNamespace

import torch
from nemo.utils import logging as nemo_logging
from omegaconf import OmegaConf

nemo_logging.setLevel(logging.ERROR)

LABELS = list(" abcdefghijklmnopqrstuvwxyz'")
DURATIONS = [0, 1, 2, 3, 4]
BIG_BLANK_DURATIONS = [2, 4]
WIDTH = 32
CLASSES = {
    "char": "EncDecRNNTModel",
    "bpe": "EncDecRNNTBPEModel",
    "hybrid_char": "EncDecHybridRNNTCTCModel",
    "hybrid_bpe": "EncDecHybridRNNTCTCBPEModel",
}
_tokenizer_dir = None


def tokenizer_dir():
    """A 40-token SentencePiece BPE model, trained once per session."""
    global _tokenizer_dir
    if _tokenizer_dir is None:
        from nemo.collections.common.tokenizers.sentencepiece_tokenizer import create_spt_model

        _tokenizer_dir = tempfile.mkdtemp(prefix="transducer_spe_")
        text = os.path.join(_tokenizer_dir, "text.txt")
        with open(text, "w") as f:
            f.write("the quick brown fox jumps over the lazy dog\nagain and again we go\nhello world\n" * 70)
        create_spt_model(
            text, vocab_size=40, sample_size=-1, do_lower_case=True, tokenizer_type="bpe", output_dir=_tokenizer_dir
        )
    return _tokenizer_dir


def config(
    kind="char",
    loss="default",
    activation="tanh",
    dropout=0.0,
    fuse_loss_wer=False,
    fused_batch_size=2,
    reduction="mean_batch",
):
    """cfg.model of a tiny model; TDT and multi-blank losses with durations 0-4 or big blanks 2 and 4, sigma
    0.05."""
    cfg = {
        "sample_rate": 16000,
        "log_prediction": False,
        "compute_eval_loss": True,
        "rnnt_reduction": reduction,
        "model_defaults": {"enc_hidden": WIDTH, "pred_hidden": WIDTH, "joint_hidden": WIDTH},
        "preprocessor": {
            "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
            "sample_rate": 16000,
            "normalize": "per_feature",
            "window_size": 0.025,
            "window_stride": 0.01,
            "features": 16,
            "n_fft": 512,
            "dither": 0.0,
            "pad_to": 0,
        },
        "spec_augment": None,
        "encoder": {
            "_target_": "nemo.collections.asr.modules.ConformerEncoder",
            "feat_in": 16,
            "n_layers": 1,
            "d_model": WIDTH,
            "feat_out": -1,
            "subsampling": "striding",
            "subsampling_factor": 4,
            "subsampling_conv_channels": 8,
            "ff_expansion_factor": 2,
            "n_heads": 2,
            "conv_kernel_size": 3,
            "dropout": 0.0,
            "dropout_pre_encoder": 0.0,
            "dropout_emb": 0.0,
            "dropout_att": 0.0,
        },
        "decoder": {
            "_target_": "nemo.collections.asr.modules.RNNTDecoder",
            "blank_as_pad": True,
            "prednet": {"pred_hidden": WIDTH, "pred_rnn_layers": 1, "dropout": 0.0},
        },
        "joint": {
            "_target_": "nemo.collections.asr.modules.RNNTJoint",
            "log_softmax": None,
            "fuse_loss_wer": fuse_loss_wer,
            "fused_batch_size": fused_batch_size,
            "jointnet": {"joint_hidden": WIDTH, "activation": activation, "dropout": dropout},
        },
        "decoding": {"strategy": "greedy_batch", "greedy": {"max_symbols": 5}},
        "loss": {"loss_name": loss},
    }
    if loss == "tdt":
        cfg["joint"]["num_extra_outputs"] = len(DURATIONS)
        cfg["decoding"].update(model_type="tdt", durations=DURATIONS)
        cfg["loss"]["tdt_kwargs"] = dict(durations=DURATIONS, sigma=0.05)
    elif loss.startswith("multiblank"):
        cfg["joint"]["num_extra_outputs"] = len(BIG_BLANK_DURATIONS)
        cfg["decoding"].update(model_type="multiblank", big_blank_durations=BIG_BLANK_DURATIONS)
        cfg["loss"][f"{loss}_kwargs"] = dict(big_blank_durations=BIG_BLANK_DURATIONS, sigma=0.05)
    if kind.endswith("char"):
        cfg["labels"] = LABELS
    else:
        cfg["tokenizer"] = {"dir": tokenizer_dir(), "type": "bpe"}
    if kind.startswith("hybrid"):
        cfg["aux_ctc"] = {
            "ctc_loss_weight": 0.3,
            "ctc_reduction": "mean_batch",
            "decoding": {"strategy": "greedy"},
            "decoder": {
                "_target_": "nemo.collections.asr.modules.ConvASRDecoder",
                "feat_in": None,
                "num_classes": -1,
                "vocabulary": LABELS if kind == "hybrid_char" else [],
            },
        }
    return OmegaConf.create(cfg)


def build(kind="char", loss="default", seed=0, **options):
    """A tiny model of ``kind`` with parameters drawn under ``seed``; ``options`` as for :func:`config`."""
    from nemo.collections.asr import models

    torch.manual_seed(seed)
    return getattr(models, CLASSES[kind])(cfg=config(kind, loss, **options), trainer=None)


def vocab_size(model):
    return model.tokenizer.vocab_size if hasattr(model, "tokenizer") else len(model.cfg.labels)


def batch(model, seed=0, seconds=(0.6, 0.4, 0.5, 0.3, 0.45), labels=(6, 0, 4, 5, 1)):
    """(signal, signal_len, transcript, transcript_len) as NeMo's audio-text datasets give them: transcripts padded
    to the longest; one utterance without labels."""
    gen = torch.Generator().manual_seed(seed)
    n = [int(16000 * s) for s in seconds]
    signal = torch.zeros(len(n), max(n))
    for i, k in enumerate(n):
        signal[i, :k] = 0.1 * torch.randn(k, generator=gen)
    lengths = torch.tensor(labels)
    transcript = torch.randint(0, vocab_size(model), (len(n), max(labels)), generator=gen)
    transcript[torch.arange(max(labels)) >= lengths[:, None]] = 0
    return signal, torch.tensor(n), transcript, lengths


def attach_trainer(model, log_every_n_steps=1):
    """What training_step and validation_step read of a Lightning trainer; returns the dict they log into."""
    model._trainer = SimpleNamespace(
        global_step=0, log_every_n_steps=log_every_n_steps, val_dataloaders=None, test_dataloaders=None
    )
    model._optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = {}
    model.log_dict = lambda values, **kwargs: logged.update(values)
    model.log = lambda name, value, **kwargs: logged.update({name: value})
    return logged


def training_step(model, data, seed=0):
    """(loss, {parameter name: gradient}, logged) of one training step and its backward."""
    logged = attach_trainer(model)
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model.training_step(data, 0)["loss"]
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, logged
