// The row of an element in a ragged shape (k2's convention, ragged/shape.py):
//
//     row_splits (num_rows + 1,): row_splits[0] = 0, nondecreasing, row_splits[num_rows] = num_elems
//     row_ids[i] = the r with row_splits[r] <= i < row_splits[r + 1]   (empty rows own no element)
//
// Two ways to find it, both used by ragged/ragged.cu's row_splits_to_row_ids (k2's RowSplitsToRowIds):
//
// - row_of: one element at a time, a binary search over row_splits (upper_bound - 1). No shared
//   memory, no partition pass: the transducer's kernels use it for the utterance of each row.
// - load_balance_tile: moderngpu's load-balancing search (Baxter, moderngpu 2.0,
//   src/moderngpu/kernel_load_balance.hxx): the element indices 0..num_elems-1 and the row starts
//   row_splits[1..num_rows-1] are merged as two sorted lists (a row start before an element of equal
//   value); a block owns a tile of kTile consecutive steps of that merge, finds where it starts by
//   one merge-path search (Green, McColl & Bader, "GPU merge path", ICS 2012), stages its row starts
//   in shared memory, and each thread then walks its kVT steps, noting the row of each element it
//   passes in shared memory; the block then stores the tile's row ids with consecutive threads on
//   consecutive elements (moderngpu likewise reads its per-thread results back strided). Work per
//   element is O(1) after the O(log) search per thread.
#pragma once

namespace ragged {

// The last r in [0, num_rows) with row_splits[r] <= i, for 0 <= i < row_splits[num_rows].
template <typename S>
__device__ __forceinline__ int row_of(const S* __restrict__ row_splits, int num_rows, long long i) {
  int lo = 0, hi = num_rows - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if ((long long)__ldg(row_splits + mid) <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Merge path of the element indices [a_begin, a_begin + na) with the sorted keys b[0, nb): the number
// of elements among the first `diag` steps of the merge, a key going first when equal to an element.
template <typename S>
__device__ __forceinline__ long long merge_path(const S* b, long long nb, long long a_begin, long long na,
                                                long long diag) {
  long long lo = diag > nb ? diag - nb : 0, hi = diag < na ? diag : na;
  while (lo < hi) {
    const long long mid = (lo + hi) >> 1;
    if (a_begin + mid < (long long)b[diag - 1 - mid])
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

constexpr int kThreads = 128;  // threads of a load-balancing block
constexpr int kVT = 8;         // merge steps per thread
constexpr int kTile = kThreads * kVT;

// The shared-memory slot of a tile's i-th row id: one slot of padding per 128 bytes, so that the
// threads of a warp, noting elements kVT apart, hit distinct banks.
template <typename O>
__device__ __forceinline__ int lbs_slot(int i) {
  return i + i / (128 / (int)sizeof(O));
}

// Block `tile` of the load-balancing search writes row_ids for the elements of its kTile merge steps.
// The merge has num_elems + num_rows - 1 steps (elements, and row starts 1..num_rows-1). `starts` is
// shared memory for kTile + 1 keys. Every thread of the block (kThreads of them) makes the call.
template <typename S, typename O>
__device__ __forceinline__ void load_balance_tile(const S* __restrict__ row_splits, long long num_rows,
                                                  O* __restrict__ row_ids, long long num_elems, long long tile,
                                                  long long* starts) {
  const S* b = row_splits + 1;  // row r + 1 starts at b[r]
  const long long nb = num_rows - 1, steps = num_elems + nb;
  const long long d0 = tile * kTile, d1 = d0 + kTile < steps ? d0 + kTile : steps;
  __shared__ long long bounds[2];
  __shared__ O ids[kTile + kTile / (128 / sizeof(O))];  // the tile's row ids, at lbs_slot(i)
  if (threadIdx.x < 2) bounds[threadIdx.x] = merge_path(b, nb, 0, num_elems, threadIdx.x ? d1 : d0);
  __syncthreads();
  const long long a0 = bounds[0], b0 = d0 - a0;  // elements and row starts before the tile
  const int na = (int)(bounds[1] - a0), n = (int)(d1 - d0), nbt = n - na;  // the tile's elements, steps, starts
  for (int k = threadIdx.x; k < nbt; k += blockDim.x) starts[k] = (long long)b[b0 + k];
  __syncthreads();
  // this thread's steps [diag, diag + kVT) of the tile: i elements and j row starts before them
  const int diag = (int)threadIdx.x * kVT < n ? (int)threadIdx.x * kVT : n;
  int i = (int)merge_path(starts, nbt, a0, na, diag);
  int j = diag - i;
#pragma unroll
  for (int step = 0; step < kVT; ++step) {
    if (i + j >= n) break;
    if (j < nbt && starts[j] <= a0 + i) {
      ++j;  // a new row begins
    } else {
      ids[lbs_slot<O>(i)] = (O)(b0 + j);  // rows 0..b0+j-1 have begun before element a0 + i
      ++i;
    }
  }
  __syncthreads();
  for (int k = threadIdx.x; k < na; k += blockDim.x) row_ids[a0 + k] = ids[lbs_slot<O>(k)];  // coalesced
}

}  // namespace ragged
