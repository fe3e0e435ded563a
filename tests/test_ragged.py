"""ragged on the CPU and on CUDA (each CUDA function against the CPU one): row_splits <-> row_ids, row_of and
RaggedShape."""

import numpy as np
import pytest
import torch

import ragged
from ragged import RaggedShape

DEV = "cuda"


def _naive_row_ids(row_splits):
    out = []
    for r in range(len(row_splits) - 1):
        out += [r] * int(row_splits[r + 1] - row_splits[r])
    return np.array(out, dtype=np.int64)


def _random_sizes(rng, num_rows):
    sizes = rng.integers(0, 6, num_rows)
    sizes[rng.random(num_rows) < 0.3] = 0  # plenty of empty rows
    return sizes


@pytest.mark.parametrize("seed", range(10))
def test_round_trip_numpy_and_torch(seed):
    rng = np.random.default_rng(seed)
    for num_rows in (0, 1, 2, 7, 50):
        sizes = _random_sizes(rng, num_rows)
        for dt in (np.int32, np.int64):
            rs = np.concatenate([[0], np.cumsum(sizes)]).astype(dt)
            ref = _naive_row_ids(rs)
            ids = ragged.row_splits_to_row_ids(rs)
            assert ids.dtype == dt
            np.testing.assert_array_equal(ids, ref)
            back = ragged.row_ids_to_row_splits(ids, num_rows)
            assert back.dtype == dt
            np.testing.assert_array_equal(back, rs)

            t = torch.from_numpy(rs)
            tid = ragged.row_splits_to_row_ids(t, int(rs[-1]), dtype=torch.int32)
            assert tid.dtype == torch.int32
            np.testing.assert_array_equal(tid.numpy(), ref)
            assert ragged.row_splits_to_row_ids(t).dtype == t.dtype
            tback = ragged.row_ids_to_row_splits(tid, num_rows)
            assert tback.dtype == torch.int32
            np.testing.assert_array_equal(tback.numpy(), rs)
            assert ragged.row_ids_to_row_splits(tid, num_rows, dtype=torch.int64).dtype == torch.int64


@pytest.mark.parametrize("seed", range(5))
def test_row_of_a_range_equals_a_slice_of_row_ids(seed):
    rng = np.random.default_rng(seed)
    sizes = _random_sizes(rng, 40)
    sizes[0] = sizes[-1] = 0  # leading and trailing empty rows
    row_splits = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]))
    n = int(row_splits[-1])
    start, end = sorted(rng.integers(0, n + 1, 2))
    elems = torch.arange(int(start), int(end))
    got = ragged.row_of(row_splits, elems)
    np.testing.assert_array_equal(got.numpy(), _naive_row_ids(row_splits.numpy())[start:end])
    np.testing.assert_array_equal(ragged.row_of(row_splits, torch.arange(n)).numpy(), _naive_row_ids(row_splits))


def test_trailing_and_leading_empty_rows():
    rs = np.array([0, 0, 0, 3, 3, 4, 4, 4])
    np.testing.assert_array_equal(ragged.row_splits_to_row_ids(rs), [2, 2, 2, 4])
    np.testing.assert_array_equal(ragged.row_ids_to_row_splits(np.array([2, 2, 2, 4]), 7), rs)
    np.testing.assert_array_equal(ragged.row_ids_to_row_splits(np.array([], dtype=np.int64), 3), [0, 0, 0, 0])
    assert ragged.row_splits_to_row_ids(np.array([0])).shape == (0,)


def test_ragged_shape_properties():
    sizes = torch.tensor([3, 0, 2, 0])
    s = RaggedShape.from_sizes(sizes)
    assert s.dim0 == 4 and s.numel == 5
    assert s.tot_size(0) == 4 and s.tot_size(1) == 5
    assert s.row_splits.tolist() == [0, 3, 3, 5, 5]
    assert s.row_ids.tolist() == [0, 0, 0, 2, 2]
    s2 = RaggedShape(np.array([0, 2, 2]), num_elems=2)
    assert s2.row_ids.tolist() == [0, 0] and s2.numel == 2
    s3 = RaggedShape(torch.tensor([0, 1, 3]), row_ids=torch.tensor([0, 1, 1]))
    assert s3.numel == 3 and s3.row_ids.tolist() == [0, 1, 1]
    s4 = RaggedShape(torch.tensor([0, 2, 5]), row_ids_dtype=torch.int32)
    assert s4.row_ids.dtype == torch.int32
    assert RaggedShape.from_sizes(np.array([], dtype=np.int64)).dim0 == 0
    with pytest.raises(ValueError, match="axis"):
        s.tot_size(2)


