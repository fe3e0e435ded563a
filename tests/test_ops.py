"""ops on the CPU and on CUDA (each CUDA function against its CPU twin): FastDivmod (the device formula), gather,
reduce, the dtype helpers, ops.numeric and the bf16 rounding of ops/numeric.cuh, the kernel launcher (its
argument buffer, shared memory, CuPy), HostReader, streams and CUDA graph capture."""

import math

import numpy as np
import pytest
import torch

import ops
import ragged
from ops import FastDivmod

N_MAX = (1 << 31) - 1
DEV = "cuda"
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
GATHER_DTYPES = FLOATS + [torch.int32, torch.int64]


# -------------------------------------------------------------------- FastDivmod


def _edge_numerators(d):
    k = np.array([0, 1, 2, 3, 7, 1000], dtype=np.int64)
    cands = [0, 1, 2, d - 1, d, d + 1, N_MAX, N_MAX - 1, N_MAX - d, (N_MAX // d) * d, (N_MAX // d) * d - 1]
    mult = k * d
    cands = np.concatenate([np.array(cands, dtype=np.int64), mult - 1, mult, mult + 1])
    return cands[(cands >= 0) & (cands <= N_MAX)]


def _edge_divisors():
    ds = set(range(1, 4097))
    for p in range(0, 32):
        for delta in (-1, 0, 1):
            v = (1 << p) + delta
            if 1 <= v <= (1 << 31):
                ds.add(v)
    ds.update([N_MAX, N_MAX - 1, 3**19, 10**9 + 7, 641 * 6700417 % (1 << 31), 65535 * 3])
    return sorted(ds)


def test_constants_match_definition():
    for d in _edge_divisors():
        f = FastDivmod(d)
        l = math.ceil(math.log2(d)) if d > 1 else 0
        assert f.l == l
        assert f.m == (1 << 32) * ((1 << l) - d) // d + 1
        assert 1 <= f.m < (1 << 32)
        assert tuple(f.params()) == (d, f.m, f.l) and ops.params.FAST_DIVMOD.c_size == 12


def test_every_divisor_edge_numerators_vectorised():
    """Every divisor 1..4096 plus powers of two and neighbours, 2^31 - 1, 2^31:
    per-divisor edge numerators, done as one vectorised FastDivmod."""
    ds = _edge_divisors()
    rows_d, rows_n = [], []
    for d in ds:
        n = _edge_numerators(d)
        rows_d.append(np.full(n.shape, d, dtype=np.int64))
        rows_n.append(n)
    d = np.concatenate(rows_d)
    n = np.concatenate(rows_n)
    f = FastDivmod(d)
    q, r = f.divmod(n)
    np.testing.assert_array_equal(q, n // d)
    np.testing.assert_array_equal(r, n % d)


def test_random_numerators_per_divisor_torch():
    g = torch.Generator().manual_seed(0)
    ds = torch.tensor(_edge_divisors(), dtype=torch.int64)
    f = FastDivmod(ds)
    for _ in range(4):
        n = torch.randint(0, 1 << 31, (len(ds),), generator=g, dtype=torch.int64)
        q, r = f.divmod(n)
        assert torch.equal(q, n // ds) and torch.equal(r, n % ds)
    # small numerators too (the common case for shape splitting)
    n = torch.randint(0, 1 << 16, (len(ds),), generator=g, dtype=torch.int64)
    q, r = f.divmod(n)
    assert torch.equal(q, n // ds) and torch.equal(r, n % ds)


def test_random_divisors_and_numerators():
    rng = np.random.default_rng(1)
    d = np.concatenate([rng.integers(1, 1 << 31, 20000), rng.integers(1, 1 << 16, 20000)])
    n = rng.integers(0, 1 << 31, d.shape)
    q, r = FastDivmod(d).divmod(n)
    np.testing.assert_array_equal(q, n // d)
    np.testing.assert_array_equal(r, n % d)


def test_scalar_divisor_methods_and_int_numerators():
    f = FastDivmod(7)
    assert int(f.div(100)) == 14 and int(f.mod(100)) == 2
    n = np.arange(0, 1000)
    np.testing.assert_array_equal(f.div(n), n // 7)
    np.testing.assert_array_equal(f.mod(n), n % 7)
    t = torch.arange(0, 1000, dtype=torch.int32)
    q, r = f.divmod(t)
    assert torch.equal(q, t.long() // 7) and torch.equal(r, t.long() % 7)
    big = FastDivmod(1 << 31)
    assert (int(big.div(N_MAX)), int(big.mod(N_MAX))) == (0, N_MAX)
    assert (big.m, big.l) == (1, 31)
    one = FastDivmod(1)
    assert int(one.div(N_MAX)) == N_MAX and int(one.mod(N_MAX)) == 0


def test_broadcast_per_row_divisors():
    d = np.array([1, 5, 9, 1 << 20])
    n = np.arange(40).reshape(10, 4) * 12345
    q, r = FastDivmod(d).divmod(n)
    np.testing.assert_array_equal(q, n // d)
    np.testing.assert_array_equal(r, n % d)
    assert FastDivmod(torch.tensor(d)).as_tensor()[:, 0].tolist() == list(d)


@pytest.mark.parametrize("bad", [0, -1, (1 << 31) + 1, 1 << 32])
def test_bad_divisor(bad):
    with pytest.raises(ValueError, match="d"):
        FastDivmod(bad)
    with pytest.raises(ValueError, match="d"):
        FastDivmod(np.array([3, bad]))


def test_bad_divisor_types():
    with pytest.raises(TypeError, match="d"):
        FastDivmod(2.5)
    with pytest.raises(TypeError, match="d"):
        FastDivmod(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="d"):
        FastDivmod(np.ones((2, 2), dtype=np.int64))


def test_numerator_range_checked():
    f = FastDivmod(3)
    with pytest.raises(ValueError, match="n"):
        f.div(np.array([1 << 31]))
    with pytest.raises(ValueError, match="n"):
        f.div(torch.tensor([-1]))
    # an int past int64: named, not numpy's OverflowError; unsigned numerators of any width in range divide
    with pytest.raises(ValueError, match=r"n must satisfy 0 <= n < 2\^31, got 9223372036854775808"):
        f.divmod(2**63)
    for unsigned in (torch.tensor([7, 100]).to(torch.uint32), np.array([7, 100], dtype=np.uint64)):
        assert [int(q) for q in f.div(unsigned)] == [2, 33]


# -------------------------------------------------------------------- gather


def _batch_gather_ref(params, indices, axis, bd):
    """tf.gather with batch_dims by explicit loops over the batch positions."""
    if bd == 0:
        return np.take(params, indices, axis=axis)
    bshape = params.shape[:bd]
    out = None
    for pos in np.ndindex(*bshape):
        part = np.take(params[pos], indices[pos], axis=axis - bd)
        if out is None:
            out = np.empty(bshape + part.shape, dtype=params.dtype)
        out[pos] = part
    return out


def _random_case(rng, ndim, ind_extra, bd, axis):
    pshape = tuple(int(x) for x in rng.integers(1, 5, ndim))
    ishape = pshape[:bd] + tuple(int(x) for x in rng.integers(0 if ind_extra > 1 else 1, 4, ind_extra))
    G = pshape[axis]
    indices = rng.integers(-G, G, ishape)
    params = rng.standard_normal(pshape).astype(np.float32)
    return params, indices


@pytest.mark.parametrize("seed", range(6))
def test_gather_numpy_matches_take_and_batch_ref(seed):
    rng = np.random.default_rng(seed)
    for ndim in range(1, 5):
        for bd in range(0, ndim):
            for axis in range(bd, ndim):
                for ind_extra in (0, 1, 2):
                    params, indices = _random_case(rng, ndim, ind_extra, bd, axis)
                    ref = _batch_gather_ref(params, indices, axis, bd)
                    got = ops.gather(params, indices, axis=axis, batch_dims=bd)
                    assert isinstance(got, np.ndarray)
                    assert got.shape == ref.shape
                    np.testing.assert_array_equal(got, ref)
                    tp = torch.from_numpy(params)
                    ti = torch.from_numpy(indices)
                    gt = ops.gather(tp, ti, axis=axis - ndim, batch_dims=bd)
                    assert isinstance(gt, torch.Tensor) and tuple(gt.shape) == ref.shape
                    np.testing.assert_array_equal(gt.numpy(), ref)


def test_gather_dtypes_and_index_types():
    rng = np.random.default_rng(3)
    idx = rng.integers(-6, 6, (3, 2))
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64):
        p = (torch.randn(4, 6, 5) * 100).to(dt)
        for it in (torch.int32, torch.int64):
            got = ops.gather(p, torch.from_numpy(idx).to(it), axis=1)
            ref = torch.from_numpy(np.take(p.float().numpy(), idx, axis=1)).to(dt)
            assert got.dtype == dt and torch.equal(got, ref)


def test_gather_rowwise_fast_path_and_default_axis():
    """The transducer's use: per-row pick, (rows, V) x (rows, 1) -> (rows, 1)."""
    x = torch.randn(50, 37)
    idx = torch.randint(0, 37, (50,))
    got = ops.gather(x, idx[:, None], axis=1, batch_dims=1)
    assert torch.equal(got, torch.gather(x, 1, idx[:, None]))
    got2 = ops.gather(x, idx[:, None] - 37, batch_dims=1)  # axis defaults to batch_dims, negatives wrap
    assert torch.equal(got2, got)
    xn, idn = x.numpy(), idx.numpy()
    np.testing.assert_array_equal(
        ops.gather(xn, idn[:, None], axis=1, batch_dims=1), np.take_along_axis(xn, idn[:, None], 1)
    )


def test_gather_noncontiguous_and_empty():
    p = torch.randn(6, 5).t()  # non-contiguous
    idx = torch.tensor([[0, 5], [-1, 2]])
    assert torch.equal(ops.gather(p, idx, axis=1), torch.from_numpy(np.take(p.numpy(), idx.numpy(), axis=1)))
    e = ops.gather(p, torch.zeros((0,), dtype=torch.int64), axis=0)
    assert tuple(e.shape) == (0, 6)
    e = ops.gather(np.zeros((3, 0)), np.array([1, 2]), axis=0)
    assert e.shape == (2, 0)


def test_gather_out_of_range():
    p = np.arange(12).reshape(3, 4)
    with pytest.raises(IndexError, match="indices"):
        ops.gather(p, np.array([0, 4]), axis=1)
    with pytest.raises(IndexError, match="indices"):
        ops.gather(torch.from_numpy(p), torch.tensor([-4]), axis=0)
    # unchecked: out-of-range gives zeros
    got = ops.gather(torch.from_numpy(p), torch.tensor([[0, 9], [1, -1]]), axis=1, check_bounds=False)
    assert got.tolist() == [[[0, 0], [1, 3]], [[4, 0], [5, 7]], [[8, 0], [9, 11]]]


def test_gather_bad_args():
    p = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="batch_dims"):
        ops.gather(p, np.zeros((3, 1), dtype=np.int64), axis=1, batch_dims=1)
    with pytest.raises(ValueError, match="axis"):
        ops.gather(p, np.zeros((2,), dtype=np.int64), axis=3)
    with pytest.raises(ValueError, match="batch_dims"):
        ops.gather(p, np.zeros((2, 3, 1), dtype=np.int64), axis=1, batch_dims=2)
    with pytest.raises(TypeError, match="indices"):
        ops.gather(p, np.zeros((2,)), axis=0)
    # numpy's uint64 past 2^63 would wrap into a real row even with check_bounds=False; torch's wide unsigned
    # dtypes have no min or max on the CPU
    for bad in (np.array([1, 2**64 - 1], dtype=np.uint64), torch.tensor([0, 1]).to(torch.uint32)):
        with pytest.raises(TypeError, match="indices must hold integers that index as int64"):
            ops.gather(p if isinstance(bad, np.ndarray) else torch.zeros(2, 3, 4), bad, axis=0, check_bounds=False)
    with pytest.raises(TypeError, match="shard_offset must be an int, got float 1.7"):
        ops.sharded_gather(np.zeros((3, 4)), np.array([0, 1]), 0, 1.7)
    with pytest.raises(TypeError, match="full_size must be an int, got float"):
        ops.gather(np.zeros((3, 4)), np.array([0, 1]), 0, shard_offset=1, full_size=5.0)
    assert ops.gather(np.zeros((3, 4)), [], 0).shape == (0, 4)  # as np.take: an empty list is no indices
    assert ops.gather(torch.zeros(3, 4), [], 0).shape == (0, 4)
    for fine in (np.array([1, 0], dtype=np.uint32), torch.tensor([1, 0], dtype=torch.uint8)):
        got = ops.gather(np.arange(24.0).reshape(2, 3, 4), fine, axis=0)
        np.testing.assert_array_equal(np.asarray(got), np.arange(24.0).reshape(2, 3, 4)[[1, 0]])


@pytest.mark.parametrize("seed", range(4))
def test_sharded_gather_sums_to_full(seed):
    rng = np.random.default_rng(seed)
    for ndim in (1, 2, 3):
        for bd in range(0, ndim):
            for axis in range(bd, ndim):
                params, _ = _random_case(rng, ndim, 1, bd, axis)
                G = params.shape[axis]
                ishape = params.shape[:bd] + (int(rng.integers(1, 5)),)
                indices = rng.integers(-G, G, ishape)
                full = ops.gather(params, indices, axis=axis, batch_dims=bd)
                cuts = np.sort(rng.integers(0, G + 1, 2))
                bounds = [0, int(cuts[0]), int(cuts[1]), G]
                total = np.zeros_like(full)
                total_t = torch.zeros(full.shape)
                for lo, hi in zip(bounds[:-1], bounds[1:]):
                    shard = np.take(params, np.arange(lo, hi), axis=axis)
                    total += ops.gather(shard, indices, axis=axis, batch_dims=bd, shard_offset=lo, full_size=G)
                    total_t += ops.sharded_gather(
                        torch.from_numpy(shard), torch.from_numpy(indices % G), axis, lo, batch_dims=bd
                    )
                np.testing.assert_array_equal(total, full)
                np.testing.assert_array_equal(total_t.numpy(), full)


def test_sharded_gather_errors():
    p = np.ones((3, 2))
    with pytest.raises(IndexError, match="indices"):
        ops.sharded_gather(p, np.array([-1]), 0, 2)
    with pytest.raises(IndexError, match="indices"):
        ops.sharded_gather(p, np.array([7]), 0, 2, full_size=6)
    with pytest.raises(ValueError, match="full_size"):
        ops.sharded_gather(p, np.array([1]), 0, 4, full_size=6)
    with pytest.raises(ValueError, match="shard_offset"):
        ops.sharded_gather(p, np.array([1]), 0, -1)


def _rand(shape, dtype, gen):
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 10).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GATHER_DTYPES)
def test_gather_matches_cpu_random(dtype):
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    for _ in range(30):
        ndim = int(rng.integers(1, 5))
        bd = int(rng.integers(0, ndim))
        axis = int(rng.integers(bd, ndim))
        pshape = tuple(int(x) for x in rng.integers(1, 7, ndim))
        ishape = pshape[:bd] + tuple(int(x) for x in rng.integers(1, 5, int(rng.integers(0, 3))))
        G = pshape[axis]
        p = _rand(pshape, dtype, gen)
        idx = torch.from_numpy(rng.integers(-G, G, ishape))
        for it in (torch.int32, torch.int64):
            ref = ops.gather(p, idx.to(it), axis=axis, batch_dims=bd)
            got = ops.gather(p.to(DEV), idx.to(it).to(DEV), axis=axis, batch_dims=bd)
            assert got.device.type == "cuda" and got.dtype == dtype
            assert torch.equal(got.cpu(), ref)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GATHER_DTYPES)
@pytest.mark.parametrize("K", [1, 2, 3, 4, 8, 16, 17, 32, 64, 1000, 1024])
def test_gather_vector_paths_and_odd_sizes(dtype, K):
    """K * itemsize % 16 == 0 takes 16-byte words, others 8/4/2/1."""
    gen = torch.Generator().manual_seed(K)
    p = _rand((3, 13, K), dtype, gen)
    idx = torch.randint(-13, 13, (5, 2), generator=gen)
    ref = ops.gather(p, idx, axis=1)
    got = ops.gather(p.to(DEV), idx.to(DEV), axis=1)
    assert torch.equal(got.cpu(), ref)
    # misaligned params (a view one element into its storage): narrower words
    flat = _rand((3 * 13 * K + 1,), dtype, gen).to(DEV)
    pv = flat[1:].view(3, 13, K)
    assert pv.is_contiguous() and pv.data_ptr() % 16 != 0
    ref = ops.gather(pv.cpu(), idx, axis=1)
    got = ops.gather(pv, idx.to(DEV), axis=1)
    assert torch.equal(got.cpu(), ref)
    # misaligned output
    oflat = (
        torch.full((5 * 2 * 3 * K + 1,), -1, dtype=dtype, device=DEV)
        if not dtype.is_floating_point
        else torch.full((5 * 2 * 3 * K + 1,), math.nan, dtype=dtype, device=DEV)
    )
    out = oflat[1:].view(3, 5, 2, K)
    ops.gather(pv, idx.to(DEV), axis=1, out=out)
    assert torch.equal(out.cpu(), ref)


@pytest.mark.cuda
def test_gather_rowwise_and_out_poisoned():
    x = torch.randn(1000, 513, device=DEV)
    idx = torch.randint(0, 513, (1000, 1), device=DEV)
    out = torch.full((1000, 1), math.nan, device=DEV)
    r = ops.gather(x, idx, axis=1, batch_dims=1, out=out)
    assert r is out and torch.equal(out, torch.gather(x, 1, idx))
    p = torch.arange(24, dtype=torch.int64, device=DEV).reshape(4, 6)
    out = torch.full((4, 3), -1, dtype=torch.int64, device=DEV)
    ops.gather(p, torch.tensor([5, -6, 2], device=DEV), axis=1, out=out)
    assert torch.equal(out.cpu(), p.cpu()[:, [5, 0, 2]])


@pytest.mark.cuda
def test_gather_out_of_range_cuda():
    p = torch.zeros(3, 4, device=DEV)
    with pytest.raises(IndexError, match="indices"):
        ops.gather(p, torch.tensor([4], device=DEV), axis=1)
    got = ops.gather(torch.ones(3, 4, device=DEV), torch.tensor([4, 1], device=DEV), axis=1, check_bounds=False)
    assert got.cpu().tolist() == [[0.0, 1.0]] * 3


@pytest.mark.cuda
def test_sharded_gather_cuda_sums_to_full():
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(4, 10, 8, generator=gen)
    idx = torch.randint(-10, 10, (4, 7), generator=gen)
    full = ops.gather(p, idx, axis=1, batch_dims=1)
    total = torch.zeros(full.shape, device=DEV)
    for lo, hi in [(0, 3), (3, 3), (3, 9), (9, 10)]:
        total += ops.sharded_gather(p[:, lo:hi].to(DEV), idx.to(DEV), 1, lo, full_size=10, batch_dims=1)
    assert torch.equal(total.cpu(), full)


@pytest.mark.cuda
def test_gather_empty_cuda():
    p = torch.randn(3, 4, device=DEV)
    assert tuple(ops.gather(p, torch.zeros(0, dtype=torch.int64, device=DEV), axis=1).shape) == (3, 0)


@pytest.mark.cuda
def test_gather_over_2_31_words():
    """More than 2^31 output words (1-byte words: rows of an odd number of bytes) take gather_big_kernel."""
    K = (1 << 29) + 1
    gen = torch.Generator(device=DEV).manual_seed(5)
    p = torch.randint(0, 256, (4, K), dtype=torch.uint8, device=DEV, generator=gen)
    idx = torch.tensor([3, -1, 0, 2, -4], device=DEV)
    got = ops.gather(p, idx, axis=0)
    assert got.shape == (5, K) and got.numel() >= 1 << 31
    assert torch.equal(got, p[[3, 3, 0, 2, 0]])
    del got
    total = torch.zeros(5, K, dtype=torch.uint8, device=DEV)  # shards of 2 and 2 rows sum to the gather
    for lo in (0, 2):
        total += ops.sharded_gather(p[lo : lo + 2], idx, 0, lo, full_size=4)
    assert torch.equal(total, p[[3, 3, 0, 2, 0]])


# -------------------------------------------------------------------- reduce


def _np_reduce(x, axis, op):
    x = x.astype(np.float64)
    if op == "sum":
        return x.sum(axis)
    if op == "max":
        return x.max(axis)
    m = x.max(axis, keepdims=True)
    m = np.where(np.isinf(m), 0.0, m)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(x - m).sum(axis)) + np.squeeze(m, axis)


@pytest.mark.parametrize("op", ["sum", "max", "logsumexp"])
def test_reduce_every_axis_matches_numpy(op):
    rng = np.random.default_rng(0)
    for shape in [(7,), (3, 5), (4, 1, 6), (2, 3, 4, 5), (1, 9), (9, 1)]:
        x = rng.standard_normal(shape).astype(np.float32) * 3
        for axis in range(-len(shape), len(shape)):
            ref = _np_reduce(x, axis, op)
            got = ops.reduce(x, axis, op)
            assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == ref.shape
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
            gt = ops.reduce(torch.from_numpy(x), axis, op)
            assert gt.dtype == torch.float32
            np.testing.assert_allclose(gt.numpy(), ref, rtol=1e-5, atol=1e-5)
        x64 = x.astype(np.float64)
        got = ops.reduce(torch.from_numpy(x64), 0, op)
        assert got.dtype == torch.float64
        np.testing.assert_allclose(got.numpy(), _np_reduce(x64, 0, op), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", ["sum", "max", "logsumexp"])
@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_reduce_half_accumulates_fp32(op, dt):
    x = (torch.rand(8, 3000) * 4).to(dt)
    ref = _np_reduce(x.float().numpy(), 1, op)
    got = ops.reduce(x, -1, op)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-3)
    if op == "sum":  # an fp16 accumulator would be way off at sum ~ 6000
        assert abs(float(got[0]) - float(x[0].double().sum())) < 1e-2
    if dt == torch.float16:
        got_np = ops.reduce(x.numpy(), 0, op)
        assert got_np.dtype == np.float32


def test_reduce_inf_rows():
    x = torch.randn(4, 6)
    x[1] = -math.inf
    x[2, 3] = math.inf
    lse = ops.reduce(x, -1, "logsumexp")
    assert lse[1].item() == -math.inf and lse[2].item() == math.inf
    assert not torch.isnan(lse).any()
    torch.testing.assert_close(lse[[0, 3]], torch.logsumexp(x[[0, 3]], -1))
    col = ops.reduce(x.t().contiguous(), 0, "logsumexp")
    assert col[1].item() == -math.inf
    assert ops.reduce(x, -1, "max")[1].item() == -math.inf


def test_reduce_empty_axis_and_keepdim_out():
    x = torch.zeros(3, 0)
    assert ops.reduce(x, 1, "sum").tolist() == [0.0] * 3
    assert ops.reduce(x, 1, "max").tolist() == [-math.inf] * 3
    assert ops.reduce(x, 1, "logsumexp").tolist() == [-math.inf] * 3
    y = torch.randn(3, 4, 5)
    assert tuple(ops.reduce(y, 1, "sum", keepdim=True).shape) == (3, 1, 5)
    out = torch.full((3, 5), math.nan)
    r = ops.reduce(y, 1, "max", out=out)
    assert r is out and torch.equal(out, y.amax(1))


def test_reduce_errors():
    with pytest.raises(ValueError, match="op"):
        ops.reduce(torch.zeros(3), 0, "mean")
    with pytest.raises(ValueError, match="axis"):
        ops.reduce(torch.zeros(3), 1, "sum")
    with pytest.raises(TypeError, match="x"):
        ops.reduce(torch.zeros(3, dtype=torch.int64), 0, "sum")


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["sum", "max", "logsumexp"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_reduce_all_axes_match_cpu(op, dtype):
    gen = torch.Generator().manual_seed(2)
    shapes = [
        (7,),
        (5, 3),
        (4, 33, 6),
        (2, 3, 4, 5),
        (1, 9),
        (9, 1),
        (3, 1, 70),
        (2, 1500),
        (1, 100000),
        (100000, 3),
        (3, 2, 5000),
        (64, 40, 33),
    ]
    for shape in shapes:
        x = (torch.randn(shape, generator=gen) * 3).to(dtype)
        for axis in range(-len(shape), len(shape)):
            ref = ops.reduce(x, axis, op)
            got = ops.reduce(x.to(DEV), axis, op)
            assert got.dtype == ref.dtype and got.shape == ref.shape
            rtol = 1e-10 if dtype == torch.float64 else 1e-5
            atol = 1e-10 if dtype == torch.float64 else (1e-5 if op != "sum" else 1e-6 * math.sqrt(shape[axis]) * 30)
            torch.testing.assert_close(got.cpu(), ref, rtol=rtol, atol=atol)


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["sum", "max", "logsumexp"])
def test_reduce_long_rows_split(op):
    """Few rows, very long: the split-across-blocks path with a finalize pass."""
    gen = torch.Generator().manual_seed(3)
    for shape, axis in [((2, 3_000_000), 1), ((3_000_000, 2), 0), ((2, 1_000_000, 3), 1)]:
        x = torch.rand(shape, generator=gen)
        ref = ops.reduce(x.double(), axis, op)
        got = ops.reduce(x.to(DEV), axis, op)
        torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_reduce_inf_nan_and_out_poisoned():
    x = torch.randn(6, 300)
    x[1] = -math.inf
    x[2, 7] = math.inf
    x[3, 5] = math.nan
    for xt, axis in [(x, 1), (x.t().contiguous(), 0), (x.reshape(6, 3, 100).transpose(1, 2).contiguous(), 1)]:
        for op in ("max", "logsumexp"):
            ref = ops.reduce(xt, axis, op)
            out = torch.full(ref.shape, math.nan if op == "max" else 12345.0, device=DEV)
            got = ops.reduce(xt.to(DEV), axis, op, out=out)
            assert got is out
            torch.testing.assert_close(out.cpu(), ref, equal_nan=True)
    lse = ops.reduce(x.to(DEV), -1, "logsumexp").cpu()
    assert lse[1].item() == -math.inf and lse[2].item() == math.inf and math.isnan(lse[3].item())
    assert not torch.isnan(lse[[0, 1, 2, 4, 5]]).any()


@pytest.mark.cuda
def test_reduce_empty_axis_cuda():
    x = torch.zeros(3, 0, device=DEV)
    assert ops.reduce(x, 1, "logsumexp").cpu().tolist() == [-math.inf] * 3
    assert ops.reduce(x, 1, "sum").cpu().tolist() == [0.0] * 3


# -------------------------------------------------------------------- headers and dtypes


def test_cuda_include_dir_has_header():
    """Kernels include "ops/fast_divmod.cuh", "ragged/row_ids.cuh", ... from the folder holding the packages."""
    import os

    root = ops.cuda_include_dir()
    for header in ("ops/fast_divmod.cuh", "ops/numeric.cuh", "ops/reduce.cuh", "ragged/row_ids.cuh"):
        assert os.path.isfile(os.path.join(root, header)), header


def test_dtype_helpers():
    for dt in ops.FLOAT_DTYPES:
        assert ops.accumulate_dtype(dt) == (torch.float64 if dt == torch.float64 else torch.float32)
    assert [ops.ctype(dt) for dt in ops.FLOAT_DTYPES + ops.INDEX_DTYPES] == [
        "ops::half_t",
        "ops::bf16_t",
        "float",
        "double",
        "int",
        "long long",
    ]
    with pytest.raises(TypeError, match="dtype"):
        ops.ctype(torch.bool)
    for dt in (torch.int8, torch.uint8, torch.int32, torch.int64, np.int16, np.uint32, np.dtype("int64")):
        assert ops.is_integer_dtype(dt)
    for dt in (torch.bool, torch.float32, torch.complex64, np.float64, np.bool_):
        assert not ops.is_integer_dtype(dt)
    for dt in (torch.int8, torch.uint8, torch.int64, np.int16, np.uint32, np.dtype("int64")):
        assert ops.is_index_dtype(dt)
    for dt in (torch.uint16, torch.uint32, torch.uint64, np.uint64, torch.bool, torch.float32, np.float64):
        assert not ops.is_index_dtype(dt)


# -------------------------------------------------------------------- numeric


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_numeric_exp_on_views_matches_torch(dtype):
    from ops.numeric import exp_

    rows = torch.randn(300, 261, dtype=dtype) * 20  # scores past exp's float32 range at both ends
    view = rows[:, :256]  # a strided column slice, the TDT joint's token columns
    x = view.double().clone()
    want = x.exp()
    got = exp_(view)
    assert got is view and got.data_ptr() == rows.data_ptr()
    # exp2(x * log2 e): log2 e rounded to x's dtype and the product's rounding move the exponent by |x| eps
    # at most, then exp2's own ulp
    eps = torch.finfo(dtype).eps
    normal = torch.isfinite(want.to(dtype)) & (want > torch.finfo(dtype).tiny)
    err = ((got.double() - want).abs() / want)[normal]
    assert (err <= (x[normal].abs() + 2) * eps).all(), err.max()
    assert torch.equal(torch.isinf(got), torch.isinf(want.to(dtype)))
    special = torch.tensor([-math.inf, math.inf, math.nan, 0.0], dtype=dtype)
    assert exp_(special).tolist()[:2] == [0.0, math.inf] and math.isnan(special[2]) and special[3] == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_numeric_logsumexp_matches_torch(dtype):
    from ops.numeric import logsumexp

    x = torch.randn(6, 11, 31, dtype=dtype) * 30
    x[0, :, 3] = -math.inf  # all -inf: -inf
    x[1, 2, 4] = math.nan  # NaN propagates
    x[2, :5, 5] = -math.inf
    x[3, 7, 6] = math.inf  # +inf: +inf
    for dim in (0, 1, 2):
        want = torch.logsumexp(x.double(), dim)
        out = torch.full((6, 11, 31)[:dim] + (6, 11, 31)[dim + 1 :] + (2,), 7.0, dtype=dtype)[..., 0]  # strided
        got = logsumexp(x, dim, out=out)
        assert got is out
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))
        assert torch.equal(got[torch.isinf(want)], want[torch.isinf(want)].to(dtype))
        finite = torch.isfinite(want)
        tol = 2e-6 if dtype == torch.float32 else 1e-13
        torch.testing.assert_close(got.double()[finite], want[finite], rtol=tol, atol=tol)
        fresh = logsumexp(x, dim)
        assert fresh.shape == want.shape and torch.equal(torch.isnan(fresh), torch.isnan(got))


def test_numeric_logsumexp_empty_dim_and_reduce_keeps_autograd():
    from ops.numeric import logsumexp

    assert logsumexp(torch.zeros(3, 0, 2), 1).tolist() == [[-math.inf] * 2] * 3
    out = torch.zeros(3, 2)
    assert logsumexp(torch.zeros(3, 0, 2), -2, out=out) is out and (out == -math.inf).all()
    # ops.reduce on a CPU tensor that requires grad differentiates (torch.logsumexp), values as without
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ops.reduce(t, 1, "logsumexp"), (x,))
    with torch.no_grad():
        torch.testing.assert_close(ops.reduce(x, 1, "logsumexp"), torch.logsumexp(x, 1), rtol=1e-13, atol=1e-13)


