// row_splits <-> row_ids on the GPU; launched by ragged/ragged_cuda.py by name expression, e.g.
// "row_splits_to_row_ids_merge_path<int, long long>" (input index type, output index type).
//
// row_splits_to_row_ids (k2's RowSplitsToRowIds, k2/csrc/utils.cu, which calls moderngpu's
// load_balance_search), two ways, both over ragged/row_ids.cuh:
//
//   row_splits_to_row_ids_binary_search  one thread per element i (grid-stride): ragged::row_of, a
//       binary search of row_splits for the last r with row_splits[r] <= i. O(log num_rows) reads
//       per element, all of the small row_splits (cached); no shared memory. num_rows < 2^31.
//   row_splits_to_row_ids_merge_path     one block of ragged::kThreads per tile of ragged::kTile
//       merge steps: ragged::load_balance_tile, moderngpu's load-balancing search
//       (src/moderngpu/kernel_load_balance.hxx): the block finds its slice of rows by one merge-path
//       search, stages their starts in shared memory, and each thread merges kVT steps. O(1) work
//       per element after the searches.
//
// Empty rows (row_splits[r] == row_splits[r + 1]) own no element, in both.
//
// row_ids_to_row_splits: one thread per row boundary r in [0, num_rows] (grid-stride):
// row_splits[r] = lower_bound(row_ids, r), the number of elements whose row id is < r (row_ids
// nondecreasing); empty rows and num_elems == 0 need no special case.
#include "ragged/row_ids.cuh"

// The kernels' parameters (ragged/ragged_cuda.py mirrors them): the input and output arrays and their sizes.
template <typename S, typename O>
struct RowIdsParams {
  const S* row_splits;
  long long num_rows;
  O* row_ids;
  long long num_elems;
};

template <typename S, typename O>
struct RowSplitsParams {
  const S* row_ids;
  long long num_elems;
  O* row_splits;
  long long num_rows;
};

// num_rows < 2^31 (row_of indexes rows by int)
template <typename S, typename O>
__global__ void row_splits_to_row_ids_binary_search(const RowIdsParams<S, O> p) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < p.num_elems; i += stride)
    p.row_ids[i] = (O)ragged::row_of(p.row_splits, (int)p.num_rows, i);
}

// Grid: one block per tile, ceil((num_elems + num_rows - 1) / kTile) blocks of kThreads threads.
template <typename S, typename O>
__global__ void __launch_bounds__(ragged::kThreads) row_splits_to_row_ids_merge_path(const RowIdsParams<S, O> p) {
  __shared__ long long starts[ragged::kTile + 1];
  ragged::load_balance_tile(p.row_splits, p.num_rows, p.row_ids, p.num_elems, (long long)blockIdx.x, starts);
}

template <typename S, typename O>
__global__ void row_ids_to_row_splits(const RowSplitsParams<S, O> p) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r <= p.num_rows; r += stride) {
    long long lo = 0, hi = p.num_elems;  // the first i with row_ids[i] >= r
    while (lo < hi) {
      const long long mid = (lo + hi) >> 1;
      if ((long long)p.row_ids[mid] < r)
        lo = mid + 1;
      else
        hi = mid;
    }
    p.row_splits[r] = (O)lo;
  }
}
