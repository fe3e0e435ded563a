"""transducer.hopper's kernels for sm_90 (CuTe DSL) against float32 torch references on random inputs: the logits
statistics and the logits gradient, V not a multiple of the vocabulary tile and smaller than one, row counts not a
multiple of the row tile, J not a multiple of the K tile, rows of a wider stride, rows without a label (-1), with and
without a bias and a clamp, bfloat16 and float16. The fused loss on them (transducer/fused/hopper_tiles.py) against the other
path (cuBLAS and the CUDA stages; TRANSDUCER_HOPPER=0 turns the Hopper path off) and the float64 composition: RNN-T and
RNA, clamp, FastEmit, the delay penalty, dropout, every activation, with and without a bias, ragged batches with T_b = 1
and U_b = 0, a zero incoming gradient, and random batches and options (the fuzz); TDT and multi-blank RNN-T, the
duration scores and the big blanks in extra columns of the projection. The argument checks and the choice of
path run anywhere, and so does the kernels' build where the hopper extra is installed."""

import importlib.util
import logging
import os
import random
import stat
import types
import warnings
from pathlib import Path

import pytest
import torch
from test_fused import composed, joiner_batch, seeded

from transducer import fused_joiner_loss, hopper
from transducer.fused.hopper_tiles import use_hopper
from transducer.hopper import compile as hopper_compile
from transducer.joiner import ACTIVATIONS
from transducer.lattices import MULTIBLANK, RNNT, TDT

needs_hopper = pytest.mark.skipif(
    not hopper.available(), reason="needs an sm_90 GPU and the CuTe DSL (pip install -e '.[hopper]')"
)


def reference(H, W, bias, labels, blank):
    """(den, z_blank, z_label) from the logits Z = H W^T + bias in float32 (H and W's products are exact there)."""
    Z = H.float() @ W.float().t()
    if bias is not None:
        Z += bias.float()
    rows = torch.arange(Z.size(0), device=Z.device)
    z_label = torch.where(labels >= 0, Z[rows, labels.clamp(min=0).long()], 0.0)
    return torch.logsumexp(Z, dim=1), Z[:, blank], z_label


def random_inputs(N, J, V, dtype, with_bias, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    H = torch.randn(N, J, device="cuda", generator=g).to(dtype)
    W = (torch.randn(V, J, device="cuda", generator=g) / J**0.5).to(dtype)
    bias = torch.randn(V, device="cuda", generator=g) if with_bias else None
    labels = torch.randint(0, V, (N,), device="cuda", generator=g, dtype=torch.int32)
    labels[torch.rand(N, device="cuda", generator=g) < 0.2] = -1
    return H, W, bias, labels


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(
    "N, J, V, blank, dtype, with_bias",
    [
        (1000, 512, 500, 0, torch.bfloat16, False),  # Protocol A's joint; 1000 rows: a partial row tile
        (777, 640, 1024, 1023, torch.bfloat16, True),  # whole vocabulary tiles, the blank last
        (300, 640, 8198, 5, torch.bfloat16, True),  # Parakeet-TDT's joint width: 65 vocabulary tiles
        (
            200,
            768,
            1100,
            7,
            torch.bfloat16,
            True,
        ),  # rows too wide for H's tile in shared memory: the cooperative kernel
        (129, 200, 37, 36, torch.float16, True),  # V under one tile, J not a multiple of the K tile
        (64, 8, 300, 299, torch.bfloat16, False),  # J of one 16-byte vector
        (130, 64, 5, 4, torch.bfloat16, True),  # fewer columns than a row's four threads hold: some hold none
        (64, 16, 2, 0, torch.float16, False),  # the fewest a softmax has
    ],
)
def test_matches_reference(N, J, V, blank, dtype, with_bias):
    H, W, bias, labels = random_inputs(N, J, V, dtype, with_bias, seed=N + V)
    den, z_blank, z_label = hopper.logits_statistics(H, W, bias, labels, blank)
    ref_den, ref_blank, ref_label = reference(H, W, bias, labels, blank)
    for name, got, want in (("den", den, ref_den), ("z_blank", z_blank, ref_blank), ("z_label", z_label, ref_label)):
        assert got.shape == (N,) and got.dtype == torch.float32, name
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-5, msg=lambda m: f"{name}: {m}")
    assert (z_label[labels < 0] == 0).all()