def test_numeric_names_a_bad_x():
    from ops.numeric import exp_, logsumexp

    for bad in (torch.zeros(3, dtype=torch.float16), torch.zeros(3, dtype=torch.int64), [1.0, 2.0]):
        for fn in (exp_, lambda x: logsumexp(x, 0)):
            with pytest.raises(TypeError, match="x: expected a float32 or float64 CPU tensor"):
                fn(bad)


def bf16_bits_rn(x):
    """A numpy transcription of ops/numeric.cuh's bf16_bits_rn, the software float -> bf16 rounding used
    before sm_80 (test_bf16_software_rounding_before_sm80 runs the device function itself)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def test_software_bf16_rounding_matches_torch():
    gen = torch.Generator().manual_seed(45)
    x = torch.cat(
        [
            torch.randn(100_000, generator=gen) * 10.0 ** torch.randint(-40, 39, (100_000,), generator=gen),
            torch.tensor(
                [
                    0.0,
                    -0.0,
                    math.inf,
                    -math.inf,
                    3.3895e38,
                    -3.3895e38,
                    1e-45,
                    -1e-45,
                    1.0 + 2**-8,
                    1.0 + 3 * 2**-8,
                    1.0 + 2**-8 + 2**-20,
                ]
            ),
            torch.randint(0, 2**31 - 1, (10_000,), generator=gen, dtype=torch.int32).view(torch.float32),
        ]
    )
    got = bf16_bits_rn(x.numpy())
    want = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = torch.isfinite(x).numpy() | torch.isinf(x).numpy()
    assert np.array_equal(got[finite], want[finite])
    nans = ~finite
    assert nans.any()
    assert np.isnan(torch.from_numpy(got[nans].view(np.int16)).view(torch.bfloat16).float().numpy()).all()


@pytest.mark.cuda
def test_bf16_software_rounding_before_sm80():
    """GPUs before sm_80 have no cvt.rn.bf16.f32: ops/numeric.cuh rounds in integer arithmetic there
    (tests/test_kernels_compile.py checks which PTX each architecture gets). Here the software rounding,
    forced on this GPU, against torch's."""
    import cupy as cp

    code = """#define OPS_SOFTWARE_BF16
#include "ops/numeric.cuh"
extern "C" __global__ void to_bf16(const float* x, unsigned short* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = ops::from_acc<ops::bf16_t>(x[i]).bits;
}"""
    fn = cp.RawModule(code=code, options=("-std=c++17", f"-I{ops.cuda_include_dir()}")).get_function("to_bf16")
    gen = torch.Generator().manual_seed(46)
    x = torch.cat(
        [
            torch.randn(1 << 16, generator=gen) * 10.0 ** torch.randint(-40, 39, (1 << 16,), generator=gen),
            torch.randint(0, 2**31 - 1, (1 << 16,), generator=gen, dtype=torch.int32).view(torch.float32),
            torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 3.3895e38, 1e-45]),
        ]
    ).to(DEV)
    y = torch.empty(x.shape, dtype=torch.int16, device=DEV)
    torch.cuda.synchronize()
    fn(((x.numel() + 255) // 256,), (256,), (x.data_ptr(), y.data_ptr(), np.int32(x.numel())))
    torch.cuda.synchronize()
    got = y.view(torch.bfloat16).float()
    want = x.to(torch.bfloat16).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], want[~nan])


