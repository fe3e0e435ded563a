"""The fused joiner loss against the unfused composition transducer_loss(F.linear(act(pack(...)))), on
every device: float64 exactness, gradcheck, float32, bf16 autocast and mixed input dtypes, tiles that split
utterances, TDT; the module, opcheck and torch.compile; bad input and options. (The stages it tiles over are
tested in test_stages.py.)"""

import math
import types
import weakref

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from _batches import DEVICES, random_targets

import transducer.fused.op as fused_op_module
from transducer import FusedJoinerLoss, fused_joiner_loss, multiblank_loss, pack, tdt_loss, transducer_loss
from transducer.joiner import ACTIVATIONS, Dropout, dropout_mask
from transducer.options import LossOptions


def joiner_batch(seed, B=5, max_t=8, max_u=4, J=12, V=17, blank=0, rna=False, dtype=torch.float64, device="cpu"):
    """The fused loss's inputs on ``device``: encoder and predictor outputs (B, max_t, J) and (B, max_u + 1, J), the
    joint's weight (V, J) and bias (V,), all leaves that require grad; random_targets' targets and lengths, with
    T_b = 1 and U_b = 0 in utterance 1 and U_b = 0 in utterance 2; per-utterance weights in [0.5, 1.5)."""
    gen = torch.Generator().manual_seed(seed)
    targets, T, U = random_targets(gen, B, max_t, max_u, V, blank, rna=rna, edges=True)
    U[1] = 0
    enc = torch.randn(B, max_t, J, generator=gen, dtype=torch.float64)
    pred = torch.randn(B, max_u + 1, J, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, J, generator=gen, dtype=torch.float64) * 0.5
    bias = torch.randn(V, generator=gen, dtype=torch.float64)
    grads = [t.to(device, dtype).requires_grad_() for t in (enc, pred, weight, bias)]
    return (
        *grads,
        targets.to(device),
        T.to(device),
        U.to(device),
        torch.rand(B, generator=gen, dtype=torch.float64).to(device) + 0.5,
    )


def unfused(enc, pred, weight, bias, targets, T, U, activation="tanh", **options):
    h = pack(enc, pred, T, U)
    h = torch.tanh(h) if activation == "tanh" else torch.relu(h) if activation == "relu" else h
    return transducer_loss(F.linear(h, weight, bias), targets, T, U, **options)


def both(seed, device, dtype=torch.float64, reduction="none", activation="tanh", bias=True, max_rows=None, **options):
    """(losses, gradients) of the fused and the unfused loss on the same batch, weighted per utterance."""
    enc, pred, weight, b, targets, T, U, w = joiner_batch(
        seed, dtype=dtype, device=device, rna=options.get("one_sym_per_frame", False), blank=options.get("blank", 0)
    )
    b = b if bias else None
    params = (enc, pred, weight) + ((b,) if bias else ())
    out = []
    for fn in (
        lambda: fused_joiner_loss(
            enc,
            pred,
            weight,
            b,
            targets,
            T,
            U,
            activation=activation,
            reduction=reduction,
            max_rows=max_rows,
            **options,
        ),
        lambda: unfused(enc, pred, weight, b, targets, T, U, activation, reduction=reduction, **options),
    ):
        loss = fn()
        objective = (loss * w.to(loss.dtype)).sum() if reduction == "none" else loss * 1.7
        out.append((loss.detach(), torch.autograd.grad(objective, params)))
    return out


