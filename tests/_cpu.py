"""What this CPU can run: whether torch runs an LSTM under CPU bf16 autocast, found out once per test session.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` torch runs an LSTM as oneDNN's bf16 RNN, which oneDNN implements
for some instruction sets only: on a CPU with AVX2 and no AVX-512, an LSTM whose input is float32 (an embedding's
output, as in a prediction network) raises "could not create a primitive descriptor for the LSTM forward propagation
primitive".
The tests put LSTMs of transformers' and NeMo's models and of the recipe under CPU bf16 autocast:

- a test that needs the LSTM itself under autocast calls :func:`require_bf16_lstm`, and is skipped, with the reason,
  where this CPU cannot run one;
- a test whose point is this library's loss under autocast runs the model under :func:`autocast_lstms`: where this
  CPU cannot run an LSTM under autocast, the LSTMs run outside it, in float32, and everything else (the joiner and
  the loss included) under it, so that the loss is still tested there.

The environment variable TRANSDUCER_TESTS_BF16_LSTM forces the answer: ``1`` (runs), ``0`` (does not).

Some CPUs run a convolution under CPU bf16 autocast and get it wrong: with torch 2.14.1 on a CPU with AVX-512 BF16,
oneDNN's bf16 ``Conv2d`` whose output is one column wide (16 channels, 3x3, stride 2: the second layer of ESPnet's
subsampling on few feature bins) returns values off by about 2, some NaN, depending on the run; a test whose point is
the loss runs a model's convolutions outside autocast, in float32, under :func:`float32_convs`.
"""

import contextlib
import functools
import os

import pytest
import torch

FORCE = "TRANSDUCER_TESTS_BF16_LSTM"


@functools.lru_cache(maxsize=None)
def bf16_lstm_refusal():
    """None where this CPU runs an LSTM under CPU bf16 autocast, else why it does not (torch's error, or the forcing
    variable); one probe per test session, unless TRANSDUCER_TESTS_BF16_LSTM forces the answer."""
    forced = os.environ.get(FORCE, "")
    if forced == "1":
        return None
    if forced == "0":
        return f"an LSTM under CPU bf16 autocast is taken not to run here ({FORCE}=0)"
    if forced:
        raise ValueError(
            f"{FORCE}: expected 1 (an LSTM runs under CPU bf16 autocast) or 0 (it does not), got {forced!r}"
        )
    lstm = torch.nn.LSTM(4, 4, batch_first=True)
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for dtype in (torch.float32, torch.bfloat16):  # an embedding's output (a predictor's input), a Linear's
                lstm(torch.zeros(1, 2, 4, dtype=dtype))
    except RuntimeError as e:
        return f"this CPU does not run an LSTM under CPU bf16 autocast (oneDNN's bf16 LSTM): {e}"
    return None


def require_bf16_lstm():
    """Skip the calling test, with the reason, where this CPU does not run an LSTM under CPU bf16 autocast."""
    reason = bf16_lstm_refusal()
    if reason is not None:
        pytest.skip(reason)


def _float32(x):
    """x (a tensor, a PackedSequence, a tuple of tensors or None) with its floating-point tensors in float32."""
    if isinstance(x, torch.nn.utils.rnn.PackedSequence):
        return x.float()
    if isinstance(x, tuple):
        return tuple(_float32(y) for y in x)
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _outside_autocast(lstm):
    """lstm's forward with CPU autocast off and floating-point inputs in float32 (an LSTM's outputs are then
    float32, which the autocast ops after it take as they take any float32 tensor)."""
    forward = lstm.forward

    def run(input, hx=None):
        with torch.autocast("cpu", enabled=False):
            return forward(_float32(input), _float32(hx))

    return run


@contextlib.contextmanager
def autocast_lstms(module):
    """Within it, the CPU ``torch.nn.LSTM`` modules of ``module`` run under CPU bf16 autocast where this CPU can,
    else outside autocast in float32; the rest of ``module`` as the caller's autocast has it."""
    lstms = (
        []
        if bf16_lstm_refusal() is None
        else [m for m in module.modules() if isinstance(m, torch.nn.LSTM) and m.weight_ih_l0.device.type == "cpu"]
    )
    for lstm in lstms:
        lstm.forward = _outside_autocast(lstm)
    try:
        yield
    finally:
        for lstm in lstms:
            del lstm.forward  # the class's forward again


@contextlib.contextmanager
def float32_convs():
    """Within it, CPU ``torch.nn.Conv2d`` modules run outside autocast, in float32 (every Conv2d: models are copied,
    so the class's forward is the one place); the rest as the caller's autocast has it."""
    forward = torch.nn.Conv2d.forward

    def run(self, input):
        if self.weight.device.type != "cpu":
            return forward(self, input)
        with torch.autocast("cpu", enabled=False):
            return forward(self, input.float())

    torch.nn.Conv2d.forward = run
    try:
        yield
    finally:
        torch.nn.Conv2d.forward = forward