# -------------------------------------------------------------------- launch


def test_cuda_without_cupy_names_the_extra(monkeypatch):
    import sys

    import ops.cuda

    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail, as on a machine without it
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[cuda\]'"):
        ops.cuda.cupy()
    import transducer.cuda.stages  # noqa: F401  importing the CUDA stages never needs CuPy


def test_launch_opts_a_kernel_in_to_more_shared_memory_once_per_size(monkeypatch):
    # ops.cuda.launch raises a kernel's dynamic shared memory cap (cuFuncSetAttribute) before a launch that
    # asks for more than 48 KiB, once per size it grows to (no GPU needed: the driver call is recorded)
    import types

    import ops.cuda as oc

    calls = []
    driver = types.SimpleNamespace(funcSetAttribute=lambda fn, attribute, value: calls.append((fn, attribute, value)))
    monkeypatch.setattr(oc, "cupy", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(driver=driver)))
    monkeypatch.setattr(oc, "shared_mem_allowed", {})
    key, other = ("a.cu", "k<float>", 0), ("a.cu", "k<double>", 0)
    for size in (48 * 1024, 64 * 1024, 60 * 1024, 64 * 1024, 100 * 1024):
        oc.allow_shared_mem(key, 1234, size)
    oc.allow_shared_mem(other, 5678, 50 * 1024)
    assert calls == [(1234, 8, 64 * 1024), (1234, 8, 100 * 1024), (5678, 8, 50 * 1024)]