CASES = [  # activation, reduction, max_rows (tiles split utterances), options
    ("tanh", "none", None, {}),
    ("tanh", "mean", 5, {}),
    ("relu", "sum", 1, {}),
    ("identity", "none", 7, dict(blank=3)),
    ("tanh", "none", 11, dict(one_sym_per_frame=True)),
    ("tanh", "mean", 6, dict(clamp=0.05, fastemit_lambda=0.3, delay_penalty=0.2)),
    ("relu", "none", 4, dict(one_sym_per_frame=True, zero_infinity=True, delay_penalty=-0.1)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_float64_equals_unfused(device, case):
    activation, reduction, max_rows, options = CASES[case]
    (fused, fused_grads), (want, want_grads) = both(
        500 + case, device, reduction=reduction, activation=activation, bias=case != 2, max_rows=max_rows, **options
    )
    torch.testing.assert_close(fused, want, rtol=1e-10, atol=1e-12)
    for got, exp in zip(fused_grads, want_grads):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)


def test_gemm_rows_are_few_shapes_of_little_padding():
    from transducer.fused.tiles import gemm_rows

    for rows in list(range(1, 5000)) + list(range(100_000, 140_000, 7)):
        got = gemm_rows(rows, "cuda")
        assert rows <= got <= max(rows * 33 / 32, rows + 7) and got % 8 == 0, rows
    # Protocol A's tiles (110,672 to 131,432 rows over 40 batches) in at most 12 shapes
    assert len({gemm_rows(rows, "cuda") for rows in range(110_000, 131_433)}) <= 12
    assert gemm_rows(12345, "cpu") == 12345


def test_tf32_setting_read_either_way():
    """Whether the fp32 GEMMs may run in TF32 (which decides where the fp32 backward takes db) is read from torch's
    older settings and from its newer fp32_precision alike; the older getters raise once the newer one is set. The
    settings are process-wide (a library imported by an earlier test may have set them): restored after."""
    from transducer.fused.op import tf32_matmul

    matmul = torch.backends.cuda.matmul
    newer = hasattr(matmul, "fp32_precision")  # torch 2.9 and later
    # torch.get_float32_matmul_precision too: setting the flags below moves it to "high" (TF32), which the two
    # newer settings' restoring does not undo
    saved = (matmul.fp32_precision, torch.backends.fp32_precision) if newer else matmul.allow_tf32
    saved_precision = torch.get_float32_matmul_precision()
    try:
        matmul.allow_tf32 = False
        assert tf32_matmul() is False
        matmul.allow_tf32 = True
        assert tf32_matmul() is True
        if newer:
            matmul.fp32_precision = "ieee"
            assert tf32_matmul() is False
            matmul.fp32_precision = "tf32"
            assert tf32_matmul() is True
    finally:
        torch.set_float32_matmul_precision(saved_precision)
        if newer:
            matmul.fp32_precision, torch.backends.fp32_precision = saved
        else:
            matmul.allow_tf32 = saved
    assert tf32_matmul() is (saved_precision != "highest" if newer else saved)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [{}, dict(bias=False), dict(durations=[0, 1, 2])])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_padded_gemm_rows_change_nothing(device, options, dtype, monkeypatch):
    """The tiles' GEMMs over rows padded with zero hidden rows (transducer.fused.tiles.gemm_rows: on CUDA by
    default) give the loss and
    gradients of unpadded ones; bf16 under autocast (the Hopper kernels where they run)."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 GEMMs: CUDA")
    from transducer.fused import cublas_tiles, hopper_tiles

    options = dict(options)
    bias = options.pop("bias", True)
    enc, pred, weight, b, targets, T, U, w = joiner_batch(530, device=device, J=16)  # J % 8 == 0: the Hopper path
    if "durations" in options:
        targets = targets % 14 + (targets % 14 == 0)  # 17 - 3 token columns, no blank (0)
    b = b if bias else None
    params = (enc, pred, weight) + ((b,) if bias else ())

    def run(pad):
        for path in (cublas_tiles, hopper_tiles):
            monkeypatch.setattr(path, "gemm_rows", lambda rows, device_type: rows + pad)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype != torch.float64):
            loss = fused_joiner_loss(enc, pred, weight, b, targets, T, U, max_rows=9, reduction="none", **options)
        return loss.detach(), torch.autograd.grad((loss * w.to(loss.dtype)).sum(), params)

    (padded, padded_grads), (plain, plain_grads) = run(13), run(0)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(padded, plain, **tol)
    for got, want in zip(padded_grads, plain_grads):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_equals_unfused(device):
    (fused, fused_grads), (want, want_grads) = both(520, device, dtype=torch.float32, max_rows=9)
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)
    for got, exp in zip(fused_grads, want_grads):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["tanh", "leaky_relu"])
def test_gradcheck(device, activation):
    """The gradients of the loss it returns; leaky_relu: its slope on both sides of 0 against its forward."""
    enc, pred, weight, bias, targets, T, U, _ = joiner_batch(530, B=3, max_t=4, max_u=2, J=3, V=5, device=device)
    assert torch.autograd.gradcheck(
        lambda e, p, w, b: fused_joiner_loss(
            e, p, w, b, targets, T, U, max_rows=4, reduction="none", activation=activation
        ),
        (enc, pred, weight, bias),
        eps=1e-6,
        atol=1e-7,
        rtol=1e-5,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_within_the_unfused_bound(device):
    """Under bf16 autocast the GEMMs run in bf16, the loss in fp32. The bound: the fused loss and gradients are
    off the fp32 ones by at most twice what the unfused bf16 path is (plus 1e-3 of the gradient's scale)."""
    enc, pred, weight, bias, targets, T, U, _ = joiner_batch(
        540, B=6, max_t=20, max_u=8, J=64, V=100, device=device, dtype=torch.float32
    )
    params = (enc, pred, weight, bias)

    def run(fn, autocast):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = fn()
        return loss.detach(), torch.autograd.grad(loss, params)

    fused = lambda: fused_joiner_loss(enc, pred, weight, bias, targets, T, U, max_rows=50)  # noqa: E731
    ref_loss, ref_grads = run(fused, False)
    un_loss, un_grads = run(lambda: unfused(enc, pred, weight, bias, targets, T, U), True)
    fu_loss, fu_grads = run(fused, True)
    assert fu_loss.dtype == torch.float32
    assert abs(fu_loss - ref_loss) <= 2 * abs(un_loss - ref_loss) + 1e-3 * abs(ref_loss)
    for fu, un, ref in zip(fu_grads, un_grads, ref_grads):
        assert fu.dtype == ref.dtype
        bound = 2 * (un - ref).abs().max() + 1e-3 * ref.abs().max()
        assert (fu - ref).abs().max() <= bound


def composed(enc, pred, weight, bias, targets, T, U, activation, dropout, seed, durations=None, **options):
    """transducer_loss(F.linear(dropout(act(pack(...))), weight, bias)) with the fused loss's mask for ``seed``; with
    ``durations``, tdt_loss of the same logits, with ``big_blank_durations`` multiblank_loss."""
    h = ACTIVATIONS[activation].forward(pack(enc, pred, T, U))
    if dropout:
        h = h * dropout_mask(Dropout(dropout, seed), h.size(0), h.size(1), dtype=h.dtype, device=h.device)
    if durations:
        return tdt_loss(F.linear(h, weight, bias), targets, T, U, durations, **options)
    if options.get("big_blank_durations"):
        return multiblank_loss(F.linear(h, weight, bias), targets, T, U, **options)
    return transducer_loss(F.linear(h, weight, bias), targets, T, U, **options)


def seeded(seed):
    """(a generator for fused_joiner_loss, the dropout seed it will draw from it)."""
    drawn = int(torch.randint((1 << 63) - 1, (), generator=torch.Generator().manual_seed(seed)))
    return torch.Generator().manual_seed(seed), drawn


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_activations_and_dropout_equal_the_composition(device, activation, dropout):
    """Every activation of the table, with and without dropout, in float64: the loss and the four gradients of
    the unfused composition with the same mask, tiles of 7 rows splitting utterances (the mask follows the row)."""
    enc, pred, weight, bias, targets, T, U, w = joiner_batch(590, device=device)
    params = (enc, pred, weight, bias)
    generator, seed = seeded(5)
    results = []
    for fn in (
        lambda: fused_joiner_loss(
            enc,
            pred,
            weight,
            bias,
            targets,
            T,
            U,
            activation=activation,
            dropout=dropout,
            generator=generator,
            max_rows=7,
            reduction="none",
        ),
        lambda: composed(enc, pred, weight, bias, targets, T, U, activation, dropout, seed, reduction="none"),
    ):
        loss = fn()
        results.append((loss.detach(), torch.autograd.grad((loss * w).sum(), params)))
    (got, got_grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for g, wg in zip(got_grads, want_grads):
        torch.testing.assert_close(g, wg, rtol=1e-9, atol=1e-10)
    if dropout:  # another seed, another mask
        other = fused_joiner_loss(
            enc,
            pred,
            weight,
            bias,
            targets,
            T,
            U,
            activation=activation,
            dropout=dropout,
            generator=torch.Generator().manual_seed(6),
            reduction="none",
        )
        assert (other - want).abs().max() > 1e-3


def test_first_tile_and_the_tiles_after_it():
    """tiles.first_tile: max_rows on a multiple of 8 (from 64 rows on), on CUDA where the bound is at least twice it,
    else none; tiles_after: that tile, then ``tiles`` of the rest, every tile within max_rows and its start on a
    multiple of 8 past the first."""
    from transducer.fused.tiles import first_tile, tiles, tiles_after

    assert first_tile(1000, 2000, "cuda") == 1000 and first_tile(1003, 2006, "cuda") == 1000
    assert first_tile(1000, 1999, "cuda") == first_tile(1000, 10**6, "cpu") == 0
    assert first_tile(9, 18, "cuda") == 9  # below 64 rows: tiles starts them anywhere
    assert tiles_after(1000, 0, 1000) == [] and tiles_after(1000, 999, 1000) == [(0, 999)]
    assert tiles_after(1000, 1000, 1000) == [(0, 1000)]
    assert tiles_after(1000, 1005, 1000) == [(0, 1000), (1000, 1005)]
    for num_rows in (1001, 2500, 7777):
        bounds = tiles_after(1000, num_rows, 1000)
        assert bounds[0] == (0, 1000) and bounds[1:] == [(1000 + s, 1000 + e) for s, e in tiles(num_rows - 1000, 1000)]
        assert all(e - s <= 1000 and s % 8 == 0 for s, e in bounds) and bounds[-1][1] == num_rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("first, max_rows", [(8, 96), (64, 96), (96, 96), (160, 200), (200, 200)])
@pytest.mark.parametrize("options", [{}, dict(durations=[0, 1, 2])])
def test_a_first_tile_before_the_row_count_changes_nothing(device, first, max_rows, options, monkeypatch):
    """Forward's first tile launched before the row count is known (TilePath.begin_forward, forced here on every
    device: by default on CUDA for large batches alone) gives the loss and gradients of the tiles that wait for it,
    whether the batch's rows (153) fill it and more tiles follow, or it holds them all and pack_forward leaves its
    rows past the layout's zeros; on both tile paths."""
    from transducer.fused import cublas_tiles, hopper_tiles

    enc, pred, weight, b, targets, T, U, w = joiner_batch(531, device=device, J=16, max_t=11, max_u=6)
    assert int((T * (U + 1)).sum()) == 153
    if "durations" in options:
        targets = targets % 14 + (targets % 14 == 0)  # 17 - 3 token columns, no blank (0)
    params = (enc, pred, weight, b)

    def run(rows):
        for path in (cublas_tiles, hopper_tiles):
            monkeypatch.setattr(path, "first_tile", lambda max_rows, bound, device_type: min(rows, max_rows))
        loss = fused_joiner_loss(enc, pred, weight, b, targets, T, U, max_rows=max_rows, reduction="none", **options)
        return loss.detach(), torch.autograd.grad((loss * w.to(loss.dtype)).sum(), params)

    (early, early_grads), (plain, plain_grads) = run(first), run(0)
    torch.testing.assert_close(early, plain, rtol=1e-12, atol=1e-12)
    for got, want in zip(early_grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_forward_frees_each_tiles_logits_before_the_next(monkeypatch):
    """Forward holds two tile buffers at a time (a tile's hidden and its logits): each tile's logits, begin_forward's
    first among them, are freed before the next tile's hidden is packed (forced first tile, the CPU's tiles; on CUDA
    the step's peak in benchmarks/fused_step.py)."""

    from transducer.fused import cublas_tiles

    logits, checked = [], []
    linear, hidden = cublas_tiles.F.linear, cublas_tiles.hidden

    def record_logits(*args):
        z = linear(*args)
        logits.append(weakref.ref(z))
        return z

    def check_hidden(*args, **kwargs):
        checked.append(len(logits))
        assert all(ref() is None for ref in logits), "a tile's logits outlived it"
        return hidden(*args, **kwargs)

    monkeypatch.setattr(cublas_tiles, "F", types.SimpleNamespace(linear=record_logits))
    monkeypatch.setattr(cublas_tiles, "hidden", check_hidden)
    monkeypatch.setattr(cublas_tiles, "first_tile", lambda max_rows, bound, device_type: max_rows)
    enc, pred, weight, bias, targets, T, U, _ = joiner_batch(602)
    with torch.no_grad():
        fused_joiner_loss(enc, pred, weight, bias, targets, T, U, max_rows=16)
    assert checked[:2] == [0, 1] and len(checked) == len(logits) > 2  # begin_forward's tile, then the others


def test_backward_writes_dh_into_the_hidden(monkeypatch):
    """Every backward tile's dh, which pack's backward reads, lies in that tile's hidden's memory, and a pass's tiles
    take turns in one buffer: a tile holds two buffers (tests the CPU's tiles; on CUDA the peak test below)."""
    import transducer.cpu.stages as cpu_stages
    import transducer.fused.op as op
    from transducer.fused.tiles import tiles

    hidden, dh = [], []
    rows_in_place, pack_backward_add = op.rows_in_place, cpu_stages.pack_backward_add

    def record_hidden(hx, width):
        hidden.append(hx.data_ptr())
        return rows_in_place(hx, width)

    def record_dh(grad_rows, *args, **kwargs):
        dh.append(grad_rows.data_ptr())
        return pack_backward_add(grad_rows, *args, **kwargs)

    monkeypatch.setattr(op, "rows_in_place", record_hidden)
    monkeypatch.setattr(cpu_stages, "pack_backward_add", record_dh)
    enc, pred, weight, bias, targets, T, U, _ = joiner_batch(601)
    fused_joiner_loss(enc, pred, weight, bias, targets, T, U, activation="tanh", max_rows=64).sum().backward()
    assert len(dh) == len(hidden) == len(list(tiles(int((T * (U + 1)).sum()), 64))) > 1
    assert dh == hidden and len(set(hidden)) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("hopper", ["0", "1"])
def test_backward_holds_two_tile_buffers(hopper, monkeypatch):
    """The backward holds two tile buffers at a time (a tile's hidden and its logits' gradient, then that gradient and
    dh in the hidden's place): its peak beyond what was allocated before it stays under two buffers of its largest
    tile (4096 rows: hidden with the bias's columns, the gradient at the padded width 1024) plus the per-row
    arrays, the gradients and 1 MiB. A third buffer (the tile's gradient kept alive across pack's backward, 8 MiB)
    would exceed it. On both tile paths (TRANSDUCER_HOPPER: the Hopper kernels where they run)."""
    monkeypatch.setenv("TRANSDUCER_HOPPER", hopper)
    gen = torch.Generator().manual_seed(7)
    B, T, U, J, V = 4, 200, 50, 64, 1000
    enc = torch.randn(B, T, J, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    pred = torch.randn(B, U + 1, J, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, J, generator=gen) * 0.1).cuda().requires_grad_()
    bias = torch.zeros(V, device="cuda", requires_grad=True)
    targets = torch.randint(1, V, (B, U), generator=gen).cuda()
    lengths = torch.full((B,), T, device="cuda"), torch.full((B,), U, device="cuda")

    def forward():
        enc.grad = pred.grad = weight.grad = bias.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fused_joiner_loss(enc, pred, weight, bias, targets, *lengths, max_rows=4096, reduction="sum")

    forward().backward()  # the first backward allocates cuBLAS's workspaces (tens of MiB), which stay
    loss = forward()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - base
    rows = B * T * (U + 1)  # 10 tiles of 4080 rows, 4096 in the GEMMs
    buffers = (4096 + 128) * (J + 8 + 1024) * 2
    per_row = rows * 32
    grads = (B * T * J + B * (U + 1) * J + 1024 * (J + 8)) * 4 * 2
    assert enc.grad is not None and torch.isfinite(weight.grad).all()
    assert peak <= buffers + per_row + grads + (1 << 20), (peak, buffers + per_row + grads + (1 << 20))


@pytest.mark.cuda
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_activations_and_dropout_16bit_within_the_unfused_bound(activation, dropout, dtype):
    """The pack kernels' 16-bit paths (16-bit inputs, or fp32 inputs under autocast) for every activation, with and
    without dropout: within twice the unfused autocast composition's error of the float64 composition."""
    enc, pred, weight, bias, targets, T, U, _ = joiner_batch(
        595, B=6, max_t=20, max_u=8, J=64, V=100, device="cuda", dtype=torch.float32
    )
    enc, pred = (x.detach().to(dtype).requires_grad_() for x in (enc, pred))
    params = (enc, pred, weight, bias)
    generator, seed = seeded(9)
    half = torch.float16 if dtype == torch.float16 else torch.bfloat16

    def run(fn, inputs, autocast):
        with torch.autocast("cuda", dtype=half, enabled=autocast):
            loss = fn(*inputs)
        return loss.detach().double(), [g.double() for g in torch.autograd.grad(loss, inputs)]

    exact = [x.detach().double().requires_grad_() for x in params]
    ref_loss, ref_grads = run(lambda *x: composed(*x, targets, T, U, activation, dropout, seed), exact, False)
    un_loss, un_grads = run(lambda *x: composed(*x, targets, T, U, activation, dropout, seed), params, True)
    fu_loss, fu_grads = run(
        lambda *x: fused_joiner_loss(
            *x, targets, T, U, activation=activation, dropout=dropout, generator=generator, max_rows=50
        ),
        params,
        True,
    )
    assert abs(fu_loss - ref_loss) <= 2 * abs(un_loss - ref_loss) + 1e-3 * abs(ref_loss)
    for fu, un, ref in zip(fu_grads, un_grads, ref_grads):
        assert (fu - ref).abs().max() <= 2 * (un - ref).abs().max() + 1e-3 * ref.abs().max()


def test_dropout_keeps_elements_at_the_rate_it_scales_by():
    """The mask keeps an element where its 24-bit hash clears round(p 2^24) and scales it by 1 / (1 - p): up to
    the largest rate the two agree to 2^-15, so that the mask's mean is 1; past it the rate is refused."""
    from transducer.joiner import MAX_DROPOUT, Dropout, check_dropout

    for p in (0.0, 0.1, 0.5, 0.9, 0.999, MAX_DROPOUT):
        kept = ((1 << 24) - Dropout(p, 0).threshold) / (1 << 24)
        assert abs(kept / (1 - p) - 1) <= 2**-15, p
        check_dropout(p)
    for p in (1 - 2**-10 + 2**-30, 1 - 2**-11, 1 - 1e-8, 1.0):
        with pytest.raises(ValueError, match="dropout: expected a number in"):
            check_dropout(p)


@pytest.mark.parametrize("device", DEVICES)
def test_module_dropout_in_training_only(device):
    """In training mode the module's loss is the composition with dropout's mask for the seed it draws from torch's
    default generator; in eval mode the composition without dropout, as a module without dropout computes it."""
    torch.manual_seed(0)  # the weights, whichever tests ran before
    m = FusedJoinerLoss(12, 17, dropout=0.4, max_rows=8).to(device).double()
    enc, pred, _, _, targets, T, U, _ = joiner_batch(597, device=device)
    _, seed = seeded(3)
    torch.manual_seed(3)
    first = m(enc, pred, targets, T, U)
    torch.manual_seed(3)
    assert torch.equal(m(enc, pred, targets, T, U), first)
    joiner = (enc, pred, m.output.weight, m.output.bias, targets, T, U, "tanh")
    with_mask, without = composed(*joiner, 0.4, seed), composed(*joiner, 0.0, None)
    torch.testing.assert_close(first, with_mask, rtol=1e-10, atol=1e-12)
    assert (with_mask - without).abs() > 1e-3 * without  # the mask matters to this loss
    m.eval()
    torch.testing.assert_close(m(enc, pred, targets, T, U), without, rtol=1e-10, atol=1e-12)
    plain = FusedJoinerLoss(12, 17, max_rows=8).to(device).double()
    plain.load_state_dict(m.state_dict())
    assert torch.equal(m(enc, pred, targets, T, U), plain(enc, pred, targets, T, U))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtypes", [(torch.float32, torch.float64), (torch.float64, torch.float32)], ids=["fp32-fp64", "fp64-fp32"]
)
def test_mixed_dtypes_promote_as_the_sum_does(device, dtypes):
    """Encoder and predictor outputs of different dtypes, outside autocast: the sum, the activation and the
    GEMMs in the promoted dtype (float64 here), as enc + pred computes them, exactly the unfused composition;
    each input's gradient in its own dtype. pack likewise."""
    enc, pred, weight, bias, targets, T, U, w = joiner_batch(545, device=device)
    enc = enc.detach().to(dtypes[0]).requires_grad_()
    pred = pred.detach().to(dtypes[1]).requires_grad_()
    params = (enc, pred, weight, bias)
    rows = pack(enc, pred, T, U)
    assert rows.dtype == torch.float64
    torch.testing.assert_close(rows, pack(enc.double(), pred.double(), T, U), rtol=0, atol=0)
    results = []
    for fn in (
        lambda: fused_joiner_loss(enc, pred, weight, bias, targets, T, U, max_rows=7, reduction="none"),
        lambda: unfused(enc, pred, weight, bias, targets, T, U, reduction="none"),
    ):
        loss = fn()
        results.append((loss.detach(), torch.autograd.grad((loss * w).sum(), params)))
    (fused, fused_grads), (want, want_grads) = results
    assert fused.dtype == torch.float64
    torch.testing.assert_close(fused, want, rtol=1e-10, atol=1e-12)
    for got, exp, x in zip(fused_grads, want_grads, params):
        assert got.dtype == exp.dtype == x.dtype
        tol = dict(rtol=1e-10, atol=1e-12) if x.dtype == torch.float64 else dict(rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got, exp, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)],
    ids=["fp32", "fp32-bf16", "bf16"],
)
@pytest.mark.parametrize("J", [64, 36, 35])  # the pack passes' vectors: 8, 4 and 1 elements
@pytest.mark.parametrize("loss", ["rnnt", "tdt", "multiblank"])
def test_autocast_inputs_as_models_give_them(device, dtypes, J, loss):
    """Under bf16 autocast, encoder and predictor outputs as models give them (fp32 after a LayerNorm, bf16
    after an LSTM or a Linear, mixed): the fused loss computes what the unfused composition computes under
    the same autocast (the sum and act in the promoted dtype, the GEMMs in bf16, the loss in fp32), within
    twice the unfused path's distance from the float64 loss of the same inputs; gradients in each input's
    dtype. TDT: 3 duration rows after the 100 token rows; multi-blank: 2 big blanks and the blank after them."""
    enc, pred, weight, bias, targets, T, U, _ = joiner_batch(
        547, B=6, max_t=20, max_u=8, J=J, V=100, device=device, dtype=torch.float32
    )
    enc = enc.detach().to(dtypes[0]).requires_grad_()
    pred = pred.detach().to(dtypes[1]).requires_grad_()
    options, loss_fn = {}, transducer_loss
    if loss != "rnnt":
        gen = torch.Generator().manual_seed(548)
        weight = torch.cat([weight.detach(), 0.5 * torch.randn(3, J, generator=gen).to(device)]).requires_grad_()
        bias = torch.cat([bias.detach(), torch.randn(3, generator=gen).to(device)]).requires_grad_()
        if loss == "tdt":
            options, loss_fn = dict(durations=[0, 1, 2], sigma=0.05), tdt_loss
        else:
            options, loss_fn = dict(blank=-1, big_blank_durations=[2, 3], sigma=0.05), multiblank_loss
    params = (enc, pred, weight, bias)

    def unfused_(e, p, W, b):
        return loss_fn(F.linear(torch.tanh(pack(e, p, T, U)), W, b), targets, T, U, **options)

    def run(fn, autocast, inputs=params):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = fn(*inputs)
        return loss.detach(), torch.autograd.grad(loss, inputs)

    fused = lambda e, p, W, b: fused_joiner_loss(e, p, W, b, targets, T, U, max_rows=50, **options)  # noqa: E731
    exact = [x.detach().double().requires_grad_() for x in params]
    ref_loss, ref_grads = run(unfused_, False, exact)
    un_loss, un_grads = run(unfused_, True)
    fu_loss, fu_grads = run(fused, True)
    assert fu_loss.dtype == un_loss.dtype == torch.float32
    assert abs(fu_loss - ref_loss) <= 2 * abs(un_loss - ref_loss) + 1e-3 * abs(ref_loss)
    for fu, un, ref, x in zip(fu_grads, un_grads, ref_grads, params):
        assert fu.dtype == un.dtype == x.dtype
        bound = 2 * (un.double() - ref).abs().max() + 1e-3 * ref.abs().max()
        assert (fu.double() - ref).abs().max() <= bound


