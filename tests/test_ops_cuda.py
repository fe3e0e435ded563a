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
        total += ops.sharded_gather(p[lo:lo + 2], idx, 0, lo, full_size=4)
    assert torch.equal(total, p[[3, 3, 0, 2, 0]])


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
METHODS = ragged.ROW_IDS_METHODS
INDEX = [torch.int32, torch.int64]


def _sizes(rng, num_rows, num_elems, empty=0.3):
    """Random row sizes summing to num_elems, a fraction ``empty`` of the rows (at least) empty."""
    sizes = np.zeros(num_rows, dtype=np.int64)
    full = np.flatnonzero(rng.random(num_rows) >= empty)
    if full.size == 0:
        full = rng.integers(0, num_rows, 1)
    sizes[full] = rng.multinomial(num_elems, np.full(full.size, 1.0 / full.size))
    return sizes


def _splits(sizes, dtype):
    return torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)])).to(dtype)


def _poison(n, dtype):
    """Fill and free a block of n elements: torch's caching allocator hands it to the next allocation
    of that size, so an element a kernel fails to write holds -7, not a right answer left behind by
    an earlier call."""
    torch.full((n,), -7, dtype=dtype, device=DEV)


def _row_ids(rs, n, dtype, method):
    _poison(n, dtype)
    return ragged.row_splits_to_row_ids(rs, n, dtype=dtype, method=method)


def _check_row_ids(rs, method):
    """Both output dtypes against the CPU (repeat_interleave), and the way back to row_splits."""
    n, num_rows = int(rs[-1]), rs.numel() - 1
    rs_dev = rs.to(DEV)
    for odt in INDEX:
        ref = ragged.row_splits_to_row_ids(rs, n, dtype=odt)
        got = _row_ids(rs_dev, n, odt, method)
        assert got.device.type == "cuda" and got.dtype == odt and got.shape == (n,)
        assert torch.equal(got.cpu(), ref), (method, num_rows, n, rs.dtype, odt)
        _poison(num_rows + 1, rs.dtype)
        back = ragged.row_ids_to_row_splits(got, num_rows, dtype=rs.dtype)
        assert back.dtype == rs.dtype and torch.equal(back.cpu(), rs)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", range(3))
def test_row_ids_random_with_empty_rows(method, seed):
    """Empty first and last rows, runs of empty rows (some longer than a 1024-step tile), int32/int64."""
    rng = np.random.default_rng(seed)
    for num_rows in (1, 2, 17, 1000, 30000):
        sizes = rng.integers(1, 50, num_rows)
        sizes[rng.random(num_rows) < 0.3] = 0
        sizes[0] = sizes[-1] = 0
        for run in (3, 1500):  # a run of empty rows somewhere
            if num_rows > run:
                start = int(rng.integers(0, num_rows - run))
                sizes[start:start + run] = 0
        for sdt in INDEX:
            _check_row_ids(_splits(sizes, sdt), method)


@pytest.mark.parametrize("method", METHODS)
def test_row_ids_single_row_and_no_elements(method):
    rng = np.random.default_rng(7)
    for n in (1, 5, 1023, 1024, 1025, 4097, int(rng.integers(10000, 100000))):
        for sdt in INDEX:
            _check_row_ids(torch.tensor([0, n], dtype=sdt), method)
    for num_rows in (0, 1, 3, 5000):  # num_elems == 0: every row empty
        for sdt in INDEX:
            rs = torch.zeros(num_rows + 1, dtype=sdt, device=DEV)
            for odt in INDEX:
                ids = ragged.row_splits_to_row_ids(rs, 0, dtype=odt, method=method)
                assert ids.dtype == odt and ids.shape == (0,)
                _poison(num_rows + 1, sdt)
                back = ragged.row_ids_to_row_splits(ids, num_rows, dtype=sdt)
                assert back.cpu().tolist() == [0] * (num_rows + 1)


@pytest.mark.parametrize("method", METHODS)
def test_row_ids_tile_boundaries(method):
    """num_elems + num_rows - 1 (the merge's steps) around multiples of the 1024-step tile."""
    rng = np.random.default_rng(11)
    for steps in (1023, 1024, 1025, 2047, 2048, 2049, 10 * 1024 - 1, 10 * 1024, 10 * 1024 + 1):
        for num_rows in (1, 2, 7, 300, 1024, steps):
            num_elems = steps - num_rows + 1
            if num_elems < 1:
                continue
            sizes = _sizes(rng, num_rows, num_elems)
            for sdt in INDEX:
                _check_row_ids(_splits(sizes, sdt), method)