@pytest.mark.cuda
@needs_hopper
def test_large_logits_and_reuse():
    """Logits far from 0 (the running max carries the sum) and a second call of the compiled kernel with another row
    count and V of the same vocabulary tiles."""
    H, W, bias, labels = random_inputs(2048, 512, 500, torch.bfloat16, True, seed=1)
    bias = bias * 100
    for rows, cols in ((2048, 500), (1500, 480)):
        args = (H[:rows], W[:cols].contiguous(), bias[:cols], labels[:rows].clamp(max=cols - 1), 3)
        got = hopper.logits_statistics(*args)
        want = reference(*args)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-3, rtol=2e-5)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(
    "N, J, V, D, blank, with_bias",
    [
        (300, 640, 8193, 5, 8192, True),  # Parakeet-TDT's joint: the durations in the last of 65 vocabulary tiles
        (200, 64, 126, 5, 0, True),  # the durations across two 128-column tiles
        (130, 72, 40, 16, 39, False),  # the most durations, V + D under one tile
    ],
)
def test_extra_columns(N, J, V, D, blank, with_bias):
    """A projection of V token rows and D more (TDT's durations): the statistics over the V columns and the D extra
    columns' entries of H W^T (no bias), the gradient over the V columns and zeros in the D."""
    H, W, bias, labels = random_inputs(N, J, V + D, torch.bfloat16, with_bias, seed=N + D)
    labels = torch.where(labels >= 0, labels % V, labels)
    projection = hopper.projection(W, bias, tokens=V)
    assert projection.extra == D and projection.n_tiles * projection.config.tile_n >= V + D
    den, z_blank, z_label, *extra = hopper.statistics_tile(projection, H, labels, blank)
    token_bias = None if bias is None else bias[:V]
    for got, want in zip((den, z_blank, z_label), reference(H, W[:V], token_bias, labels, blank)):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-5)
    assert len(extra) == D
    torch.testing.assert_close(torch.stack(extra), (H.float() @ W[V:].float().t()).t(), atol=2e-4, rtol=2e-5)
    terms = torch.rand(4, N, device="cuda", generator=torch.Generator("cuda").manual_seed(D))
    coefficients = torch.cat([den[None], terms])
    G = hopper.gradient_tile(projection, H, labels, blank, coefficients, 0.0)
    assert (G[:, V:] == 0).all()
    want = gradient_reference(H, W[:V], token_bias, labels, blank, coefficients, 0.0)
    torch.testing.assert_close(G[:, :V].float(), want, atol=2e-3 * float(want.abs().max()), rtol=1e-2)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(
    "N, J, V, start, K, clamp",
    [
        (300, 128, 1500, 1496, 3, 0.0),  # multi-blank's big blanks before a last-column blank, 12 vocabulary tiles
        (200, 64, 300, 125, 4, 0.05),  # across two 128-column tiles; the clamp after their terms
    ],
)
def test_extra_columns_in_the_softmax(N, J, V, start, K, clamp):
    """Extra columns among the softmax's (multi-blank's big blanks): the statistics return their entries of H W^T
    (no bias), and the gradient subtracts each row's K more terms on them before the clamp."""
    H, W, bias, labels = random_inputs(N, J, V, torch.bfloat16, True, seed=N + K)
    blank = start + K
    projection = hopper.projection(W, bias, extra=(start, K))
    den, z_blank, z_label, *extra = hopper.statistics_tile(projection, H, labels, blank)
    for got, want in zip((den, z_blank, z_label), reference(H, W, bias, labels, blank)):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-5)
    torch.testing.assert_close(torch.stack(extra), (H.float() @ W[start:blank].float().t()).t(), atol=2e-4, rtol=2e-5)
    terms = torch.rand(4 + K, N, device="cuda", generator=torch.Generator("cuda").manual_seed(K))
    coefficients = torch.cat([den[None], terms])
    coefficients[:, ::5] = 0
    coefficients[0, ::5] = float("inf")
    given = coefficients.clone()
    G = hopper.gradient_tile(projection, H, labels, blank, coefficients, clamp)
    assert torch.equal(coefficients, given)  # read, never written
    want = gradient_reference(H, W, bias, labels, blank, coefficients[:5], 0.0)
    want[:, start:blank] -= coefficients[5:].t() * coefficients[4, :, None]
    if clamp:
        scale = coefficients[4, :, None]
        want = torch.where(scale > 0, (want / scale.clamp(min=1e-30)).clamp(-clamp, clamp) * scale, 0.0)
    assert (G[::5] == 0).all() and (G[:, V:] == 0).all()
    torch.testing.assert_close(G[:, :V].float(), want, atol=2e-3 * float(want.abs().max()), rtol=1e-2)


def test_argument_checks():
    H = torch.zeros(4, 8, dtype=torch.bfloat16)
    W = torch.zeros(6, 8, dtype=torch.bfloat16)
    labels = torch.zeros(4, dtype=torch.int32)
    for tokens in (0, 7):
        with pytest.raises(ValueError, match=r"tokens: expected a count in \[1, V = 6\], got"):
            hopper.projection(W, None, tokens=tokens)
    with pytest.raises(ValueError, match=r"extra: expected \(start, count\), count <= 16 columns of the V = 40"):
        hopper.projection(torch.zeros(40, 8, dtype=torch.bfloat16), None, tokens=20)  # 20 extra columns
    for config in (hopper.Config(128, 1, 1, 1, 2), hopper.Config(256, 2, 1, 1, 1), hopper.Config(128, 2, 1, 1, 3)):
        with pytest.raises(ValueError, match=r"config: expected a ping-pong shape \(64 or 128, 2, 1, 1, 1 or 2\)"):
            hopper.projection(W, None, config)
    wide = torch.zeros(300, 8, dtype=torch.bfloat16)  # three vocabulary tiles of 128
    for config in (
        hopper.Config(128, 2, 1, 1, 2, 4),
        hopper.Config(128, 2, 1, 1, 2, 0),
        hopper.Config(128, 2, 1, 1, 1, 3),
        hopper.Config(128, 2, 1, 1, 0, 3),
    ):
        with pytest.raises(
            ValueError,
            match=r"config: expected vocab_groups 1, or at most the 3 vocabulary tiles "
            r"with pingpong 2",
        ):
            hopper.projection(wide, None, config)
    for groups in (2, 3):
        assert hopper.projection(wide, None, hopper.Config(128, 2, 1, 1, 2, groups)).n_tiles == 3
    for extra in ((-1, 2), (5, 2), (0, 17)):
        with pytest.raises(ValueError, match=r"extra: expected \(start, count\)"):
            hopper.projection(torch.zeros(40, 8, dtype=torch.bfloat16)[:6], None, extra=extra)
    projection = hopper.projection(W, None, extra=(2, 3))
    with pytest.raises(
        ValueError,
        match=r"coefficients: expected 5 or 5 \+ 3 rows \(the projection's extra columns\), "
        r"got 7",
    ):
        hopper.gradient_tile(projection, H, labels, 0, torch.zeros(7, 4), 0.0)
    with pytest.raises(ValueError, match="H: expected a 2-D bfloat16 or float16"):
        hopper.logits_statistics(H.float(), W, None, labels, 0)
    with pytest.raises(ValueError, match="H: expected a CUDA tensor of unit column stride"):
        hopper.logits_statistics(H, W, None, labels, 0)
    if torch.cuda.is_available():
        H, W, labels = H.cuda(), W.cuda(), labels.cuda()
        with pytest.raises(ValueError, match="W: expected"):
            hopper.logits_statistics(H, W[:, :4], None, labels, 0)
        with pytest.raises(ValueError, match="labels: expected an int32"):
            hopper.logits_statistics(H, W, None, labels.long(), 0)
        with pytest.raises(ValueError, match="blank: expected a column in"):
            hopper.logits_statistics(H, W, None, labels, 6)
        with pytest.raises(ValueError, match="bias: expected None or a floating"):
            hopper.logits_statistics(H, W, torch.zeros(5, device="cuda"), labels, 0)