def test_errors_name_arguments():
    with pytest.raises(ValueError, match="row_splits"):
        ragged.row_splits_to_row_ids(np.array([1, 2]))
    with pytest.raises(ValueError, match="row_splits"):
        ragged.row_splits_to_row_ids(np.array([0, 3, 2]))
    with pytest.raises(ValueError, match="row_splits"):
        ragged.row_splits_to_row_ids(np.array([], dtype=np.int64))
    with pytest.raises(ValueError, match="row_splits"):
        ragged.row_splits_to_row_ids(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(TypeError, match="row_splits"):
        ragged.row_splits_to_row_ids(np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="num_elems"):
        ragged.row_splits_to_row_ids(torch.tensor([0, 2]), num_elems=3)
    with pytest.raises(ValueError, match="row_ids"):
        ragged.row_ids_to_row_splits(np.array([0, 3]), 2)
    with pytest.raises(ValueError, match="row_ids"):
        ragged.row_ids_to_row_splits(torch.tensor([1, 0]), 2)
    with pytest.raises(ValueError, match="num_rows"):
        ragged.row_ids_to_row_splits(np.array([0]), -1)
    with pytest.raises(ValueError, match="sizes"):
        RaggedShape.from_sizes(np.array([1, -1]))
    with pytest.raises(ValueError, match="row_ids"):
        RaggedShape(torch.tensor([0, 1, 3]), row_ids=torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="num_elems"):
        RaggedShape(np.array([0, 1, 3]), num_elems=4)
    with pytest.raises(TypeError, match="num_elems must be an int, got Tensor"):
        ragged.row_splits_to_row_ids(torch.tensor([0, 1, 3]), num_elems=torch.tensor([[3]]))
    assert ragged.row_splits_to_row_ids(torch.tensor([0, 1, 3]), num_elems=torch.tensor(3)).tolist() == [0, 1, 1]


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_an_output_dtype_too_narrow_for_its_values_is_refused(lib):
    """row_splits end at the element count and row_ids reach the last row: a dtype that cannot hold them would
    wrap silently (200 elements in int8 gave row_splits [0, -56]); the widest values that fit pass."""
    arr = np.array if lib == "numpy" else torch.tensor
    int8, int16 = (np.int8, np.int16) if lib == "numpy" else (torch.int8, torch.int16)
    with pytest.raises(TypeError, match="int8 cannot hold row_splits up to 200"):
        ragged.row_ids_to_row_splits(arr([0] * 200, dtype=int8), 1)
    with pytest.raises(TypeError, match="int8 cannot hold row_splits up to 300"):
        ragged.row_ids_to_row_splits(arr([0] * 300), 1, dtype=int8)
    assert ragged.row_ids_to_row_splits(arr([0] * 127, dtype=int8), 1).tolist() == [0, 127]
    with pytest.raises(TypeError, match="int8 cannot hold row_ids up to 299"):
        ragged.row_splits_to_row_ids(arr(list(range(301))), dtype=int8)
    assert ragged.row_splits_to_row_ids(arr(list(range(129))), dtype=int8)[-1] == 127
    with pytest.raises(TypeError, match="int8 cannot hold sizes' running sums .* up to 200"):
        RaggedShape.from_sizes(arr([100, 100], dtype=int8))
    assert RaggedShape.from_sizes(arr([100, 100], dtype=int16)).row_splits.tolist() == [0, 100, 200]


def test_index_dtypes_that_do_not_index_as_int64_are_refused():
    """torch's uint16-uint64 have no comparison kernels on the CPU and numpy's uint64 passes 2^63: refused by
    name, as the dtype of an argument or of an output of the other library."""
    for bad in (np.array([0, 1], dtype=np.uint64), torch.tensor([0, 1]).to(torch.uint32)):
        with pytest.raises(TypeError, match="row_splits must hold integers that index as int64"):
            ragged.row_splits_to_row_ids(bad)
    with pytest.raises(TypeError, match="row_ids must hold integers that index as int64"):
        ragged.row_ids_to_row_splits(torch.tensor([0, 1]).to(torch.uint16), 2)
    assert ragged.row_splits_to_row_ids(np.array([0, 1, 3], dtype=np.uint32)).tolist() == [0, 1, 1]
    assert ragged.row_splits_to_row_ids(torch.tensor([0, 1, 3], dtype=torch.uint8)).tolist() == [0, 1, 1]
    with pytest.raises(TypeError, match="dtype must be a numpy integer dtype for numpy arrays"):
        ragged.row_splits_to_row_ids(np.array([0, 1, 3]), dtype=torch.int32)
    with pytest.raises(TypeError, match="dtype must be a numpy integer dtype for numpy arrays"):
        RaggedShape(np.array([0, 1, 3]), row_ids_dtype=torch.int32).row_ids


def test_large_fast():
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 200, 20000)
    rs = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)]))
    ids = ragged.row_splits_to_row_ids(rs, int(rs[-1]), dtype=torch.int32)
    assert torch.equal(ragged.row_ids_to_row_splits(ids, 20000, dtype=torch.int64), rs)
    # searchsorted cross-check (upper_bound - 1, the CUDA kernel's formula)
    ref = torch.searchsorted(rs, torch.arange(int(rs[-1])), right=True) - 1
    assert torch.equal(ids.long(), ref)