@pytest.mark.parametrize("device", DEVICES)
def test_module(device):
    torch.manual_seed(0)
    m = FusedJoinerLoss(12, 17, blank=0, max_rows=8).to(device).double()
    enc, pred, _, _, targets, T, U, _ = joiner_batch(550, device=device)
    loss = m(enc, pred, targets, T, U)
    want = unfused(enc, pred, m.output.weight, m.output.bias, targets, T, U)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    logits = m.logits(enc[:, :, None], pred[:, None])
    assert logits.shape == (5, 8, 5, 17)
    torch.testing.assert_close(logits[0, 3, 2], m.output(torch.tanh(enc[0, 3] + pred[0, 2])))
    assert "max_rows=8" in repr(m)
    loss.backward()
    assert m.output.weight.grad is not None and enc.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    enc, pred, weight, bias, targets, T, U, _ = joiner_batch(560, device=device, dtype=torch.float32)

    def f(enc, pred, weight, bias):
        return fused_joiner_loss(enc, pred, weight, bias, targets, T, U, max_rows=16)

    explained = torch._dynamo.explain(f)(enc, pred, weight, bias)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    want = f(enc, pred, weight, bias)
    want_grads = torch.autograd.grad(want, (enc, pred, weight, bias))
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(enc, pred, weight, bias)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (enc, pred, weight, bias)), want_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_eager_backward_reads_nothing_back(device, monkeypatch):
    """The eager backward sizes its tiles with forward's host copy of row_splits: no device-to-host read (on CUDA
    nothing synchronises; on the CPU no tolist), and the gradients of a backward that reads them (the traced
    path's) are the same."""
    enc, pred, weight, bias, targets, T, U, _ = joiner_batch(565, device=device)
    loss = fused_joiner_loss(enc, pred, weight, bias, targets, T, U, max_rows=7, reduction="sum")
    want = torch.autograd.grad(
        fused_joiner_loss(enc, pred, weight, bias, targets, T, U, max_rows=7, reduction="sum"),
        (enc, pred, weight, bias),
    )
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    else:

        def refuse(self):
            raise AssertionError("tolist in the eager backward")

        monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    try:
        got = torch.autograd.grad(loss, (enc, pred, weight, bias))
    finally:
        torch.cuda.set_sync_debug_mode("default") if device == "cuda" else monkeypatch.undo()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the registered op's backward, as torch.compile calls it, reads row_splits itself
    seed = torch.zeros((), dtype=torch.int64)
    out = torch.ops.transducer.fused_joiner_loss.default(
        enc,
        pred,
        weight,
        bias,
        targets,
        T,
        U,
        *LossOptions(clamp=-1.0).flat(),
        "tanh",
        0.0,
        seed,
        True,
        torch.float64,
        7,
        False,
    )
    traced = torch.autograd.grad(out[0].sum(), (enc, pred, weight, bias))
    for a, b in zip(traced, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_eager_backward_takes_forwards_tile_path(device, monkeypatch):
    """The eager backward reuses forward's tile path (its projections) rather than making one again, and lets it go
    once used, while the loss lives on: a second backward of the graph (retain_graph) makes its own, with the same
    gradients."""
    enc, pred, weight, bias, targets, T, U, _ = joiner_batch(566, device=device)
    projections = []  # each path's projection, weakly: alive while something keeps the path

    def counted(*args):
        path = real(*args)
        projections.append(weakref.ref(path.Wx))
        return path

    real = fused_op_module.tile_path
    monkeypatch.setattr(fused_op_module, "tile_path", counted)
    loss = fused_joiner_loss(enc, pred, weight, bias, targets, T, U, max_rows=7, reduction="sum")
    assert len(projections) == 1 and projections[0]() is not None
    first = torch.autograd.grad(loss, (enc, pred, weight, bias), retain_graph=True)
    assert len(projections) == 1 and projections[0]() is None
    second = torch.autograd.grad(loss, (enc, pred, weight, bias))
    assert len(projections) == 2
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_eager_forward_keeps_its_inputs_as_saved_tensors_only(device):
    """What the eager forward keeps for backward holds its inputs only as saved tensors (not through the tile path
    kept for backward), so that saved-tensor hooks (save_on_cpu, checkpointing) decide where they live; the
    gradients from the hooks' copies are the same."""
    enc0, pred, weight, bias, targets, T, U, _ = joiner_batch(567, device=device)
    want = torch.autograd.grad(
        fused_joiner_loss(enc0, pred, weight, bias, targets, T, U, max_rows=7, reduction="sum"), (enc0, weight)
    )
    enc = enc0 * 1  # a tensor that only the op's saved tensors would keep
    alive = weakref.ref(enc)
    with torch.autograd.graph.saved_tensors_hooks(lambda x: x.clone(), lambda x: x):
        loss = fused_joiner_loss(enc, pred, weight, bias, targets, T, U, max_rows=7, reduction="sum")
    del enc
    assert alive() is None
    for a, b in zip(torch.autograd.grad(loss, (enc0, weight)), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("static_shapes", [True, False])
def test_opcheck(device, static_shapes):
    # static_shapes: per-row outputs sized by the shapes' bound (as torch.compile calls the op), else by the
    # lengths' row count (eager calls; the fake gives a data-dependent size)
    enc, pred, weight, bias, targets, T, U, _ = joiner_batch(570, device=device)
    seed = torch.zeros((), dtype=torch.int64)

    def op_args(options, targets=targets):
        return (
            enc,
            pred,
            weight,
            bias,
            targets,
            T,
            U,
            *options.flat(),
            "tanh",
            0.0,
            seed,
            True,
            torch.float64,
            7,
            static_shapes,
        )

    args = op_args(LossOptions(clamp=-1.0))
    out = torch.ops.transducer.fused_joiner_loss.default(*args)
    rows = int((T * (U + 1)).sum())
    assert out[2].shape == (enc.size(0) * enc.size(1) * pred.size(1) if static_shapes else rows, 2)
    torch.library.opcheck(torch.ops.transducer.fused_joiner_loss.default, args)
    # TDT: the last 3 rows of weight score durations 0, 1, 3; omega > 0 adds the RNN-T outputs
    tdt_targets = (targets % 14).clamp(min=1)
    torch.library.opcheck(
        torch.ops.transducer.fused_joiner_loss.default,
        op_args(LossOptions(durations=(0, 1, 3), sigma=0.1, omega=0.25), tdt_targets),
    )
    # multi-blank: blank 16, big blanks of durations 2 and 3 in columns 15 and 14
    torch.library.opcheck(
        torch.ops.transducer.fused_joiner_loss.default,
        op_args(LossOptions(blank=16, sigma=0.05, big_blank_durations=(2, 3)), tdt_targets),
    )
    # dropout: the seed travels as a CPU tensor
    dropped = args[:10] + (0.2, torch.tensor(12345)) + args[12:]
    torch.library.opcheck(torch.ops.transducer.fused_joiner_loss.default, dropped)


def _bad(**change):
    enc, pred, weight, bias, targets, T, U, _ = joiner_batch(580)
    args = dict(
        encoder_out=enc,
        predictor_out=pred,
        weight=weight,
        bias=bias,
        targets=targets,
        logit_lengths=T,
        target_lengths=U,
    )
    options = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    return fused_joiner_loss(*args.values(), **options)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(encoder_out=torch.zeros(5, 8)), ValueError, "encoder_out: expected 3 dimensions"),
        (dict(predictor_out=torch.zeros(5, 5, 12, dtype=torch.int32)), TypeError, "predictor_out: expected dtype"),
        (dict(predictor_out=torch.zeros(5, 5, 11, dtype=torch.float64)), ValueError, "predictor_out: expected shape"),
        (dict(weight=torch.zeros(17, 11, dtype=torch.float64)), ValueError, r"weight: expected shape \(V, 12\)"),
        (dict(bias=torch.zeros(16, dtype=torch.float64)), ValueError, r"bias: expected shape \(17,\)"),
        (dict(targets=torch.zeros(4, 4, dtype=torch.long)), ValueError, "targets: expected 5 entries"),
        (dict(logit_lengths=torch.tensor([8, 1, 3, 20, 2])), ValueError, r"logit_lengths: expected values in \[1, 8\]"),
        (dict(target_lengths=torch.tensor([4, 0, 0, 5, 1])), ValueError, "target_lengths: expected values in"),
        (dict(targets=torch.full((5, 4), 17)), ValueError, "targets: .* entries within target_lengths are outside"),
        (dict(activation="no such activation"), ValueError, "activation: expected one of"),
        (dict(dropout=1.0), ValueError, r"dropout: expected a number in \[0, 1 - 2\^-10\]"),
        (dict(dropout=1 - 2**-11), ValueError, r"dropout: expected a number in \[0, 1 - 2\^-10\]"),
        (dict(dropout="0.1"), TypeError, r"dropout: expected a number in \[0, 1 - 2\^-10\], got str"),
        (dict(dropout=0.1, generator=1), TypeError, "generator: expected a CPU torch.Generator"),
        (dict(blank=17), ValueError, r"blank: expected an int in \[-17, 17\)"),
        (dict(blank=-18), ValueError, r"blank: expected an int in \[-17, 17\)"),
        (dict(max_rows=0), ValueError, "max_rows: expected an int >= 1"),
        (dict(reduction="avg"), ValueError, "reduction: expected one of"),
        (dict(clamp="x"), TypeError, "clamp: expected a number"),
        (dict(durations=[1, 1]), ValueError, "durations: expected distinct ints >= 0"),
        (
            dict(durations=[0, 1], one_sym_per_frame=True),
            ValueError,
            "one_sym_per_frame: the TDT loss does not take this",
        ),
        (
            dict(durations=[0, 1], big_blank_durations=[2]),
            ValueError,
            "big_blank_durations: the TDT loss does not take this option",
        ),
        (dict(durations=[0, 1], omega=1.0), ValueError, r"omega: expected a number in \[0, 1\)"),
        (dict(sigma=0.1), ValueError, "sigma: the RNN-T loss does not take this option"),
        (dict(durations=[0, 1], sigma=math.inf), ValueError, "sigma: expected a finite number"),
        (dict(durations=list(range(16))), ValueError, r"weight: expected at least 2 token rows before the 16 duration"),
        (
            dict(encoder_out=torch.zeros(0, 8, 12, dtype=torch.float64)),
            ValueError,
            "encoder_out: expected at least one",
        ),
        (
            dict(
                encoder_out=torch.zeros(5, 8, 0, dtype=torch.float64),
                predictor_out=torch.zeros(5, 5, 0, dtype=torch.float64),
                weight=torch.zeros(17, 0, dtype=torch.float64),
            ),
            ValueError,
            r"encoder_out: expected rows of at least one entry \(B, maxT, J >= 1\), got shape \(5, 8, 0\)",
        ),
        (dict(delay_penalty=math.inf), ValueError, "delay_penalty: expected a finite number"),
        (dict(durations=[0, 1], blank=15), ValueError, r"blank: expected an int in \[-15, 15\) \(the token rows"),
    ],
)
def test_bad_input(change, error, match):
    with pytest.raises(error, match=match):
        _bad(**change)