def test_launch_each_packs_the_arguments_once_for_its_kernels(monkeypatch):
    # ops.cuda.launch_each launches its kernels in order, each with its grid, block and shared memory, on one
    # packing of the shared arguments: every launch reads the first kernel's buffer (no GPU needed: the driver's
    # calls are recorded)
    import types

    import ops.cuda as oc

    launched, packs = [], []
    monkeypatch.setattr(oc, "_per_thread", types.SimpleNamespace())
    monkeypatch.setattr(oc, "current_device", lambda: 0)
    monkeypatch.setattr(oc, "current_raw_stream", lambda dev: 77)
    functions = {f"k{i}": 100 + i for i in range(3)}
    monkeypatch.setattr(oc, "_function", lambda path, name, dev: (None, functions[name], lambda *a: launched.append(a)))
    monkeypatch.setattr(oc, "_functions", {})
    runtime = types.SimpleNamespace(setDevice=lambda dev: None)
    monkeypatch.setattr(oc, "cupy", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))
    pack = oc.KernelArguments.pack
    monkeypatch.setattr(oc.KernelArguments, "pack", lambda self, args: packs.append(args) or pack(self, args))
    t = types.SimpleNamespace(get_device=lambda: 0)
    args = (oc.i32(5), oc.i64(7))
    oc.launch_each("a.cu", [("k0", (2, 3, 1), (128,), 0), ("k1", (4,), (64, 2), 0), ("k2", (1,), (32,), 0)], t, args)
    assert len(packs) == 1
    extras = {a[-1] for a in launched}
    assert len(extras) == 1
    assert [a[:10] for a in launched] == [
        (100, 2, 3, 1, 128, 1, 1, 0, 77, 0),
        (101, 4, 1, 1, 64, 2, 1, 0, 77, 0),
        (102, 1, 1, 1, 32, 1, 1, 0, 77, 0),
    ]