@pytest.mark.parametrize("method", METHODS)
def test_row_ids_large(method):
    """The transducer's scale: 10^7 rows of logits (elements) in 10^4 utterances (rows)."""
    rng = np.random.default_rng(13)
    sizes = _sizes(rng, 10_000, 10_000_000, empty=0.05)
    for sdt in INDEX:
        _check_row_ids(_splits(sizes, sdt), method)


def test_row_ids_methods_agree_on_many_rows():
    """Many rows, few elements each (the merge's row starts outnumber its elements)."""
    rng = np.random.default_rng(17)
    sizes = _sizes(rng, 2_000_000, 1_000_000, empty=0.5)
    rs = _splits(sizes, torch.int64).to(DEV)
    ref = ragged.row_splits_to_row_ids(rs.cpu(), int(rs[-1]), dtype=torch.int32)
    for method in METHODS:
        got = _row_ids(rs, ref.numel(), torch.int32, method)
        assert torch.equal(got.cpu(), ref), method


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
    static_rs = torch.tensor([0, 3, 3, 10], device=DEV)
    ops.reduce(static_x, -1, "logsumexp")  # warm up / compile outside capture
    for method in METHODS:
        ragged.row_splits_to_row_ids(static_rs, 10, dtype=torch.int32, method=method)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        glse = ops.reduce(static_x, -1, "logsumexp")
        gids = [ragged.row_splits_to_row_ids(static_rs, 10, dtype=torch.int32, method=m) for m in METHODS]
    static_x.copy_(torch.randn(64, 500, device=DEV))
    static_rs.copy_(torch.tensor([0, 0, 6, 10]))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(glse, torch.logsumexp(static_x, -1), rtol=1e-5, atol=1e-5)
    for g in gids:
        assert g.cpu().tolist() == [1, 1, 1, 1, 1, 1, 2, 2, 2, 2]


# -------------------------------------------------------------------- launch
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
    div = ops.FastDivmod(int(rng.integers(2, 1000))).as_struct()
    pair = np.zeros((), dtype=np.dtype([("v", "<i8"), ("w", "<i4")], align=True))
    pair["v"], pair["w"] = c - 5, -a
    f, g = np.float32(rng.standard_normal()), np.float64(rng.standard_normal())
    launch(str(path), "echo", p, (1,), (1,), (p, i32(a), div, i64(c), f, pair[()], g, 0, i32(k), out))
    want = [p.data_ptr(), a, int(div["d"]), int(div["m"]), int(div["l"]), c, int(f.view(np.int32)), c - 5, -a,
            int(g.view(np.int64)), 0, k]
    assert out.tolist() == want


# -------------------------------------------------------------------- host_reader
def test_host_reader_reads_behind_its_mark_alone():
    """read() returns what the current stream had queued before mark() (a fill behind a 0.2 s sleep), and does
    not wait for what was queued after it (another sleep): the loss reads its stats while log_probs runs."""
    from ops.cuda import host_reader
    gen = torch.Generator().manual_seed(5)
    src = torch.empty(6, dtype=torch.int64, device=DEV)
    want = torch.randint(-2**40, 2**40, (6,), generator=gen)
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
    for bad in (src[:5], src.float(), src.view(2, 3).t(), src.cpu()):
        with pytest.raises(ValueError, match="HostReader.read: src must be"):
            reader.read(bad)


def test_host_reader_goes_with_its_thread():
    """A thread's reader is freed when the thread ends, and destroys its stream and both events."""
    import gc
    import threading
    import weakref
    from ops.cuda import host_reader
    refs, destroyed, got = [], [], []
    want = torch.randint(-2**40, 2**40, (6,), generator=torch.Generator().manual_seed(6))

    def work():
        reader = host_reader(torch.device(DEV), 6, torch.int64)
        real = reader._rt

        class Spy:  # the runtime, noting what is destroyed
            def __getattr__(self, name):
                return getattr(real, name)

            def streamDestroy(self, stream):
                destroyed.append(("stream", stream))
                real.streamDestroy(stream)

            def eventDestroy(self, event):
                destroyed.append(("event", event))
                real.eventDestroy(event)
        reader._rt = Spy()
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
