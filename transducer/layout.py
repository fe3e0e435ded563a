"""Where cell (b, t, u) of each utterance's (T_b, U_b + 1) grid lives in the logits: ``Layout`` (the stages that
take it: transducer/backend.py).

Both logits layouts are seen as a 2-D tensor ``logits2d`` of shape (N, V):

- compact ``(sum_b T_b*(U_b+1), V)``: N = sum_b T_b*(U_b+1), every row is a cell;
- padded ``(B, maxT, maxU+1, V)`` viewed as ``(B*maxT*(maxU+1), V)``: rows with t >= T_b or u > U_b are
  padding.

In both, cell (b, t, u) is row ``row_splits[b] + t * row_strides[b] + u`` (compact: row_splits = exclusive
cumsum of T_b*(U_b+1), strides = U_b + 1; padded: row_splits[b] = b*maxT*(maxU+1), strides = maxU + 1), and
the rows of utterance b are ``row_splits[b] <= r < row_splits[b+1]`` (k2's row_splits convention,
ragged/shape.py). Kernels find b by a binary search (compact) or one division by maxT*(maxU+1) (padded;
layout.cuh's PaddedGrid), so no per-row index array exists. One set of stages serves both layouts, and the
per-row arrays (log-probs, den, alpha, beta) are indexed like the rows of ``logits2d``; on padding rows they
hold unspecified values that no stage reads.

``Layout`` holds the batch's grids in one int64 table. The other structures the stages take whole:
``LossOptions`` (transducer/options.py), ``Walks`` and ``Lattice`` (transducer/lattices.py). Per-row float
arrays are float32, or float64 for float64 logits.
"""

from typing import NamedTuple

import torch

#: Entries of Layout.stats (stages.cu: enum Stat).
NUM_STATS = 7
#: The cell count in ``Layout.stats`` saturates here: lengths whose products or sum overflow 64 bits
#: read as this value instead of wrapping into a plausible count (stages.cu: kCellsCap).
CELLS_CAP = 1 << 61
#: Kernels index rows in 32 bits: the (N, V) logits may have at most this many rows.
MAX_ROWS = (1 << 31) - 1
#: Durations a TDT loss may have on CUDA (params.cuh: kMaxDurations; struct Durations holds them by value).
MAX_DURATIONS = 16
#: The longest duration (TDT's, a big blank's), in frames: the kernels add it to a frame index in 32 bits.
MAX_DURATION = (1 << 16) - 1


def table_size(batch_size):
    """Entries of a Layout table for ``batch_size`` utterances."""
    return 4 * batch_size + 1 + NUM_STATS


class Stats(NamedTuple):
    """What the value checks need, computed with the layout (``Layout.stats``, read back as a list)."""

    min_t: int
    max_t: int
    min_u: int
    max_u: int
    cells: int  # sum_b T_b*(U_b+1), saturating at CELLS_CAP
    bad_labels: int  # targets[b, u] with u < U_b outside [0, V) or a blank (0 without label checks)
    first_bad_label: int  # the first of them, b * targets.size(1) + u (the int64 maximum when none)


class LabelCheck(NamedTuple):
    """What the layout checks the labels against: ``targets`` (B, S) in ``[0, vocab_size)`` and none of the blanks,
    the columns ``[blank - big_blanks, blank]``."""

    targets: torch.Tensor
    vocab_size: int
    blank: int
    big_blanks: int = 0


class Layout(NamedTuple):
    """The grids of one batch, all in one int64 tensor so that it is built by one launch:

    ``table = [T_b (B) | U_b (B) | row_strides (B) | row_splits (B + 1) | stats (NUM_STATS)]``, ``stats`` in
    the order of ``Stats`` (zeros on CUDA without ``with_stats``).
    """

    table: torch.Tensor  # int64 (table_size(B),)
    padded: bool  # True when some rows may be padding
    max_u1: int  # host-side bound on U_b + 1 (padded: logits.size(2); compact: targets.size(1) + 1)
    padded_t: int = 0  # padded: logits.size(1) when known (the CUDA row kernels then divide instead of search)

    @property
    def batch_size(self):
        return (self.table.numel() - 1 - NUM_STATS) // 4

    @property
    def logit_lengths(self):
        return self.table[: self.batch_size]

    @property
    def target_lengths(self):
        B = self.batch_size
        return self.table[B : 2 * B]

    @property
    def row_strides(self):
        B = self.batch_size
        return self.table[2 * B : 3 * B]

    @property
    def row_splits(self):
        B = self.batch_size
        return self.table[3 * B : 4 * B + 1]

    @property
    def cell_offsets(self):
        B = self.batch_size
        return self.table[3 * B : 4 * B]

    @property
    def stats(self):
        """The stats entries of the table (a tensor; ``Stats(*layout.stats.tolist())`` names them)."""
        return self.table[-NUM_STATS:]
