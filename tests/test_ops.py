"""CPU tests for ops: FastDivmod (the device formula), gather, reduce."""

import math

import numpy as np
import pytest
import torch

import ops
from ops import FastDivmod

N_MAX = (1 << 31) - 1


# ---------------------------------------------------------------- FastDivmod
def _edge_numerators(d):
    k = np.array([0, 1, 2, 3, 7, 1000], dtype=np.int64)
    cands = [0, 1, 2, d - 1, d, d + 1, N_MAX, N_MAX - 1, N_MAX - d, (N_MAX // d) * d,
             (N_MAX // d) * d - 1]
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
    ds.update([N_MAX, N_MAX - 1, 3 ** 19, 10 ** 9 + 7, 641 * 6700417 % (1 << 31), 65535 * 3])
    return sorted(ds)


def test_constants_match_definition():
    for d in _edge_divisors():
        f = FastDivmod(d)
        l = math.ceil(math.log2(d)) if d > 1 else 0
        assert f.l == l
        assert f.m == (1 << 32) * ((1 << l) - d) // d + 1
        assert 1 <= f.m < (1 << 32)
        s = f.as_struct()
        assert s.dtype == ops.FAST_DIVMOD_DTYPE and s.dtype.itemsize == 12
        assert (int(s["d"]), int(s["m"]), int(s["l"])) == (d, f.m, f.l)


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
    s = FastDivmod(torch.tensor(d)).as_struct()
    assert s.shape == (4,) and list(s["d"]) == list(d)


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
    np.testing.assert_array_equal(ops.gather(xn, idn[:, None], axis=1, batch_dims=1),
                                  np.take_along_axis(xn, idn[:, None], 1))


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
                    total_t += ops.sharded_gather(torch.from_numpy(shard), torch.from_numpy(indices % G),
                                                  axis, lo, batch_dims=bd)
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
        "ops::half_t", "ops::bf16_t", "float", "double", "int", "long long"]
    with pytest.raises(TypeError, match="dtype"):
        ops.ctype(torch.bool)
    for dt in (torch.int8, torch.uint8, torch.int32, torch.int64, np.int16, np.uint32, np.dtype("int64")):
        assert ops.is_integer_dtype(dt)
    for dt in (torch.bool, torch.float32, torch.complex64, np.float64, np.bool_):
        assert not ops.is_integer_dtype(dt)


def test_launch_opts_a_kernel_in_to_more_shared_memory_once_per_size(monkeypatch):
    # ops.cuda.launch raises a kernel's dynamic shared memory cap (cuFuncSetAttribute) before a launch that
    # asks for more than 48 KiB, once per size it grows to (no GPU needed: the driver call is recorded)
    import types

    import ops.cuda as oc

    calls = []
    driver = types.SimpleNamespace(funcSetAttribute=lambda fn, attribute, value: calls.append((fn, attribute, value)))
    monkeypatch.setattr(oc, "cupy", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(driver=driver)))
    monkeypatch.setattr(oc, "_shared_mem_allowed", {})
    key, other = ("a.cu", "k<float>", 0), ("a.cu", "k<double>", 0)
    for size in (48 * 1024, 64 * 1024, 60 * 1024, 64 * 1024, 100 * 1024):
        oc._allow_shared_mem(key, 1234, size)
    oc._allow_shared_mem(other, 5678, 50 * 1024)
    assert calls == [(1234, 8, 64 * 1024), (1234, 8, 100 * 1024), (5678, 8, 50 * 1024)]


def test_host_reader_names_a_device_that_is_not_cuda():
    # ops.cuda.host_reader reads a CUDA tensor: any other device is a ValueError naming the argument, raised
    # before CuPy or the CUDA runtime is touched (so it is checked here, without a GPU)
    from ops.cuda import host_reader
    for bad in ("cpu", torch.device("meta"), torch.device("cpu", 0)):
        with pytest.raises(ValueError, match="device: expected a CUDA device"):
            host_reader(bad, 6, torch.int64)


def test_kernel_arguments_packed_as_the_c_abi_lays_them_out():
    # ops.cuda packs a launch's arguments into the one buffer cuLaunchKernel reads (no GPU needed to check
    # the layout): against ctypes' layout of the same C parameters, with padding before 8-byte values and
    # before a struct, and structs of 4-byte fields at odd offsets
    import ctypes

    from ops.cuda import _Arguments, i32, i64

    class Durations(ctypes.Structure):
        _fields_ = [("n", ctypes.c_int32), ("d", ctypes.c_int32 * 16)]

    class Divmod(ctypes.Structure):
        _fields_ = [("d", ctypes.c_uint32), ("m", ctypes.c_uint32), ("l", ctypes.c_uint32)]

    class Pair(ctypes.Structure):  # 8-byte aligned, after an int: 4 bytes of padding before it
        _fields_ = [("v", ctypes.c_int64), ("w", ctypes.c_int32)]

    class Params(ctypes.Structure):
        _fields_ = [("x", ctypes.c_void_p), ("a", ctypes.c_int32), ("y", ctypes.c_void_p), ("b", ctypes.c_int32),
                    ("div", Divmod), ("c", ctypes.c_int64), ("f", ctypes.c_float), ("dur", Durations),
                    ("g", ctypes.c_double), ("null", ctypes.c_int64), ("h", ctypes.c_int32), ("pair", Pair),
                    ("k", ctypes.c_int32)]

    rng = np.random.default_rng(5)
    x, y = torch.empty(3), torch.empty(5, dtype=torch.int64)
    durations = np.array((3, list(rng.integers(0, 9, 16))), dtype=[("n", "<i4"), ("d", "<i4", (16,))])[()]
    div = FastDivmod(int(rng.integers(2, 1000))).as_struct()
    a, b, c = int(rng.integers(-9, 9)), int(rng.integers(-9, 9)), int(rng.integers(1 << 40, 1 << 50))
    pair = np.zeros((), dtype=np.dtype([("v", "<i8"), ("w", "<i4")], align=True))  # zero padding bytes
    pair["v"], pair["w"] = c + 1, -a
    pair = pair[()]
    args = (x, i32(a), y, i32(b), div, i64(c), np.float32(0.25), durations, np.float64(-1.5), 0, i32(7), pair,
            i32(b + 3))
    packed = _Arguments(args)
    packed.pack(args)
    want = Params(x.data_ptr(), a, y.data_ptr(), b, Divmod(*(int(div[k]) for k in ("d", "m", "l"))), c, 0.25,
                  Durations(3, (ctypes.c_int32 * 16)(*(int(v) for v in durations["d"]))), -1.5, 0, 7, Pair(c + 1, -a),
                  b + 3)
    assert Params.pair.offset % 8 == 0 and Params.pair.offset > Params.h.offset + 4
    assert packed.layout.size == Params.k.offset + 4
    assert bytes(packed.buffer)[:packed.layout.size] == bytes(want)[:packed.layout.size]
    assert packed.size.value == packed.layout.size
    # what would shift the later arguments is refused: other types, a Python int other than 0 (NULL), a
    # struct of another dtype than the kernel took, a struct dtype without its trailing padding
    for bad in ("3", 1.5, np.int16(2)):
        with pytest.raises(TypeError, match="argument 1 has type"):
            _Arguments((x, bad))
    with pytest.raises(TypeError, match="only 0 \\(a NULL pointer\\)"):
        packed.pack(args[:9] + (5,) + args[10:])
    with pytest.raises(TypeError, match="this kernel took"):
        packed.pack(args[:4] + (durations,) + args[5:])
    unpadded = np.zeros((), dtype=[("v", "<i8"), ("w", "<i4")])[()]
    with pytest.raises(TypeError, match="trailing padding"):
        _Arguments((x, unpadded))


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
    x[1, 2, 4] = math.nan   # NaN propagates
    x[2, :5, 5] = -math.inf
    x[3, 7, 6] = math.inf   # +inf: +inf
    for dim in (0, 1, 2):
        want = torch.logsumexp(x.double(), dim)
        out = torch.full((6, 11, 31)[:dim] + (6, 11, 31)[dim + 1:] + (2,), 7.0, dtype=dtype)[..., 0]  # strided
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


def test_parameter_struct_packed_as_the_c_abi_lays_it_out():
    # ops.params.struct: a kernel's one parameter struct, packed by ops.cuda's launch buffer exactly as ctypes
    # lays out the same C struct (a bool before an int, a nested struct of 8-byte alignment after a 4-byte
    # field, an array, trailing padding); fields by name, a missing or unknown one is an error
    import ctypes

    from ops.cuda import _Arguments
    from ops.params import FAST_DIVMOD, struct

    Inner = struct("Inner", [("p", "ptr"), ("k", "int")])
    Params = struct("Params", [("flag", "bool"), ("n", "int"), ("inner", Inner), ("div", FAST_DIVMOD),
                               ("d", ("int", 3)), ("x", "double"), ("tail", "bool")])

    class CInner(ctypes.Structure):
        _fields_ = [("p", ctypes.c_void_p), ("k", ctypes.c_int32)]

    class CDivmod(ctypes.Structure):
        _fields_ = [("d", ctypes.c_uint32), ("m", ctypes.c_uint32), ("l", ctypes.c_uint32)]

    class CParams(ctypes.Structure):
        _fields_ = [("flag", ctypes.c_bool), ("n", ctypes.c_int32), ("inner", CInner), ("div", CDivmod),
                    ("d", ctypes.c_int32 * 3), ("x", ctypes.c_double), ("tail", ctypes.c_bool)]

    x = torch.empty(4)
    div = FastDivmod(37)
    value = Params(flag=True, n=-5, inner=Inner(p=x, k=9), div=div.params(), d=(1, 2, 3), x=0.25, tail=True)
    assert Params.c_size == ctypes.sizeof(CParams) and Params.c_align == ctypes.alignment(CParams)
    packed = _Arguments((value,))
    packed.pack((value,))
    want = CParams(True, -5, CInner(x.data_ptr(), 9), CDivmod(div.d, div.m, div.l), (ctypes.c_int32 * 3)(1, 2, 3),
                   0.25, True)
    # compare field by field at ctypes' offsets (padding bytes are unspecified)
    got = bytes(packed.buffer)[:Params.c_size]
    for name, ctype in CParams._fields_:
        offset, size = getattr(CParams, name).offset, ctypes.sizeof(ctype)
        assert got[offset:offset + size] == bytes(want)[offset:offset + size], name
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
