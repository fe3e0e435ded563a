"""ragged: k2-style ragged shapes (numpy/torch on CPU, CUDA kernels through ops.cuda on GPU).

- ``row_splits_to_row_ids(row_splits, num_elems=None, *, dtype=None, validate=True, method=None)``
  and ``row_ids_to_row_splits(row_ids, num_rows, *, dtype=None, validate=True)``: the two
  encodings of a ragged shape (k2's RowSplitsToRowIds / RowIdsToRowSplits);
- ``ROW_IDS_METHODS``: the CUDA kernels of row_splits_to_row_ids, "binary_search" and
  "merge_path" (moderngpu's load-balancing search);
- ``row_of(row_splits, elems)``: the row of some elements (torch), without every row_id;
- ``RaggedShape``: a two-axis ragged shape, row_ids computed lazily;
- the device header ``ragged/row_ids.cuh`` (``row_of``, ``merge_path``, ``load_balance_tile``),
  included by kernels with ``-I`` + ``ops.cuda_include_dir()``.
"""

from .shape import ROW_IDS_METHODS, RaggedShape, row_ids_to_row_splits, row_of, row_splits_to_row_ids

__all__ = ["RaggedShape", "row_ids_to_row_splits", "row_of", "row_splits_to_row_ids", "ROW_IDS_METHODS"]