# TDT: the fused joiner loss with durations against tdt_loss(F.linear(act(pack(...)))), V = 17 - D token rows.
TDT_CASES = [  # durations, activation, reduction, max_rows, options
    ([0, 1, 2], "tanh", "none", None, {}),
    ([0, 1, 2, 4], "relu", "mean", 5, dict(blank=3, sigma=0.05)),
    ([1, 2], "tanh", "none", 1, {}),  # no duration 0: U_b > T_b utterances have no alignment
    ([0, 2, 3], "identity", "sum", 7, dict(omega=0.3, fastemit_lambda=0.2, clamp=0.05, zero_infinity=True)),
    ([0, 1, 2, 3], "tanh", "none", 11, dict(omega=0.5, sigma=0.1)),
]


def tdt_both(
    seed, device, durations, dtype=torch.float64, reduction="none", activation="tanh", max_rows=None, **options
):
    enc, pred, weight, b, targets, T, U, w = joiner_batch(
        seed, dtype=dtype, device=device, blank=options.get("blank", 0), V=17
    )
    V = 17 - len(durations)
    targets = targets % V
    targets[targets == options.get("blank", 0)] = (options.get("blank", 0) + 1) % V
    params = (enc, pred, weight, b)
    out = []
    for fn in (
        lambda: fused_joiner_loss(
            enc,
            pred,
            weight,
            b,
            targets,
            T,
            U,
            activation=activation,
            reduction=reduction,
            max_rows=max_rows,
            durations=durations,
            **options,
        ),
        lambda: tdt_loss(
            F.linear(_act(pack(enc, pred, T, U), activation), weight, b),
            targets,
            T,
            U,
            durations,
            reduction=reduction,
            **options,
        ),
    ):
        loss = fn()
        objective = (loss * w.to(loss.dtype)).sum() if reduction == "none" else loss * 1.7
        out.append((loss.detach(), torch.autograd.grad(objective, params, allow_unused=True)))
    return out