def _divmod_scalar(f):
    """FastDivmod's constants as a numpy structured scalar: a C struct by value, as the launch path packs it."""
    return np.array(tuple(f.params()), dtype=[("d", "<u4"), ("m", "<u4"), ("l", "<u4")])[()]


def test_kernel_arguments_packed_as_the_c_abi_lays_them_out():
    # ops.cuda packs a launch's arguments into the one buffer cuLaunchKernel reads (no GPU needed to check
    # the layout): against ctypes' layout of the same C parameters, with padding before 8-byte values and
    # before a struct, and structs of 4-byte fields at odd offsets
    import ctypes

    from ops.cuda import KernelArguments, i32, i64

    class Durations(ctypes.Structure):
        _fields_ = [("n", ctypes.c_int32), ("d", ctypes.c_int32 * 16)]

    class Divmod(ctypes.Structure):
        _fields_ = [("d", ctypes.c_uint32), ("m", ctypes.c_uint32), ("l", ctypes.c_uint32)]

    class Pair(ctypes.Structure):  # 8-byte aligned, after an int: 4 bytes of padding before it
        _fields_ = [("v", ctypes.c_int64), ("w", ctypes.c_int32)]

    class Params(ctypes.Structure):
        _fields_ = [
            ("x", ctypes.c_void_p),
            ("a", ctypes.c_int32),
            ("y", ctypes.c_void_p),
            ("b", ctypes.c_int32),
            ("div", Divmod),
            ("c", ctypes.c_int64),
            ("f", ctypes.c_float),
            ("dur", Durations),
            ("g", ctypes.c_double),
            ("null", ctypes.c_int64),
            ("h", ctypes.c_int32),
            ("pair", Pair),
            ("k", ctypes.c_int32),
        ]

    rng = np.random.default_rng(5)
    x, y = torch.empty(3), torch.empty(5, dtype=torch.int64)
    durations = np.array((3, list(rng.integers(0, 9, 16))), dtype=[("n", "<i4"), ("d", "<i4", (16,))])[()]
    div = _divmod_scalar(FastDivmod(int(rng.integers(2, 1000))))
    a, b, c = int(rng.integers(-9, 9)), int(rng.integers(-9, 9)), int(rng.integers(1 << 40, 1 << 50))
    pair = np.zeros((), dtype=np.dtype([("v", "<i8"), ("w", "<i4")], align=True))  # zero padding bytes
    pair["v"], pair["w"] = c + 1, -a
    pair = pair[()]
    args = (
        x,
        i32(a),
        y,
        i32(b),
        div,
        i64(c),
        np.float32(0.25),
        durations,
        np.float64(-1.5),
        0,
        i32(7),
        pair,
        i32(b + 3),
    )
    packed = KernelArguments(args)
    packed.pack(args)
    want = Params(
        x.data_ptr(),
        a,
        y.data_ptr(),
        b,
        Divmod(*(int(div[k]) for k in ("d", "m", "l"))),
        c,
        0.25,
        Durations(3, (ctypes.c_int32 * 16)(*(int(v) for v in durations["d"]))),
        -1.5,
        0,
        7,
        Pair(c + 1, -a),
        b + 3,
    )
    assert Params.pair.offset % 8 == 0 and Params.pair.offset > Params.h.offset + 4
    assert packed.layout.size == Params.k.offset + 4
    assert bytes(packed.buffer)[: packed.layout.size] == bytes(want)[: packed.layout.size]
    assert packed.size.value == packed.layout.size
    # what would shift the later arguments is refused: other types, a Python int other than 0 (NULL), a
    # struct of another dtype than the kernel took, a struct dtype without its trailing padding
    for bad in ("3", 1.5, np.int16(2)):
        with pytest.raises(TypeError, match="argument 1 has type"):
            KernelArguments((x, bad))
    with pytest.raises(TypeError, match="only 0 \\(a NULL pointer\\)"):
        packed.pack(args[:9] + (5,) + args[10:])
    with pytest.raises(TypeError, match="this kernel took"):
        packed.pack(args[:4] + (durations,) + args[5:])
    unpadded = np.zeros((), dtype=[("v", "<i8"), ("w", "<i4")])[()]
    with pytest.raises(TypeError, match="trailing padding"):
        KernelArguments((x, unpadded))


