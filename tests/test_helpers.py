"""The tests' own helpers: _imports.require (a missing optional dependency skips, a broken one fails) and
_batches (the lengths, labels and shapes random_batch promises; compact and cell_mask agree)."""

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
    with pytest.raises(pytest.fail.Exception, match="broken_audio_pkg is installed but cannot be imported: "
                                                     "RuntimeError: compiled with different CUDA versions"):
        require("broken_audio_pkg.functional", "test")
    with pytest.raises(pytest.skip.Exception, match="not_installed_pkg is not installed"):
        require("not_installed_pkg", "test")


def test_random_batch_keeps_its_promises():
    gen = torch.Generator().manual_seed(0)
    for rna in (False, True):
        logits, targets, T, U = random_batch(gen, 6, 5, 4, 7, 3, dtype=torch.float32, rna=rna, scale=2.0, min_t=2,
                                             edges=True, extra=2)
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
