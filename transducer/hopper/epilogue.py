"""The gradient epilogue's arithmetic for one entry of G, written once over a few math operations that the caller
chooses: the kernel (transducer/hopper/kernels.py) traces it with CuTe's, and the CPU tests evaluate it with
torch's against the float64 gradient of the CPU stages. Imports nothing: the DSL traces ordinary Python."""

from typing import Any, NamedTuple, Tuple


class RowTerms(NamedTuple):
    """A row's gradient coefficients (the rows of gradient_tile's ``coefficients``): den (the logsumexp of its
    logits), the softmax's factor (occupancy, FastEmit's label arc in), the blank's and the label's arcs, the
    incoming scale, and the arc subtracted on each extra column (multi-blank's big blanks)."""

    den: Any
    occupancy: Any
    blank_arc: Any
    label_arc: Any
    scale: Any
    extra_arcs: Tuple[Any, ...] = ()


class ColumnFlags(NamedTuple):
    """Which of a row's arcs an entry's column carries: the blank's, the label's, and each extra column's."""

    is_blank: Any
    is_label: Any
    is_extra: Tuple[Any, ...] = ()


def token_gradient(z, row: RowTerms, column: ColumnFlags, clamp, ops):
    """G's entry at the logit ``z`` (the bias in) of a row and column (arcs.cuh's TokenGradient, elementwise):

        scale * c(exp(z - den) * occupancy - [blank] blank_arc - [label] label_arc - sum_i [extra i] extra_arc_i)

    c clamping to ``[-clamp, clamp]``, none where ``clamp`` is None. ``ops`` gives ``exp_minus(a, b)`` (exp(a - b)),
    ``where(condition, a, b)``, ``maximum`` and ``minimum``."""
    g = ops.exp_minus(z, row.den) * row.occupancy
    g = ops.where(column.is_blank, g - row.blank_arc, g)
    g = ops.where(column.is_label, g - row.label_arc, g)
    for on, arc in zip(column.is_extra, row.extra_arcs):
        g = ops.where(on, g - arc, g)
    if clamp is not None:
        g = ops.minimum(ops.maximum(g, -clamp), clamp)
    return g * row.scale