def test_parameter_struct_packed_as_the_c_abi_lays_it_out():
    # ops.params.struct: a kernel's one parameter struct, packed by ops.cuda's launch buffer exactly as ctypes
    # lays out the same C struct (a bool before an int, a nested struct of 8-byte alignment after a 4-byte
    # field, an array, trailing padding); fields by name, a missing or unknown one is an error
    import ctypes

    from ops.cuda import KernelArguments
    from ops.params import FAST_DIVMOD, struct

    Inner = struct("Inner", [("p", "ptr"), ("k", "int")])
    Params = struct(
        "Params",
        [
            ("flag", "bool"),
            ("n", "int"),
            ("inner", Inner),
            ("div", FAST_DIVMOD),
            ("d", ("int", 3)),
            ("x", "double"),
            ("tail", "bool"),
        ],
    )

    class CInner(ctypes.Structure):
        _fields_ = [("p", ctypes.c_void_p), ("k", ctypes.c_int32)]

    class CDivmod(ctypes.Structure):
        _fields_ = [("d", ctypes.c_uint32), ("m", ctypes.c_uint32), ("l", ctypes.c_uint32)]

    class CParams(ctypes.Structure):
        _fields_ = [
            ("flag", ctypes.c_bool),
            ("n", ctypes.c_int32),
            ("inner", CInner),
            ("div", CDivmod),
            ("d", ctypes.c_int32 * 3),
            ("x", ctypes.c_double),
            ("tail", ctypes.c_bool),
        ]

    x = torch.empty(4)
    div = FastDivmod(37)
    value = Params(flag=True, n=-5, inner=Inner(p=x, k=9), div=div.params(), d=(1, 2, 3), x=0.25, tail=True)
    assert Params.c_size == ctypes.sizeof(CParams) and Params.c_align == ctypes.alignment(CParams)
    packed = KernelArguments((value,))
    packed.pack((value,))
    want = CParams(
        True, -5, CInner(x.data_ptr(), 9), CDivmod(div.d, div.m, div.l), (ctypes.c_int32 * 3)(1, 2, 3), 0.25, True
    )
    # compare field by field at ctypes' offsets (padding bytes are unspecified)
    got = bytes(packed.buffer)[: Params.c_size]
    for name, ctype in CParams._fields_:
        offset, size = getattr(CParams, name).offset, ctypes.sizeof(ctype)
        assert got[offset : offset + size] == bytes(want)[offset : offset + size], name
    assert value.inner.k == 9 and value.div.d == 37
    with pytest.raises(TypeError, match="missing"):
        Params(flag=True, n=1, inner=value.inner, div=value.div, d=(1, 2, 3), x=0.0)
    with pytest.raises(TypeError, match="unexpected"):
        Params(flag=True, n=1, inner=value.inner, div=value.div, d=(1, 2, 3), x=0.0, tail=False, extra=1)
    with pytest.raises(ValueError, match="expected 3 values"):
        packed.pack((value._replace(d=(1, 2)),))
    with pytest.raises(TypeError, match="this kernel took a Params"):
        packed.pack((value.inner,))
    with pytest.raises(TypeError, match="field y has type"):
        struct("Bad", [("y", "short")])


