"""Train a tiny transformers Parakeet TDT model on this library's loss, offline: the model is built from a config (no
download) and the batch is random features and labels, shaped as transformers' ParakeetProcessor gives them for
audio and text; a few AdamW steps fit the batch.

    pip install -e . "transformers>=5.12,<6"
    python examples/transformers_parakeet.py
"""

import torch
from transformers import ParakeetForTDT, ParakeetTDTConfig

from transducer.integrations.transformers import apply

ENCODER = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    num_mel_bins=80,
    subsampling_factor=4,
    subsampling_conv_channels=16,
    conv_kernel_size=9,
)


def tiny_model():
    """A ParakeetForTDT with a vocabulary of 32 tokens (0 the padding, 31 the blank) and durations 0-4."""
    config = ParakeetTDTConfig(
        encoder_config=ENCODER,
        vocab_size=32,
        pad_token_id=0,
        blank_token_id=31,
        decoder_hidden_size=64,
        num_decoder_layers=1,
        durations=[0, 1, 2, 3, 4],
    )
    return ParakeetForTDT(config)


def random_batch(config, frames=(160, 120, 96, 64), lengths=(9, 7, 5, 3)):
    """A batch as the model takes it: input_features (B, frames, mel bins) and their attention_mask; labels padded
    with pad_token_id; decoder_input_ids, the blank then the labels."""
    B, S = len(frames), max(lengths)
    input_features = torch.randn(B, max(frames), config.encoder_config.num_mel_bins)
    attention_mask = (torch.arange(max(frames)) < torch.tensor(frames)[:, None]).long()
    labels = torch.randint(1, config.blank_token_id, (B, S))  # neither the padding nor the blank
    labels[torch.arange(S) >= torch.tensor(lengths)[:, None]] = config.pad_token_id
    decoder_input_ids = torch.cat([torch.full((B, 1), config.blank_token_id), labels], 1)
    return dict(
        input_features=input_features, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, labels=labels
    )


def main(steps=30):
    torch.manual_seed(0)
    model = apply(tiny_model())  # the loss is now this library's fused joiner loss
    batch = random_batch(model.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(1, steps + 1):
        out = model(**batch)  # out.logits is None: the fused loss keeps no (B, T, U+1, V) logits
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        if step == 1 or step % 10 == 0:
            print(f"step {step}: loss {out.loss.item():.4f}")


if __name__ == "__main__":
    main()
