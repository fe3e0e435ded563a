"""Train a tiny NeMo TDT model on this library's loss, offline: the model is built from the config below (a one-layer
FastConformer-style encoder, an LSTM prediction network and NeMo's joint; no download), the data are a few random
signals with random character transcripts, and Lightning's Trainer runs NeMo's own training_step on them.

    pip install -e ".[nemo]"
    python examples/nemo_tdt.py
"""

import logging

import lightning.pytorch as pl
import torch
from nemo.collections.asr.models import EncDecRNNTModel
from nemo.utils import logging as nemo_logging
from omegaconf import OmegaConf

from transducer.integrations.nemo import apply

nemo_logging.setLevel(logging.ERROR)

LABELS = list(" abcdefghijklmnopqrstuvwxyz'")
DURATIONS = [0, 1, 2, 3, 4]

# cfg.model of a char TDT model: what NeMo's FastConformer TDT configs hold, scaled down
CONFIG = {
    "sample_rate": 16000,
    "labels": LABELS,
    "preprocessor": {
        "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
        "sample_rate": 16000,
        "features": 64,
        "window_size": 0.025,
        "window_stride": 0.01,
        "normalize": "per_feature",
        "n_fft": 512,
        "dither": 0.0,
        "pad_to": 0,
    },
    "encoder": {
        "_target_": "nemo.collections.asr.modules.ConformerEncoder",
        "feat_in": 64,
        "n_layers": 1,
        "d_model": 64,
        "subsampling": "striding",
        "subsampling_factor": 4,
        "subsampling_conv_channels": 16,
        "ff_expansion_factor": 2,
        "n_heads": 4,
        "conv_kernel_size": 9,
        "dropout": 0.0,
        "dropout_pre_encoder": 0.0,
        "dropout_emb": 0.0,
        "dropout_att": 0.0,
    },
    "decoder": {
        "_target_": "nemo.collections.asr.modules.RNNTDecoder",
        "blank_as_pad": True,
        "prednet": {"pred_hidden": 64, "pred_rnn_layers": 1},
    },
    "joint": {
        "_target_": "nemo.collections.asr.modules.RNNTJoint",
        "num_extra_outputs": len(DURATIONS),
        "jointnet": {"joint_hidden": 64, "activation": "relu", "dropout": 0.0},
    },
    "model_defaults": {"enc_hidden": 64, "pred_hidden": 64, "joint_hidden": 64},
    "decoding": {"strategy": "greedy_batch", "model_type": "tdt", "durations": DURATIONS, "greedy": {"max_symbols": 5}},
    "loss": {"loss_name": "tdt", "tdt_kwargs": {"durations": DURATIONS, "sigma": 0.05}},
    "optim": {"name": "adamw", "lr": 3e-3},
}


def random_batch(seconds=(1.0, 0.8, 0.6, 0.5), lengths=(9, 7, 5, 3)):
    """(signal, signal_length, transcript, transcript_length), as NeMo's audio-to-text datasets give a batch."""
    samples = [int(16000 * s) for s in seconds]
    signal = torch.zeros(len(samples), max(samples))
    for i, n in enumerate(samples):
        signal[i, :n] = 0.1 * torch.randn(n)
    transcript = torch.randint(1, len(LABELS), (len(lengths), max(lengths)))
    transcript[torch.arange(max(lengths)) >= torch.tensor(lengths)[:, None]] = 0
    return signal, torch.tensor(samples), transcript, torch.tensor(lengths)


class PrintLoss(pl.Callback):
    def on_train_batch_end(self, trainer, model, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == 1 or step % 10 == 0:
            print(f"step {step}: loss {float(outputs['loss']):.4f}")


def main(steps=30):
    torch.manual_seed(0)
    model = apply(EncDecRNNTModel(cfg=OmegaConf.create(CONFIG)))  # the loss is now this library's TDT loss
    data = torch.utils.data.DataLoader([random_batch()], batch_size=None)  # one batch, seen every step
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[PrintLoss()],
    )
    trainer.fit(model, train_dataloaders=data)


if __name__ == "__main__":
    main()