_ECHO = r"""
struct Divmod { unsigned int d, m, l; };
struct Pair { long long v; int w; };
extern "C" __global__ void echo(const float* p, int a, Divmod div, long long c, float f, Pair pair, double g,
                                const float* null, int k, long long* out) {
  out[0] = (long long)p; out[1] = a; out[2] = div.d; out[3] = div.m; out[4] = div.l; out[5] = c;
  out[6] = __float_as_int(f); out[7] = pair.v; out[8] = pair.w; out[9] = __double_as_longlong(g);
  out[10] = (long long)null; out[11] = k;
}
"""


@pytest.mark.cuda
def test_launch_passes_each_argument_where_the_kernel_reads_it(tmp_path):
    # ops.cuda.launch packs the arguments into one buffer for cuLaunchKernel: the kernel reads back every
    # value, after ints (4-byte), structs of 4-byte fields, an 8-byte aligned struct after a float, a NULL
    from ops.cuda import i32, i64, launch

    path = tmp_path / "echo.cu"
    path.write_text(_ECHO)
    rng = np.random.default_rng(8)
    p = torch.empty(3, device=DEV)
    out = torch.full((12,), -7, dtype=torch.int64, device=DEV)
    a, c, k = int(rng.integers(-100, 100)), int(rng.integers(1 << 40, 1 << 50)), int(rng.integers(-100, 100))
    div = _divmod_scalar(ops.FastDivmod(int(rng.integers(2, 1000))))
    pair = np.zeros((), dtype=np.dtype([("v", "<i8"), ("w", "<i4")], align=True))
    pair["v"], pair["w"] = c - 5, -a
    f, g = np.float32(rng.standard_normal()), np.float64(rng.standard_normal())
    launch(str(path), "echo", p, (1,), (1,), (p, i32(a), div, i64(c), f, pair[()], g, 0, i32(k), out))
    want = [
        p.data_ptr(),
        a,
        int(div["d"]),
        int(div["m"]),
        int(div["l"]),
        c,
        int(f.view(np.int32)),
        c - 5,
        -a,
        int(g.view(np.int64)),
        0,
        k,
    ]
    assert out.tolist() == want