def test_available_without_a_gpu_or_package():
    """available() answers False rather than failing where there is no CUDA device or no sm_90 one."""
    if not torch.cuda.is_available():
        assert hopper.available() is False
    assert hopper.available("cpu") is False


HAS_DSL = all(importlib.util.find_spec(name) is not None for name in ("cutlass", "tvm_ffi"))
BUILT_ANYWHERE = [  # V, J, dtype, gradient, clamp, extra: every default kernel shape, both epilogues
    (500, 512, torch.bfloat16, False, False, 0),  # two row blocks a CTA, H streamed
    (500, 512, torch.bfloat16, True, False, 0),  # ... the gradient's vocabulary tiles split between two CTAs
    (100, 64, torch.float16, True, True, 0),  # ... one CTA a row-block pair, the clamp
    (8198, 640, torch.bfloat16, False, False, 5),  # H resident, TDT's duration columns
    (8198, 640, torch.bfloat16, True, False, 5),
    (1100, 768, torch.bfloat16, False, False, 0),  # the cooperative kernel, rows too wide for H to stay
    (1100, 768, torch.bfloat16, True, True, 3),
]


@pytest.mark.skipif(not HAS_DSL, reason="needs nvidia-cutlass-dsl and apache-tvm-ffi (the hopper extra)")
@pytest.mark.parametrize("V, J, dtype, gradient, clamp, extra", BUILT_ANYWHERE)
def test_kernels_build_without_a_gpu(monkeypatch, V, J, dtype, gradient, clamp, extra):
    """Each default kernel shape traces and compiles for sm_90a on any machine, one without a GPU too (the CPU suite
    with the hopper extra): a change to the kernels that the DSL cannot trace or compile fails here. The compiler is
    told the architecture (its default without a GPU is another) and given the null stream where there is no CUDA
    device; the disk cache is left alone."""
    import cutlass.cute as cute

    build = cute.compile
    monkeypatch.setattr(
        cute, "compile", lambda *a, options, **k: build(*a, options=f"{options} --gpu-arch sm_90a", **k)
    )
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *_: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setenv("TRANSDUCER_HOPPER_CACHE", "0")
    config = hopper.default_config(V, J)
    n_tiles = -(-V // config.tile_n)
    if not gradient:
        config = config._replace(vocab_groups=1)  # as compiled() gives the statistics
    kernel = hopper_compile._compile.__wrapped__(J, n_tiles, dtype, config, gradient, clamp, extra)
    assert callable(kernel)


def test_disk_cache_file(monkeypatch, tmp_path):
    """Where a compiled kernel is kept for later processes: in TRANSDUCER_HOPPER_CACHE's directory, by default
    $XDG_CACHE_HOME/transducer-loss/hopper; a file of its own for each kernel; none where the variable is 0."""
    args = (512, 4, torch.bfloat16, hopper.Config(128, 2, 1, 1, 2, 2), True, False, 0)
    monkeypatch.delenv("TRANSDUCER_HOPPER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    file = hopper_compile._cache_file(*args)
    assert file.parent == tmp_path / "xdg" / "transducer-loss" / "hopper" and file.suffix == ".o"
    monkeypatch.setenv("TRANSDUCER_HOPPER_CACHE", str(tmp_path / "mine"))
    assert hopper_compile._cache_file(*args) == tmp_path / "mine" / file.name
    changed = (640, 8, torch.float16, hopper.Config(128, 2, 1, 1, 2), False, True, 3)
    others = {hopper_compile._cache_file(*args[:i], x, *args[i + 1 :]) for i, x in enumerate(changed)}
    assert len(others) == len(changed) and hopper_compile._cache_file(*args) not in others
    for off in ("0", "off", "False", " no "):
        monkeypatch.setenv("TRANSDUCER_HOPPER_CACHE", off)
        assert hopper_compile._cache_file(*args) is None
    for on in ("1", "on", "True", "yes"):  # the default directory, not a directory named "1"
        monkeypatch.setenv("TRANSDUCER_HOPPER_CACHE", on)
        assert hopper_compile._cache_file(*args) == file
    monkeypatch.setenv("TRANSDUCER_HOPPER_CACHE", "~/mine")
    assert hopper_compile._cache_file(*args) == Path.home() / "mine" / file.name
    monkeypatch.delenv("TRANSDUCER_HOPPER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "xdg")  # relative: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = tmp_path / "home" / ".cache" / "transducer-loss" / "hopper"
    assert hopper_compile._cache_file(*args) == home / file.name
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")  # the DSL's settings change the kernel
    assert hopper_compile._cache_file(*args).name != file.name
    monkeypatch.setattr(hopper_compile, "_source_key", lambda: (tmp_path / "absent").read_bytes())
    assert hopper_compile._cache_file(*args) is None  # sources that cannot be read: compiled in every process


def test_disk_cache_write_failure(tmp_path):
    """A kernel that cannot be written to the disk cache (a full or read-only disk, a file where the directory should
    be) is left to the next process to compile: nothing raised, no part of a file left."""

    class Compiled:
        def export_to_c(self, path, function_name):
            Path(path).write_bytes(b"half")
            raise OSError(28, "No space left on device")

    hopper_compile._write_cached(Compiled(), tmp_path / "kernel.o")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_bytes(b"")
    hopper_compile._write_cached(Compiled(), tmp_path / "file" / "kernel.o")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


class Exported:
    """A compiled kernel as the disk cache sees it: export_to_c writes ``data``."""

    def __init__(self, data=b"an object file"):
        self.data = data

    def export_to_c(self, path, function_name):
        assert function_name == hopper_compile._CACHED_NAME
        Path(path).write_bytes(self.data)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(hopper_compile, "_warned", set())


def test_disk_cache_relative_setting_refused(monkeypatch, fresh_warnings):
    """A relative TRANSDUCER_HOPPER_CACHE (it would name another directory in each working directory) is refused with
    one warning: no disk cache."""
    args = (512, 4, torch.bfloat16, hopper.Config(), True, False, 0)
    monkeypatch.setenv("TRANSDUCER_HOPPER_CACHE", "relative/cache")
    with pytest.warns(
        RuntimeWarning, match="TRANSDUCER_HOPPER_CACHE='relative/cache' is not used: expected an absolute directory"
    ):
        assert hopper_compile._cache_file(*args) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hopper_compile._cache_file(*args) is None  # warned once


def test_disk_cache_private_whatever_the_umask(tmp_path, fresh_warnings):
    """The cache's missing directories are made 0700 and its files written 0600 under umask 002 (or 000), and the
    cache then uses them."""
    file = tmp_path / "a" / "b" / "kernel.o"
    old = os.umask(0o000)
    try:
        assert hopper_compile._usable(file)
        hopper_compile._write_cached(Exported(), file)
        os.umask(0o002)
        hopper_compile._write_cached(Exported(b"again"), file)  # replaced, as a file that did not load is
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700
    assert stat.S_IMODE(file.stat().st_mode) == 0o600 and file.read_bytes() == b"again"
    assert [p.name for p in file.parent.iterdir()] == ["kernel.o"]  # no part of a file left
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hopper_compile._usable(file)


@pytest.mark.parametrize(
    "case",
    [
        "directory writable by others",
        "directory writable by group",
        "directory a symlink",
        "directory not the user's",
        "file writable by others",
        "file a symlink",
        "file not the user's",
        "file a directory",
    ],
)
def test_disk_cache_refuses_what_others_could_have_written(monkeypatch, tmp_path, fresh_warnings, case):
    """A cache directory or file that is a symlink, is not the user's own, or that group or others can write is not
    used (one warning): the kernel is then neither loaded nor written."""
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    file = directory / "kernel.o"
    hopper_compile._write_cached(Exported(b"planted"), file)
    assert hopper_compile._usable(file)  # as it stands: the user's own, 0700 and 0600
    where = directory if case.startswith("directory") else file
    if case.endswith("by others") or case.endswith("by group"):
        where.chmod(where.stat().st_mode | (stat.S_IWOTH if case.endswith("others") else stat.S_IWGRP))
    elif case.endswith("a symlink"):
        target = tmp_path / "elsewhere"
        where.rename(target)
        where.symlink_to(target)
    elif case.endswith("a directory"):
        file.unlink()
        file.mkdir()
    else:
        owner = where.stat().st_uid
        monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.warns(
        RuntimeWarning, match="the kernels' disk cache is not used: .*; the kernels are compiled in memory"
    ):
        assert not hopper_compile._usable(file)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not hopper_compile._usable(file)  # one warning


def test_disk_cache_writes_through_no_symlink(monkeypatch, tmp_path):
    """A symlink planted where the cache writes (its part file's name, or the kernel's file) is not written through:
    the file it points to keeps its contents and its mode 0600."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret")
    victim.chmod(0o600)
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    file = directory / "kernel.o"
    monkeypatch.setattr(hopper_compile.secrets, "token_hex", lambda n: "known")
    part = directory / ".kernel.o.known.part"
    part.symlink_to(victim)
    hopper_compile._write_cached(Exported(), file)  # O_EXCL | O_NOFOLLOW: not opened, nothing written
    assert not file.exists() and part.is_symlink()
    part.unlink()
    file.symlink_to(victim)
    hopper_compile._write_cached(Exported(), file)  # the link itself replaced by the new file
    assert not file.is_symlink() and file.read_bytes() == b"an object file"
    assert victim.read_bytes() == b"secret" and stat.S_IMODE(victim.stat().st_mode) == 0o600


@pytest.mark.cuda
@needs_hopper
def test_kernels_kept_on_disk(monkeypatch, tmp_path):
    """A compiled kernel is written to the disk cache and loaded from it by the next compilation (cute.compile made
    to fail there), with the same results; a file that does not load is compiled again and replaced."""
    import cutlass.cute as cute
    import tvm_ffi

    monkeypatch.setenv("TRANSDUCER_HOPPER_CACHE", str(tmp_path))
    H, W, bias, labels = random_inputs(300, 64, 200, torch.bfloat16, True, seed=5)
    projection = hopper.projection(W, bias)
    statistics = projection.config._replace(vocab_groups=1)  # as _compiled gives the statistics
    args = (64, projection.n_tiles, torch.bfloat16, statistics, False, False, 0)
    file = hopper_compile._cache_file(*args)

    def run(kernel):
        out = torch.empty(3, 300, device="cuda")
        arguments = hopper._arguments(H, projection, labels, out, H)
        hopper_compile.launch(kernel, H, *arguments, 3, 0.0, projection.extra_start)
        return out

    compile_ = hopper_compile._compile.__wrapped__  # without the process's own cache
    want = run(compile_(*args))
    assert [p.name for p in tmp_path.iterdir()] == [file.name]  # and no part of a file left
    real = cute.compile
    monkeypatch.setattr(cute, "compile", lambda *a, **k: pytest.fail("compiled, not loaded from the disk cache"))
    loaded = compile_(*args)
    assert type(loaded) is tvm_ffi.Function and torch.equal(run(loaded), want)
    torch.testing.assert_close(want, torch.stack(reference(H, W, bias, labels, 3)), atol=2e-4, rtol=2e-5)
    monkeypatch.setattr(cute, "compile", real)
    file.write_bytes(b"not an object file")
    assert torch.equal(run(compile_(*args)), want) and file.stat().st_size > 1000


def gradient_reference(H, W, bias, labels, blank, coefficients, clamp):
    """G from the logits Z = H W^T + bias in float32, as stages.cu's gradient_kernel forms it from each row's terms."""
    Z = H.float() @ W.float().t()
    if bias is not None:
        Z += bias.float()
    den, occupancy, blank_arc, label_arc, scale = coefficients
    G = torch.exp(Z - den[:, None]) * occupancy[:, None]
    rows = torch.arange(Z.size(0), device=Z.device)
    G[:, blank] -= blank_arc
    has = labels >= 0
    G[rows[has], labels[has].long()] -= label_arc[has]
    if clamp > 0:
        G = G.clamp(-clamp, clamp)
    return G * scale[:, None]


def random_coefficients(H, W, bias, labels, blank, seed):
    """Each row's den (the logits' logsumexp) and random occupancy, arcs and scale; every fifth row dead (den = +inf,
    zeros), as cuda_stages.row_coefficients gives a row of an utterance without a gradient."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    den = hopper.logits_statistics(H, W, bias, labels, blank)[0]
    N = H.size(0)
    terms = torch.rand(4, N, device="cuda", generator=g)
    coefficients = torch.cat([den[None], terms])
    coefficients[:, ::5] = 0
    coefficients[0, ::5] = float("inf")
    return coefficients


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(
    "N, J, V, blank, dtype, with_bias, clamp, stride",
    [
        (1000, 512, 500, 0, torch.bfloat16, False, 0.0, 512),  # Protocol A's joint; a partial row tile
        (777, 640, 1024, 1023, torch.bfloat16, True, 0.0, 648),  # whole vocabulary tiles; rows of the bias's width
        (300, 640, 1500, 5, torch.bfloat16, True, 0.02, 640),  # V not a multiple of the tiles; the clamp
        (129, 200, 37, 36, torch.float16, True, 0.05, 208),  # V under one tile, J not a multiple of the K tile
    ],
)
def test_gradient_matches_reference(N, J, V, blank, dtype, with_bias, clamp, stride):
    H, W, bias, labels = random_inputs(N, J, V, dtype, with_bias, seed=N + V)
    H = torch.zeros(N, stride, device="cuda", dtype=dtype)[:, :J].copy_(H)  # rows of any 16-byte stride
    coefficients = random_coefficients(H, W, bias, labels, blank, seed=V)
    G = hopper.logits_gradient(H, W, bias, labels, blank, coefficients, clamp)
    want = gradient_reference(H, W, bias, labels, blank, coefficients, clamp)
    assert G.dtype == dtype and G.size(0) == N and G.size(1) >= V and G.size(1) % 64 == 0
    assert (G[:, V:] == 0).all()
    assert (G[::5] == 0).all()  # the dead rows
    if clamp:  # the clamp bites
        assert G.float().abs().max() <= clamp * 1.01
        assert gradient_reference(H, W, bias, labels, blank, coefficients, 0.0).abs().max() > 2 * clamp
    torch.testing.assert_close(G[:, :V].float(), want, atol=2e-3 * float(want.abs().max()), rtol=1e-2)


KERNEL_CASES = [  # N, J, V, blank, with_bias, big_blanks, clamp
    (1000, 640, 8198, 5, True, 0, 0.0),  # Parakeet-TDT's width: 65 tiles, the two consumers' statistics merged
    (300, 200, 1500, 1499, False, 3, 0.02),  # J not a multiple of the K tile; big blanks; the clamp
    (129, 8, 300, 0, True, 0, 0.05),  # three tiles: the second consumer takes one fewer; a CTA's second row block
    (64, 512, 100, 99, True, 0, 0.0),  # one tile: the second consumer takes none; a row block wholly past N
    (300, 640, 130, 129, True, 0, 0.0),  # two tiles: the second consumer's holds 2 softmax columns
    (1, 64, 256, 3, True, 0, 0.0),  # one row; two tiles, one a CTA where they are split
    (1100, 128, 1000, 999, True, 4, 0.03),  # eight tiles, four a CTA where they are split; big blanks in the last
]


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(
    "config",
    [
        hopper.Config(128, 2, 1, 1, 1),
        hopper.Config(128, 2, 1, 1, 2),
        hopper.Config(128, 2, 1, 1, 2, 2),
        hopper.Config(128, 2, 1, 1, 2, 3),
        hopper.Config(128, 2, 1, 2),
        hopper.Config(256, 2, 1, 1),
    ],
    ids=[
        "resident",
        "two-row-blocks",
        "two-row-blocks-split",
        "two-row-blocks-split-3",
        "cooperative-128",
        "cooperative-256",
    ],
)
@pytest.mark.parametrize("N, J, V, blank, with_bias, big_blanks, clamp", KERNEL_CASES)
def test_kernels_match_reference(N, J, V, blank, with_bias, big_blanks, clamp, config):
    """Every kernel shape (LogitsGemmPingpong: two consumers taking turns, H's tile kept in shared memory and the
    vocabulary tiles in turns, or two row blocks a CTA and H streamed; LogitsGemm, the cooperative kernel of wider
    rows) against the float32 references, the statistics with extra columns in the softmax; two row blocks with
    the gradient's vocabulary tiles split among two or three CTAs, evenly or not (refused over fewer tiles)."""
    H, W, bias, labels = random_inputs(N, J, V, torch.bfloat16, with_bias, seed=N + J)
    start = blank - big_blanks if big_blanks else V
    if config.vocab_groups > -(-V // config.tile_n):
        with pytest.raises(ValueError, match="config: expected vocab_groups 1, or at most"):
            hopper.projection(W, bias, config, extra=(start, big_blanks))
        return
    projection = hopper.projection(W, bias, config, extra=(start, big_blanks))
    den, z_blank, z_label, *extra = hopper.statistics_tile(projection, H, labels, blank)
    for name, got, want in zip(
        ("den", "z_blank", "z_label"), (den, z_blank, z_label), reference(H, W, bias, labels, blank)
    ):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-5, msg=lambda m: f"{name}: {m}")
    if big_blanks:
        torch.testing.assert_close(
            torch.stack(extra), (H.float() @ W[start:blank].float().t()).t(), atol=2e-4, rtol=2e-5
        )
    coefficients = random_coefficients(H, W, bias, labels, blank, seed=V)
    # the memory gradient_tile takes next, NaN first (the caching allocator hands the freed block back), so that a
    # tile or a row the kernel leaves unwritten shows
    tile_m = 64 * config.warpgroups
    address = torch.full(
        (max(-(-N // tile_m) * tile_m, N + 200), projection.col_bias.numel()),
        float("nan"),
        device="cuda",
        dtype=torch.bfloat16,
    ).data_ptr()
    G = hopper.gradient_tile(projection, H, labels, blank, coefficients, clamp, rows=N + 200)
    assert G.data_ptr() == address  # the NaN block, or the check below proves nothing
    want = gradient_reference(H, W, bias, labels, blank, coefficients, clamp)
    assert G.size(0) == N + 200 and (G[N:] == 0).all()  # the rows past N: the kernel's whole row tile, then a fill
    G = G[:N]
    assert (G[:, V:] == 0).all() and (G[::5] == 0).all()
    torch.testing.assert_close(G[:, :V].float(), want, atol=2e-3 * float(want.abs().max()), rtol=1e-2)


def test_default_config():
    """Two row blocks a CTA up to 1024 columns, the gradient's vocabulary tiles split between two CTAs where there
    are two or more; H's tile kept past them where it fits beside three stages of W; the cooperative kernel's
    128 x 256 tiles for wider rows."""
    assert hopper.default_config(500, 512) == hopper.Config(128, 2, 1, 1, 2, 2)
    assert hopper.default_config(1024, 2048) == hopper.Config(128, 2, 1, 1, 2, 2)
    assert hopper.default_config(300, 512) == hopper.Config(128, 2, 1, 1, 2, 2)
    assert hopper.default_config(129, 512) == hopper.Config(128, 2, 1, 1, 2, 2)
    assert hopper.default_config(128, 512) == hopper.Config(128, 2, 1, 1, 2, 1)
    assert hopper.default_config(8193, hopper.PINGPONG_MAX_J) == hopper.Config(128, 2, 1, 1, 1)
    assert hopper.default_config(8193, hopper.PINGPONG_MAX_J + 8) == hopper.Config(256, 2, 1, 1)


def fused_inputs(seed, J=64, V=100, rna=False, dtype=torch.float32):
    """joiner_batch's batch on the GPU (T_b = 1 and U_b = 0 among its utterances), the encoder and predictor outputs
    in ``dtype``, per-utterance weights with one zero (an utterance without a gradient)."""
    enc, pred, weight, bias, targets, T, U, w = joiner_batch(
        seed, B=6, max_t=20, max_u=8, J=J, V=V, rna=rna, device="cuda", dtype=torch.float32
    )
    enc, pred = (x.detach().to(dtype).requires_grad_() for x in (enc, pred))
    w = w.float()
    w[3] = 0
    return enc, pred, weight, bias, targets, T, U, w


def three_ways(monkeypatch, inputs, with_bias=True, activation="tanh", dropout=0.0, max_rows=50, **options):
    """(loss, gradients) of the fused loss under bf16 autocast on the Hopper kernels and on the other path, and of
    the float64 composition with the same dropout mask; the Hopper kernels must have run, on tiles within max_rows's
    memory."""
    enc, pred, weight, bias, targets, T, U, w = inputs
    params = (enc, pred, weight) + ((bias,) if with_bias else ())
    bias = bias if with_bias else None
    generator, seed = seeded(11)

    def run(fn, args, autocast):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(*args)
        grads = torch.autograd.grad((loss * w.to(loss.dtype)).sum(), args)
        return loss.detach().double(), [g.double() for g in grads]

    def fused(enc, pred, weight, *b):
        return fused_joiner_loss(
            enc,
            pred,
            weight,
            b[0] if b else None,
            targets,
            T,
            U,
            activation=activation,
            dropout=dropout,
            generator=generator.manual_seed(11),
            max_rows=max_rows,
            reduction="none",
            **options,
        )

    assert hopper.self_test(enc.device) is None  # before the count below: the self-test's kernels run on 200 rows
    calls = []  # the kernels' launches: (name, the tile's rows)
    for name in ("statistics_tile", "gradient_tile"):
        kernel = getattr(hopper, name)
        monkeypatch.setattr(
            hopper,
            name,
            lambda *a, kernel=kernel, name=name, **k: calls.append((name, a[1].size(0))) or kernel(*a, **k),
        )
    monkeypatch.setenv("TRANSDUCER_HOPPER", "1")
    new = run(fused, params, True)
    assert {"statistics_tile", "gradient_tile"} <= {name for name, _ in calls}
    # a tile's memory: backward's tiles of at most max_rows rows; forward's, of the hidden alone, at most the bytes of
    # max_rows rows of hidden and logits
    J, columns = weight.shape[1], weight.shape[0]
    forward = [rows for name, rows in calls if name == "statistics_tile"]
    backward = [rows for name, rows in calls if name == "gradient_tile"]
    assert all(rows * J <= max_rows * (J + columns) for rows in forward), (forward, max_rows)
    assert all(rows <= max_rows for rows in backward), (backward, max_rows)
    calls.clear()
    monkeypatch.setenv("TRANSDUCER_HOPPER", "0")
    today = run(fused, params, True)
    assert not calls
    exact = [x.detach().double().requires_grad_() for x in params]

    def composition(enc, pred, weight, *b):
        return composed(
            enc,
            pred,
            weight,
            b[0] if b else None,
            targets,
            T,
            U,
            activation,
            dropout,
            seed,
            reduction="none",
            **options,
        )

    return new, today, run(composition, exact, False)


def assert_within_todays_bound(new, today, ref):
    """The Hopper path's loss and gradients are off the float64 ones by at most twice what the other path is (plus
    1e-3 of their scale), and close to the other path's."""
    (new_loss, new_grads), (today_loss, today_grads), (ref_loss, ref_grads) = new, today, ref
    finite = torch.isfinite(ref_loss)
    assert torch.equal(finite, torch.isfinite(new_loss))
    scale = ref_loss[finite].abs().max()
    assert (new_loss - ref_loss)[finite].abs().max() <= 2 * (today_loss - ref_loss)[finite].abs().max() + 1e-3 * scale
    for got, other, want in zip(new_grads, today_grads, ref_grads):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 2 * (other - want).abs().max() + 1e-3 * want.abs().max()


def tdt_inputs(seed, D, V=100, J=64, blank=0):
    """fused_inputs with V token rows and D duration rows in the weight: labels in [0, V), not the blank."""
    enc, pred, weight, bias, targets, T, U, w = fused_inputs(seed, J=J, V=V + D)
    targets = targets % V
    targets[targets == blank] = (blank + 1) % V
    return enc, pred, weight, bias, targets, T, U, w


TDT_HOPPER_CASES = [  # id, durations, V, with_bias, activation, dropout, options
    ("tdt", [0, 1, 2, 3, 4], 100, True, "relu", 0.0, dict(sigma=0.05)),
    (
        "tdt-omega-clamp-fastemit-delay",
        [0, 1, 2],
        60,
        True,
        "tanh",
        0.0,
        dict(sigma=0.02, omega=0.3, clamp=0.02, fastemit_lambda=0.2, delay_penalty=0.1),
    ),
    ("tdt-no-duration-0", [1, 2], 40, False, "tanh", 0.2, dict(blank=5)),  # utterances without alignments
    ("tdt-across-tiles", [0, 1, 2, 3, 4], 126, True, "gelu", 0.0, dict(blank=-1, omega=0.1)),  # columns 126..130
    ("tdt-three-tokens", [0, 1, 2, 4], 3, True, "tanh", 0.0, dict(sigma=0.05)),  # threads without a token column
]


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("case", TDT_HOPPER_CASES, ids=[c[0] for c in TDT_HOPPER_CASES])
def test_fused_tdt_on_hopper(monkeypatch, case):
    """TDT on the Hopper kernels (the duration scores from the statistics' extra columns, their gradient written into
    the kernel's G) against the other path and the float64 tdt_loss composition."""
    _, durations, V, with_bias, activation, dropout, options = case
    blank = options.get("blank", 0) % V
    inputs = tdt_inputs(640 + TDT_HOPPER_CASES.index(case), len(durations), V, blank=blank)
    assert_within_todays_bound(
        *three_ways(monkeypatch, inputs, with_bias, activation, dropout, max_rows=70, durations=durations, **options)
    )


def multiblank_inputs(seed, K, V=100, J=64, blank=-1):
    """fused_inputs for the multi-blank loss: labels in [0, V) off the blank and its K big blanks' columns."""
    enc, pred, weight, bias, targets, T, U, w = fused_inputs(seed, J=J, V=V)
    blank %= V
    allowed = torch.tensor([v for v in range(V) if not blank - K <= v <= blank], device=targets.device)
    return enc, pred, weight, bias, allowed[targets % allowed.numel()], T, U, w


MULTIBLANK_HOPPER_CASES = [  # id, big_blank_durations, V, with_bias, activation, dropout, options
    ("multiblank", [2, 3], 100, True, "tanh", 0.0, dict(blank=-1, sigma=0.05)),
    (
        "multiblank-clamp-fastemit-delay",
        [2, 4, 8],
        60,
        False,
        "relu",
        0.2,
        dict(blank=-1, sigma=0.02, clamp=0.02, fastemit_lambda=0.2, delay_penalty=0.1),
    ),
    ("multiblank-across-tiles", [2, 3, 4, 5], 200, True, "gelu", 0.0, dict(blank=129)),  # columns 125..128
]


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("case", MULTIBLANK_HOPPER_CASES, ids=[c[0] for c in MULTIBLANK_HOPPER_CASES])
def test_fused_multiblank_on_hopper(monkeypatch, case):
    """The multi-blank loss on the Hopper kernels (the big blanks' logits from the statistics' extra columns, their
    arcs subtracted in the gradient's epilogue) against the other path and the float64 multiblank_loss
    composition."""
    _, durations, V, with_bias, activation, dropout, options = case
    inputs = multiblank_inputs(660 + MULTIBLANK_HOPPER_CASES.index(case), len(durations), V, blank=options["blank"])
    assert_within_todays_bound(
        *three_ways(
            monkeypatch, inputs, with_bias, activation, dropout, max_rows=70, big_blank_durations=durations, **options
        )
    )


FUSED_CASES = [  # id, rna, with_bias, activation, dropout, options
    ("rnnt", False, True, "tanh", 0.0, {}),
    ("rna", True, True, "tanh", 0.0, {}),
    ("clamp", False, True, "tanh", 0.0, dict(clamp=0.01)),
    ("fastemit-delay", False, True, "tanh", 0.0, dict(fastemit_lambda=0.3, delay_penalty=0.2)),
    ("rna-clamp-fastemit-delay", True, False, "relu", 0.0, dict(clamp=0.02, fastemit_lambda=0.1, delay_penalty=-0.1)),
    ("dropout-no-bias", False, False, "tanh", 0.3, dict(blank=7)),
] + [(f"activation-{a}", False, True, a, 0.0, {}) for a in ACTIVATIONS]


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("case", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_loss_on_hopper(monkeypatch, case):
    _, rna, with_bias, activation, dropout, options = case
    inputs = fused_inputs(600 + FUSED_CASES.index(case), rna=rna)
    assert_within_todays_bound(
        *three_ways(monkeypatch, inputs, with_bias, activation, dropout, one_sym_per_frame=rna, **options)
    )


@pytest.mark.cuda
@needs_hopper
def test_fused_loss_on_hopper_wide_vocabulary_bf16_inputs(monkeypatch):
    """bf16 encoder and predictor outputs, J = 128 and V = 1500 (six 256-column tiles, the last partial)."""
    inputs = fused_inputs(620, J=128, V=1500, dtype=torch.bfloat16)
    assert_within_todays_bound(*three_ways(monkeypatch, inputs, max_rows=300))


@pytest.mark.cuda
@needs_hopper
def test_fused_loss_on_hopper_unaligned_bf16_weight(monkeypatch):
    """A bf16 weight that does not start on a 16-byte boundary (a view 2 bytes into its storage): TMA needs one that
    does, so the kernels read an aligned copy, and its gradient still reaches the view."""
    enc, pred, weight, bias, targets, T, U, w = fused_inputs(630)
    unaligned = torch.empty(weight.numel() + 1, device="cuda", dtype=torch.bfloat16)[1:].view_as(weight)
    unaligned = unaligned.copy_(weight.detach()).requires_grad_()
    assert unaligned.data_ptr() % 16
    assert hopper.projection(unaligned, None).W.data_ptr() % 16 == 0
    assert_within_todays_bound(*three_ways(monkeypatch, (enc, pred, unaligned, bias, targets, T, U, w)))


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("V", [2, 5])
def test_fused_loss_on_hopper_few_token_columns(monkeypatch, V):
    """Fewer token columns than the four threads of a row hold (2 of every 8 each): the threads holding none keep an
    empty sum through every vocabulary tile."""
    assert_within_todays_bound(*three_ways(monkeypatch, fused_inputs(650 + V, V=V)))


@pytest.mark.cuda
@needs_hopper
def test_fuzz_against_todays_path(monkeypatch):
    """Random ragged batches and options: lengths, V from 2 to 256, the blank, RNN-T or RNA, clamp, FastEmit, the
    delay penalty, dropout, the activation, the bias and the tile size."""
    rng = random.Random(0)
    for trial in range(12):
        rna = rng.random() < 0.3
        options = dict(
            blank=0,
            clamp=rng.choice([0.0, 0.0, 0.05]),
            fastemit_lambda=rng.choice([0.0, 0.2]),
            delay_penalty=rng.choice([0.0, 0.1]),
        )
        inputs = fused_inputs(700 + trial, V=rng.randint(2, 256), rna=rna)
        assert_within_todays_bound(
            *three_ways(
                monkeypatch,
                inputs,
                rng.random() < 0.5,
                rng.choice(list(ACTIVATIONS)),
                rng.choice([0.0, 0.2]),
                max_rows=rng.choice([1, 7, 64, 10000]),
                one_sym_per_frame=rna,
                **options,
            )
        )


@pytest.mark.cuda
@needs_hopper
def test_hopper_backward_reads_nothing_back(monkeypatch):
    """The Hopper path's eager backward synchronises with nothing (its rows' labels and coefficients stay on the
    GPU)."""
    monkeypatch.setenv("TRANSDUCER_HOPPER", "1")
    enc, pred, weight, bias, targets, T, U, _ = fused_inputs(630)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fused_joiner_loss(enc, pred, weight, bias, targets, T, U, reduction="sum")
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(enc.grad).all() and enc.grad.abs().max() > 0


def test_which_path_runs(monkeypatch, caplog):
    """The Hopper kernels take every lattice with 16-bit GEMMs on sm_90 only, J a positive multiple of 8, where they
    pass their self-test, unless TRANSDUCER_HOPPER=0; each answer is logged once on the transducer logger, a failed
    self-test as a warning."""
    import transducer.fused.hopper_tiles as fused_hopper

    monkeypatch.setattr(fused_hopper, "_said", set())
    monkeypatch.setattr(fused_hopper, "_available", lambda device: device.type == "cuda")
    failure = {}
    monkeypatch.setattr(hopper, "self_test", lambda device: failure.get(device.index))
    monkeypatch.delenv("TRANSDUCER_HOPPER", raising=False)
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger="transducer"):
        assert use_hopper(RNNT, torch.bfloat16, cuda, 64)  # on by default
        assert use_hopper(RNNT, torch.float16, cuda, 64)
        monkeypatch.setenv("TRANSDUCER_HOPPER", "1")
        assert use_hopper(RNNT, torch.bfloat16, cuda, 64)
        assert use_hopper(TDT, torch.bfloat16, cuda, 64)
        assert use_hopper(MULTIBLANK, torch.bfloat16, cuda, 64)
        assert not use_hopper(RNNT, torch.float32, cuda, 64)
        assert not use_hopper(RNNT, torch.bfloat16, cuda, 60)
        assert not use_hopper(RNNT, torch.bfloat16, cuda, 0)
        assert not use_hopper(RNNT, torch.bfloat16, torch.device("cpu"), 64)
        failure[1] = "RuntimeError: no kernel image"
        assert not use_hopper(RNNT, torch.bfloat16, torch.device("cuda:1"), 64)
        assert use_hopper(RNNT, torch.bfloat16, cuda, 64)
        monkeypatch.setenv("TRANSDUCER_HOPPER", "off")
        assert not use_hopper(RNNT, torch.bfloat16, cuda, 64)
        monkeypatch.setenv("TRANSDUCER_HOPPER", "0")
        assert not use_hopper(RNNT, torch.bfloat16, cuda, 64)
    records = [r for r in caplog.records if r.name == "transducer"]
    lines = [r.getMessage() for r in records]
    assert len(lines) == 10  # one line an answer: the later bf16 and fp16 RNN-T calls give the first one again
    assert all("Hopper kernels" in line for line in lines[:3]) and "the TDT lattice" in lines[1]
    assert "the multi-blank RNN-T lattice" in lines[2] and "TRANSDUCER_HOPPER=off" in lines[-2]
    assert "TRANSDUCER_HOPPER=0" in lines[-1]
    assert [r.levelno for r in records].count(logging.WARNING) == 1
    warning = next(r.getMessage() for r in records if r.levelno == logging.WARNING)
    assert "self-test on cuda:1: RuntimeError: no kernel image" in warning and "cuBLAS" in warning


@pytest.mark.cuda
@needs_hopper
def test_self_test_passes_and_is_kept():
    """The kernels pass their self-test on this GPU; the answer is kept per device index ('cuda' and 'cuda:0' alike)
    and not made during CUDA graph capture."""
    index = torch.cuda.current_device()
    assert hopper.self_test(torch.device("cuda", index)) is None
    assert hopper.self_test(torch.device("cuda")) is None
    assert index in hopper._self_tests
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    saved = hopper._self_tests.pop(index)
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            assert hopper.self_test(torch.device("cuda", index)) == "not run during CUDA graph capture"
        assert index not in hopper._self_tests
    finally:
        hopper._self_tests[index] = saved
