"""ragged: k2-style ragged shapes, row_splits <-> row_ids (numpy/torch on CPU, CuPy kernels on GPU)."""

from .shape import RaggedShape, row_ids_to_row_splits, row_splits_to_row_ids

__all__ = ["RaggedShape", "row_ids_to_row_splits", "row_splits_to_row_ids"]