# -------------------------------------------------------------------- host_reader


def test_host_reader_names_a_device_that_is_not_cuda():
    # ops.cuda.host_reader reads a CUDA tensor: any other device is a ValueError naming the argument, raised
    # before CuPy or the CUDA runtime is touched (so it is checked here, without a GPU)
    from ops.cuda import host_reader

    for bad in ("cpu", torch.device("meta"), torch.device("cpu", 0)):
        with pytest.raises(ValueError, match="device: expected a CUDA device"):
            host_reader(bad, 6, torch.int64)


@pytest.mark.cuda
def test_host_reader_reads_behind_its_mark_alone():
    """read() returns what the current stream had queued before mark() (a fill behind a 0.2 s sleep), and does
    not wait for what was queued after it (another sleep): the loss reads its stats while log_probs runs."""
    from ops.cuda import host_reader

    gen = torch.Generator().manual_seed(5)
    src = torch.empty(6, dtype=torch.int64, device=DEV)
    want = torch.randint(-(2**40), 2**40, (6,), generator=gen)
    reader = host_reader(src.device, 6, torch.int64)
    assert host_reader(src.device, 6, torch.int64) is reader
    cycles = int(0.2 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # about 0.2 s
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    src.copy_(want.to(DEV, non_blocking=True))
    reader.mark()
    torch.cuda._sleep(4 * cycles)  # queued after the mark: not waited for
    end = torch.cuda.Event()
    end.record()
    got = reader.read(src)
    busy = not end.query()  # the second sleep still runs
    torch.cuda.synchronize()
    assert got == want.tolist()
    assert busy
    reader.mark()
    assert reader.read(src[1:4]) == want[1:4].tolist()  # fewer elements than the reader's: theirs alone
    for bad in (torch.zeros(7, dtype=torch.int64, device=DEV), src.float(), src.view(2, 3).t(), src.cpu()):
        with pytest.raises(ValueError, match="HostReader.read: src must be"):
            reader.read(bad)


@pytest.mark.cuda
def test_host_reader_goes_with_its_thread():
    """A thread's reader is freed when the thread ends, and destroys its stream and both events."""
    import gc
    import threading
    import weakref

    from ops.cuda import host_reader

    refs, destroyed, got = [], [], []
    want = torch.randint(-(2**40), 2**40, (6,), generator=torch.Generator().manual_seed(6))

    def work():
        reader = host_reader(torch.device(DEV), 6, torch.int64)
        real = reader.runtime

        class Spy:  # the runtime, noting what is destroyed
            def __getattr__(self, name):
                return getattr(real, name)

            def streamDestroy(self, stream):
                destroyed.append(("stream", stream))
                real.streamDestroy(stream)

            def eventDestroy(self, event):
                destroyed.append(("event", event))
                real.eventDestroy(event)

        reader.runtime = Spy()
        src = want.to(DEV)
        reader.mark()
        got.append(reader.read(src))
        refs.append(weakref.ref(reader))
        handles = [("stream", reader.stream), ("event", reader.marked), ("event", reader.copied)]
        refs.append(handles)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    gc.collect()
    assert got == [want.tolist()]
    assert refs[0]() is None
    assert sorted(destroyed) == sorted(refs[1])


# -------------------------------------------------------------------- streams and CUDA graphs


@pytest.mark.cuda
def test_runs_on_current_stream_and_graph_capture():
    x = torch.randn(64, 500, device=DEV)
    rs = torch.tensor([0, 3, 3, 10], device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lse = ops.reduce(x, -1, "logsumexp")
        ids = ragged.row_splits_to_row_ids(rs, 10, dtype=torch.int32)
        g = ops.gather(x[:10], ids[:, None], axis=1, batch_dims=1, check_bounds=False)
    torch.cuda.current_stream().wait_stream(s)
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), rtol=1e-5, atol=1e-5)
    assert ids.cpu().tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 2, 2]
    assert torch.equal(g[:, 0], x[torch.arange(10, device=DEV), ids.long()])
    # CUDA graph capture: no host sync when num_elems / check_bounds=False are used
    static_x = torch.randn(64, 500, device=DEV)
    static_rs = torch.tensor([0, 3, 3, 10], device=DEV)
    ops.reduce(static_x, -1, "logsumexp")  # warm up / compile outside capture
    methods = ragged.ROW_IDS_METHODS
    for method in methods:
        ragged.row_splits_to_row_ids(static_rs, 10, dtype=torch.int32, method=method)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        glse = ops.reduce(static_x, -1, "logsumexp")
        gids = [ragged.row_splits_to_row_ids(static_rs, 10, dtype=torch.int32, method=m) for m in methods]
    static_x.copy_(torch.randn(64, 500, device=DEV))
    static_rs.copy_(torch.tensor([0, 0, 6, 10]))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(glse, torch.logsumexp(static_x, -1), rtol=1e-5, atol=1e-5)
    for g in gids:
        assert g.cpu().tolist() == [1, 1, 1, 1, 1, 1, 2, 2, 2, 2]
