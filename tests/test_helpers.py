"""The tests' own helpers: _imports.require (a missing optional dependency skips, a broken one fails), _cpu's
probe (whether this CPU runs an LSTM under CPU bf16 autocast: its answer is what an LSTM does, and both answers,
forced, skip or run the LSTMs as they say) and _batches (the lengths, labels and shapes random_batch promises;
compact and cell_mask agree)."""

import _cpu
import pytest
import torch
from _batches import cell_mask, compact, random_batch, random_targets
from _imports import require


def test_installed_but_broken_dependency_fails_the_tests(tmp_path, monkeypatch):
    # as torchaudio does beside a torch built for another CUDA version: a RuntimeError at import
    pkg = tmp_path / "broken_audio_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('compiled with different CUDA versions')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        pytest.fail.Exception,
        match="broken_audio_pkg is installed but cannot be imported: "
        "RuntimeError: compiled with different CUDA versions",
    ):
        require("broken_audio_pkg.functional", "test")
    with pytest.raises(pytest.skip.Exception, match="not_installed_pkg is not installed"):
        require("not_installed_pkg", "test")


@pytest.fixture
def probe(monkeypatch):
    """_cpu's probe without its cached answer, before and after the test (which may force one)."""
    monkeypatch.delenv(_cpu.FORCE, raising=False)
    _cpu.bf16_lstm_refusal.cache_clear()
    yield _cpu
    _cpu.bf16_lstm_refusal.cache_clear()


def lstm_model():
    """A predictor: an embedding (float32 under autocast), an LSTM and a Linear; the LSTM's output dtype tells
    whether it ran under CPU bf16 autocast."""
    torch.manual_seed(0)
    return torch.nn.ModuleDict(
        dict(embed=torch.nn.Embedding(7, 4), lstm=torch.nn.LSTM(4, 5, batch_first=True), out=torch.nn.Linear(5, 2))
    )


def lstm_step(model):
    """(the LSTM's output dtype, the model output's dtype) of a forward under CPU bf16 autocast, and a backward."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model["lstm"](model["embed"](torch.tensor([[1, 2, 3], [4, 5, 6]])))[0]
        y = model["out"](h)
    y.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    return h.dtype, y.dtype


def test_lstm_under_cpu_bf16_autocast(probe):
    """What the models' bf16 autocast tests run under autocast_lstms: skipped, with the reason, where this CPU
    cannot run it (those tests then run their LSTMs outside autocast)."""
    probe.require_bf16_lstm()
    assert lstm_step(lstm_model()) == (torch.bfloat16, torch.bfloat16)


def test_bf16_lstm_probe_tells_what_an_lstm_does(probe):
    refusal = probe.bf16_lstm_refusal()
    assert probe.bf16_lstm_refusal() is refusal  # found out once
    model = lstm_model()
    if refusal is None:
        assert lstm_step(model) == (torch.bfloat16, torch.bfloat16)
        probe.require_bf16_lstm()  # no skip
    else:
        assert "does not run an LSTM under CPU bf16 autocast" in refusal
        with pytest.raises(RuntimeError):
            lstm_step(model)
        with pytest.raises(pytest.skip.Exception, match="does not run an LSTM under CPU bf16 autocast"):
            probe.require_bf16_lstm()


def test_bf16_lstm_probe_forced_refused(probe, monkeypatch):
    """Taken not to run: tests that need the LSTM under autocast skip with the reason; autocast_lstms runs the
    LSTMs outside autocast in float32 (the Linears stay under it) and puts them back afterwards."""
    monkeypatch.setenv(probe.FORCE, "0")
    assert f"{probe.FORCE}=0" in probe.bf16_lstm_refusal()
    with pytest.raises(pytest.skip.Exception, match=f"{probe.FORCE}=0"):
        probe.require_bf16_lstm()
    model = lstm_model()
    with probe.autocast_lstms(model):
        assert "forward" in vars(model["lstm"])
        assert lstm_step(model) == (torch.float32, torch.bfloat16)
    assert "forward" not in vars(model["lstm"])
    packed = torch.nn.utils.rnn.pack_padded_sequence(
        torch.randn(2, 6, 4).bfloat16(), torch.tensor([6, 3]), batch_first=True
    )
    with probe.autocast_lstms(model), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model["lstm"](packed)[0].data.dtype == torch.float32


def test_bf16_lstm_probe_forced_runs(probe, monkeypatch):
    """Taken to run: no skip, and autocast_lstms leaves the LSTMs under autocast as they are."""
    monkeypatch.setenv(probe.FORCE, "1")
    assert probe.bf16_lstm_refusal() is None
    probe.require_bf16_lstm()
    model = lstm_model()
    with probe.autocast_lstms(model):
        assert "forward" not in vars(model["lstm"])
    monkeypatch.setenv(probe.FORCE, "yes")
    probe.bf16_lstm_refusal.cache_clear()
    with pytest.raises(ValueError, match=f"{probe.FORCE}: expected 1 .* or 0 .*, got 'yes'"):
        probe.bf16_lstm_refusal()


@pytest.mark.parametrize("leave", [5, 0])
def test_each_test_starts_from_the_same_generator_state(leave):
    """conftest.py seeds torch's default generator with 0 before each test, whatever state the test before left."""
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(0)))
    torch.rand(leave)


def test_random_batch_keeps_its_promises():
    gen = torch.Generator().manual_seed(0)
    for rna in (False, True):
        logits, targets, T, U = random_batch(
            gen, 6, 5, 4, 7, 3, dtype=torch.float32, rna=rna, scale=2.0, min_t=2, edges=True, extra=2
        )
        assert logits.dtype == torch.float32 and logits.shape == (6, 5, int(U.max()) + 1, 7 + 2)
        assert (int(T[0]), int(U[0])) == (5, 4)  # utterance 0 at the maxima
        assert int(T[1]) == 1 and int(U[2]) == 0  # the edges
        assert ((T[2:] >= 2) & (T[2:] <= 5)).all() and ((U >= 0) & (U <= 4)).all()
        if rna:  # an RNA alignment exists for each
            assert (U <= T - 1).all()
        assert targets.shape == (6, 4) and ((targets >= 0) & (targets < 7) & (targets != 3)).all()
        assert compact(logits, T, U).shape == (int((T * (U + 1)).sum()), 9)
        assert int(cell_mask(logits, T, U).sum()) == int((T * (U + 1)).sum())
    targets, _, _ = random_targets(gen, 50, 3, 8, 5, (0, 4))  # several columns to avoid
    assert set(targets.unique().tolist()) == {1, 2, 3}