def _act(h, activation):
    return torch.tanh(h) if activation == "tanh" else torch.relu(h) if activation == "relu" else h


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(TDT_CASES)))
def test_tdt_float64_equals_unfused(device, case):
    durations, activation, reduction, max_rows, options = TDT_CASES[case]
    (fused, fused_grads), (want, want_grads) = tdt_both(
        600 + case, device, durations, reduction=reduction, activation=activation, max_rows=max_rows, **options
    )
    if durations == [1, 2]:
        assert torch.isinf(want).any() and torch.isfinite(want).any()  # both kinds of utterance are tested
    torch.testing.assert_close(fused, want, rtol=1e-10, atol=1e-12)
    for got, exp in zip(fused_grads, want_grads):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_tdt_float32_and_gradcheck(device):
    (fused, fused_grads), (want, want_grads) = tdt_both(
        620, device, [0, 1, 2], dtype=torch.float32, max_rows=9, omega=0.2
    )
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)
    for got, exp in zip(fused_grads, want_grads):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)
    enc, pred, weight, bias, targets, T, U, _ = joiner_batch(630, B=3, max_t=4, max_u=2, J=3, V=7, device=device)
    targets = targets.clamp(max=3)
    assert torch.autograd.gradcheck(
        lambda e, p, w, b: fused_joiner_loss(
            e, p, w, b, targets, T, U, max_rows=4, reduction="none", durations=[0, 1, 2], sigma=0.05, omega=0.3
        ),
        (enc, pred, weight, bias),
        eps=1e-6,
        atol=1e-7,
        rtol=1e-5,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_tdt_module(device):
    torch.manual_seed(1)
    m = FusedJoinerLoss(12, 14, durations=[0, 1, 2], sigma=0.05, max_rows=8).to(device).double()
    assert m.output.weight.shape == (17, 12)
    enc, pred, _, _, targets, T, U, _ = joiner_batch(640, device=device)
    targets = targets % 14
    targets[targets == 0] = 1
    loss = m(enc, pred, targets, T, U)
    want = tdt_loss(
        F.linear(torch.tanh(pack(enc, pred, T, U)), m.output.weight, m.output.bias),
        targets,
        T,
        U,
        [0, 1, 2],
        sigma=0.05,
    )
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    assert "durations=[0, 1, 2]" in repr(m)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(sigma=0.5), ValueError, "sigma: the RNN-T loss does not take this option"),
        (dict(durations=[0, 1], omega=5), ValueError, r"omega: expected a number in \[0, 1\)"),
        (dict(durations=[0, 1], sigma="x"), TypeError, "sigma: expected a number"),
        (
            dict(durations=[0, 1], one_sym_per_frame=True),
            ValueError,
            "one_sym_per_frame: the TDT loss does not take this option",
        ),
        (dict(max_rows=0), ValueError, "max_rows: expected an int >= 1"),
        (dict(activation="no such activation"), ValueError, "activation: expected one of"),
        (dict(reduction="avg"), ValueError, "reduction: expected one of"),
        (dict(blank=6), ValueError, r"blank: expected an int in \[-6, 6\)"),
        (dict(fastemit_lambda=-1.0), ValueError, r"fastemit_lambda: expected a number in \[0, 65503\]"),
    ],
)
def test_module_bad_options(kwargs, error, match):
    """FusedJoinerLoss checks its options when built, with the messages of fused_joiner_loss."""
    with pytest.raises(error, match=match):
        FusedJoinerLoss(8, 6, **kwargs)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((8, 1), ValueError, "vocab_size: expected an int >= 2, got 1"),
        ((8, 6.0), TypeError, "vocab_size: expected an int, got float 6.0"),
        ((0, 6), ValueError, "joiner_dim: expected an int >= 1, got 0"),
        ((True, 6), TypeError, "joiner_dim: expected an int, got bool True"),
    ],
)
def test_module_bad_sizes(args, error, match):
    """FusedJoinerLoss names a joiner width or vocabulary it cannot take when built, not at its first call."""
    with pytest.raises(error, match=match):
        FusedJoinerLoss(*args)


def test_module_numpy_sizes():
    m = FusedJoinerLoss(np.int64(8), np.int64(6), blank=np.int64(-1))
    assert m.options["blank"] == 5 and type(m.options["blank"]) is int
    assert m.output.weight.shape == (6, 8)
