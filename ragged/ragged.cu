// row_splits <-> row_ids on the GPU (launched by ragged/ragged_cuda.py).
//
// row_splits_to_row_ids: a load-balancing search (moderngpu's
// load_balance_search, seed 004) done as one thread per element i, binary
// searching row_splits for upper_bound(i) - 1, i.e. the last r with
// row_splits[r] <= i. Empty rows (row_splits[r] == row_splits[r+1]) are skipped
// naturally. Cost O(num_elems * log num_rows), all reads of row_splits hit L1/L2
// (row_splits is tiny next to row_ids). A merge-path partition per block
// (each block binary-searches its first element once, then walks rows and
// elements together through shared memory) saves the log factor; it is not
// implemented yet -- measure the binary search on the H100 first.
//
// row_ids_to_row_splits: one thread per row boundary r in [0, num_rows]:
// row_splits[r] = lower_bound(row_ids, r) = number of elements whose row id is
// < r (row_ids nondecreasing). Handles empty rows and num_elems == 0 alike.
//
// Suffixes: <splits/ids input type>_<output type>, i32 = int, i64 = long long.

template <typename S, typename O>
__device__ __forceinline__ void splits_to_ids(const S* __restrict__ row_splits, long long num_rows,
                                              O* __restrict__ row_ids, long long num_elems) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < num_elems; i += stride) {
    // largest r in [0, num_rows) with row_splits[r] <= i
    long long lo = 0, hi = num_rows;  // invariant: row_splits[lo] <= i, answer in [lo, hi)
    while (hi - lo > 1) {
      long long mid = (lo + hi) >> 1;
      if ((long long)row_splits[mid] <= i) lo = mid; else hi = mid;
    }
    row_ids[i] = (O)lo;
  }
}

template <typename S, typename O>
__device__ __forceinline__ void ids_to_splits(const S* __restrict__ row_ids, long long num_elems,
                                              O* __restrict__ row_splits, long long num_rows) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r <= num_rows; r += stride) {
    // first i with row_ids[i] >= r
    long long lo = 0, hi = num_elems;
    while (lo < hi) {
      long long mid = (lo + hi) >> 1;
      if ((long long)row_ids[mid] < r) lo = mid + 1; else hi = mid;
    }
    row_splits[r] = (O)lo;
  }
}

#define DEFINE_RAGGED(SUF, S, O)                                                                   \
  extern "C" __global__ void row_splits_to_row_ids_##SUF(const S* row_splits, long long num_rows, \
                                                         O* row_ids, long long num_elems) {       \
    splits_to_ids<S, O>(row_splits, num_rows, row_ids, num_elems);                                 \
  }                                                                                                \
  extern "C" __global__ void row_ids_to_row_splits_##SUF(const S* row_ids, long long num_elems,   \
                                                         O* row_splits, long long num_rows) {     \
    ids_to_splits<S, O>(row_ids, num_elems, row_splits, num_rows);                                 \
  }

DEFINE_RAGGED(i32_i32, int, int)
DEFINE_RAGGED(i32_i64, int, long long)
DEFINE_RAGGED(i64_i32, long long, int)
DEFINE_RAGGED(i64_i64, long long, long long)