def test_method_is_checked_on_every_device():
    rs = np.array([0, 2, 2, 5])
    for method in (None, "binary_search", "merge_path"):  # CPU results do not depend on it
        np.testing.assert_array_equal(ragged.row_splits_to_row_ids(rs, method=method), [0, 0, 2, 2, 2])
    assert ragged.ROW_IDS_METHODS == ("binary_search", "merge_path")
    for bad in ("merge", "", 1):
        with pytest.raises(ValueError, match="method"):
            ragged.row_splits_to_row_ids(torch.from_numpy(rs), 5, method=bad)


# ---------------------------------------------------------------------------------------------------------
# On CUDA


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


@pytest.mark.cuda
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
                sizes[start : start + run] = 0
        for sdt in INDEX:
            _check_row_ids(_splits(sizes, sdt), method)


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@pytest.mark.cuda
@pytest.mark.parametrize("method", METHODS)
def test_row_ids_large(method):
    """The transducer's scale: 10^7 rows of logits (elements) in 10^4 utterances (rows)."""
    rng = np.random.default_rng(13)
    sizes = _sizes(rng, 10_000, 10_000_000, empty=0.05)
    for sdt in INDEX:
        _check_row_ids(_splits(sizes, sdt), method)


@pytest.mark.cuda
def test_row_ids_methods_agree_on_many_rows():
    """Many rows, few elements each (the merge's row starts outnumber its elements)."""
    rng = np.random.default_rng(17)
    sizes = _sizes(rng, 2_000_000, 1_000_000, empty=0.5)
    rs = _splits(sizes, torch.int64).to(DEV)
    ref = ragged.row_splits_to_row_ids(rs.cpu(), int(rs[-1]), dtype=torch.int32)
    for method in METHODS:
        got = _row_ids(rs, ref.numel(), torch.int32, method)
        assert torch.equal(got.cpu(), ref), method


@pytest.mark.cuda
def test_ragged_all_empty_and_shape_cuda():
    rs = torch.zeros(5, dtype=torch.int64, device=DEV)
    assert ragged.row_splits_to_row_ids(rs, 0).numel() == 0
    assert ragged.row_ids_to_row_splits(torch.zeros(0, dtype=torch.int32, device=DEV), 4).cpu().tolist() == [0] * 5
    s = ragged.RaggedShape.from_sizes(torch.tensor([2, 0, 3], device=DEV), num_elems=5, row_ids_dtype=torch.int32)
    assert s.dim0 == 3 and s.numel == 5
    assert s.row_ids.device.type == "cuda" and s.row_ids.cpu().tolist() == [0, 0, 2, 2, 2]
