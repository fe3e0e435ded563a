"""GPU tests for ops and ragged: every CUDA function equals its CPU twin.

All marked ``cuda`` (tests/conftest.py skips them without a GPU and CuPy).
"""

import math

import numpy as np
import pytest
import torch

import ops
import ragged

pytestmark = pytest.mark.cuda

DEV = "cuda"
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
GATHER_DTYPES = FLOATS + [torch.int32, torch.int64]


def _rand(shape, dtype, gen):
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 10).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


# -------------------------------------------------------------------- gather
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
    oflat = torch.full((5 * 2 * 3 * K + 1,), -1, dtype=dtype, device=DEV) if not dtype.is_floating_point \
        else torch.full((5 * 2 * 3 * K + 1,), math.nan, dtype=dtype, device=DEV)
    out = oflat[1:].view(3, 5, 2, K)
    ops.gather(pv, idx.to(DEV), axis=1, out=out)
    assert torch.equal(out.cpu(), ref)


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


def test_gather_out_of_range_cuda():
    p = torch.zeros(3, 4, device=DEV)
    with pytest.raises(IndexError, match="indices"):
        ops.gather(p, torch.tensor([4], device=DEV), axis=1)
    got = ops.gather(torch.ones(3, 4, device=DEV), torch.tensor([4, 1], device=DEV), axis=1, check_bounds=False)
    assert got.cpu().tolist() == [[0.0, 1.0]] * 3


def test_sharded_gather_cuda_sums_to_full():
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(4, 10, 8, generator=gen)
    idx = torch.randint(-10, 10, (4, 7), generator=gen)
    full = ops.gather(p, idx, axis=1, batch_dims=1)
    total = torch.zeros(full.shape, device=DEV)
    for lo, hi in [(0, 3), (3, 3), (3, 9), (9, 10)]:
        total += ops.sharded_gather(p[:, lo:hi].to(DEV), idx.to(DEV), 1, lo, full_size=10, batch_dims=1)
    assert torch.equal(total.cpu(), full)


def test_gather_empty_cuda():
    p = torch.randn(3, 4, device=DEV)
    assert tuple(ops.gather(p, torch.zeros(0, dtype=torch.int64, device=DEV), axis=1).shape) == (3, 0)


# -------------------------------------------------------------------- reduce
@pytest.mark.parametrize("op", ["sum", "max", "logsumexp"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_reduce_all_axes_match_cpu(op, dtype):
    gen = torch.Generator().manual_seed(2)
    shapes = [(7,), (5, 3), (4, 33, 6), (2, 3, 4, 5), (1, 9), (9, 1), (3, 1, 70), (2, 1500), (1, 100000),
              (100000, 3), (3, 2, 5000), (64, 40, 33)]
    for shape in shapes:
        x = (torch.randn(shape, generator=gen) * 3).to(dtype)
        for axis in range(-len(shape), len(shape)):
            ref = ops.reduce(x, axis, op)
            got = ops.reduce(x.to(DEV), axis, op)
            assert got.dtype == ref.dtype and got.shape == ref.shape
            rtol = 1e-10 if dtype == torch.float64 else 1e-5
            atol = 1e-10 if dtype == torch.float64 else (1e-5 if op != "sum" else 1e-6 * math.sqrt(shape[axis]) * 30)
            torch.testing.assert_close(got.cpu(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("op", ["sum", "max", "logsumexp"])
def test_reduce_long_rows_split(op):
    """Few rows, very long: the split-across-blocks path with a finalize pass."""
    gen = torch.Generator().manual_seed(3)
    for shape, axis in [((2, 3_000_000), 1), ((3_000_000, 2), 0), ((2, 1_000_000, 3), 1)]:
        x = torch.rand(shape, generator=gen)
        ref = ops.reduce(x.double(), axis, op)
        got = ops.reduce(x.to(DEV), axis, op)
        torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=1e-5)


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


def test_reduce_empty_axis_cuda():
    x = torch.zeros(3, 0, device=DEV)
    assert ops.reduce(x, 1, "logsumexp").cpu().tolist() == [-math.inf] * 3
    assert ops.reduce(x, 1, "sum").cpu().tolist() == [0.0] * 3


# -------------------------------------------------------------------- ragged
@pytest.mark.parametrize("seed", range(5))
def test_ragged_kernels_match_cpu(seed):
    rng = np.random.default_rng(seed)
    for num_rows in (1, 2, 17, 1000, 30000):
        sizes = rng.integers(0, 50, num_rows)
        sizes[rng.random(num_rows) < 0.3] = 0
        sizes[0] = 0
        sizes[-1] = 0
        for sdt in (torch.int32, torch.int64):
            rs = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)])).to(sdt)
            n = int(rs[-1])
            for odt in (torch.int32, torch.int64):
                ref = ragged.row_splits_to_row_ids(rs, n, dtype=odt)
                got = ragged.row_splits_to_row_ids(rs.to(DEV), n, dtype=odt)
                assert got.dtype == odt and torch.equal(got.cpu(), ref)
                back = ragged.row_ids_to_row_splits(got, num_rows, dtype=sdt)
                assert back.dtype == sdt and torch.equal(back.cpu(), rs)
            assert torch.equal(ragged.row_splits_to_row_ids(rs.to(DEV)).cpu(), ragged.row_splits_to_row_ids(rs))


def test_ragged_all_empty_and_shape_cuda():
    rs = torch.zeros(5, dtype=torch.int64, device=DEV)
    assert ragged.row_splits_to_row_ids(rs, 0).numel() == 0
    assert ragged.row_ids_to_row_splits(torch.zeros(0, dtype=torch.int32, device=DEV), 4).cpu().tolist() == [0] * 5
    s = ragged.RaggedShape.from_sizes(torch.tensor([2, 0, 3], device=DEV), num_elems=5, row_ids_dtype=torch.int32)
    assert s.dim0 == 3 and s.numel == 5
    assert s.row_ids.device.type == "cuda" and s.row_ids.cpu().tolist() == [0, 0, 2, 2, 2]


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
    ops.reduce(static_x, -1, "logsumexp")  # warm up / compile outside capture
    ragged.row_splits_to_row_ids(rs, 10, dtype=torch.int32)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        glse = ops.reduce(static_x, -1, "logsumexp")
        gids = ragged.row_splits_to_row_ids(rs, 10, dtype=torch.int32)
    static_x.copy_(torch.randn(64, 500, device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(glse, torch.logsumexp(static_x, -1), rtol=1e-5, atol=1e-5)
    assert gids.cpu().tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 2, 2]
