"""CPU tests for ragged: row_splits <-> row_ids and RaggedShape."""

import numpy as np
import pytest
import torch

import ragged
from ragged import RaggedShape


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
