"""Where cell (b, t, u) of each utterance's (T_b, U_b + 1) grid lives in the logits, and the named structures
the stages pass around (the stages themselves: transducer/backend.py).

Both logits layouts are seen as a 2-D tensor ``logits2d`` of shape (N, V):

- compact ``(sum_b T_b*(U_b+1), V)``: N = sum_b T_b*(U_b+1), every row is a cell;
- padded ``(B, maxT, maxU+1, V)`` viewed as ``(B*maxT*(maxU+1), V)``: rows with t >= T_b or u > U_b are
  padding.

In both, cell (b, t, u) is row ``row_splits[b] + t * row_strides[b] + u`` (compact: row_splits = exclusive
cumsum of T_b*(U_b+1), strides = U_b + 1; padded: row_splits[b] = b*maxT*(maxU+1), strides = maxU + 1), and
the rows of utterance b are ``row_splits[b] <= r < row_splits[b+1]`` (k2's row_splits convention,
ragged/shape.py). Kernels find b by a binary search (compact) or one division by maxT*(maxU+1) (padded;
common.cuh's PaddedGrid), so no per-row index array exists. One set of stages serves both layouts, and the
per-row arrays (log-probs, den, alpha, beta) are indexed like the rows of ``logits2d``; on padding rows they
hold unspecified values that no stage reads.

The structures: ``Layout`` (the batch's grids, one int64 table), ``LossOptions`` (what a loss computes besides
its tensors), ``Walks`` (alpha, beta and the loss of one walk) and ``Lattice`` (what forward keeps for
backward). Every stage takes them whole and reads the fields it needs, so an option is one new field, not
a new argument of every stage. Per-row float arrays are float32, or float64 for float64 logits.
"""

from typing import NamedTuple, Optional, Tuple

import torch

#: Entries of Layout.stats (stages.cu: enum Stat).
NUM_STATS = 7
#: The cell count in ``Layout.stats`` saturates here: lengths whose products or sum overflow 64 bits
#: read as this value instead of wrapping into a plausible count (stages.cu: kCellsCap).
CELLS_CAP = 1 << 61
#: Kernels index rows in 32 bits: the (N, V) logits may have at most this many rows.
MAX_ROWS = (1 << 31) - 1
#: Durations a TDT loss may have on CUDA (common.cuh: kMaxDurations; struct Durations holds them by value).
MAX_DURATIONS = 16


def table_size(batch_size):
    """Entries of a Layout table for ``batch_size`` utterances."""
    return 4 * batch_size + 1 + NUM_STATS


class Stats(NamedTuple):
    """What the value checks need, computed with the layout (``Layout.stats``, read back as a list)."""
    min_t: int
    max_t: int
    min_u: int
    max_u: int
    cells: int       # sum_b T_b*(U_b+1), saturating at CELLS_CAP
    bad_labels: int  # targets[b, u] with u < U_b outside [0, V) or a blank (0 without label checks)
    first_bad_label: int  # the first of them, b * targets.size(1) + u (the int64 maximum when none)


class Layout(NamedTuple):
    """The grids of one batch, all in one int64 tensor so that it is built by one launch:

    ``table = [T_b (B) | U_b (B) | row_strides (B) | row_splits (B + 1) | stats (NUM_STATS)]``, ``stats`` in
    the order of ``Stats`` (zeros on CUDA without ``with_stats``).
    """

    table: torch.Tensor  # int64 (table_size(B),)
    padded: bool         # True when some rows may be padding
    max_u1: int          # host-side bound on U_b + 1 (padded: logits.size(2); compact: targets.size(1) + 1)
    padded_t: int = 0    # padded: logits.size(1) when known (the CUDA row kernels then divide instead of search)

    @property
    def batch_size(self):
        return (self.table.numel() - 1 - NUM_STATS) // 4

    @property
    def logit_lengths(self):
        return self.table[:self.batch_size]

    @property
    def target_lengths(self):
        B = self.batch_size
        return self.table[B:2 * B]

    @property
    def row_strides(self):
        B = self.batch_size
        return self.table[2 * B:3 * B]

    @property
    def row_splits(self):
        B = self.batch_size
        return self.table[3 * B:4 * B + 1]

    @property
    def cell_offsets(self):
        B = self.batch_size
        return self.table[3 * B:4 * B]

    @property
    def stats(self):
        """The stats entries of the table (a tensor; ``Stats(*layout.stats.tolist())`` names them)."""
        return self.table[-NUM_STATS:]


class LossOptions(NamedTuple):
    """What a loss computes besides its tensors (the public functions check them; transducer/checks.py).

    A registered op takes them flat (torch.library's types): ``flat()`` gives (ints, floats) in field order,
    ``from_flat`` the options back; a new field needs nothing more here than its line."""
    blank: int = 0                   # the blank's column, in [0, V) (TDT: among the token columns)
    one_sym_per_frame: bool = False  # RNA: a label consumes a frame too, (t, u) -> (t+1, u+1)
    from_log_softmax: bool = False   # the logits are already log-probabilities
    clamp: float = 0.0               # > 0: each gradient element, for a unit incoming gradient, in [-clamp, clamp]
    fastemit_lambda: float = 0.0     # FastEmit: the label log-probs' gradient times 1 + fastemit_lambda
    delay_penalty: float = 0.0       # k2's delay penalty on the label log-probs
    durations: Tuple[int, ...] = ()  # TDT: the durations (empty: RNN-T or RNA)
    sigma: float = 0.0               # TDT, multi-blank: logit under-normalisation, subtracted from the log-probs
    omega: float = 0.0               # TDT: weight of the plain RNN-T loss of the token scores
    big_blank_durations: Tuple[int, ...] = ()  # multi-blank: big blank i, in column blank - 1 - i, spans d_i frames

    def flat(self):
        """(ints, floats): bools and ints as ints, a tuple as its length then its ints, floats as floats."""
        ints, floats = [], []
        for name, kind in _OPTION_KINDS:
            value = getattr(self, name)
            if kind == "float":
                floats.append(float(value))
            elif kind == "tuple":
                ints += [len(value), *map(int, value)]
            else:
                ints.append(int(value))
        return ints, floats

    @classmethod
    def from_flat(cls, ints, floats):
        """The options that ``flat()`` gave (ints, floats); each distinct one is built once (an op's forward
        and backward rebuild them every call)."""
        key = (tuple(ints), tuple(floats))
        options = _FROM_FLAT.get(key)
        if options is None:
            if len(_FROM_FLAT) >= _FROM_FLAT_SIZE:  # options that change every step (a schedule) stay bounded
                _FROM_FLAT.clear()
            options = _FROM_FLAT.setdefault(key, cls._build(ints, floats))
        return options

    @classmethod
    def _build(cls, ints, floats):
        ints, floats, values = list(ints), list(floats), {}
        for name, kind in _OPTION_KINDS:
            if kind == "float":
                values[name] = floats.pop(0)
            elif kind == "tuple":
                n = ints.pop(0)
                values[name], ints = tuple(ints[:n]), ints[n:]
            else:
                values[name] = bool(ints.pop(0)) if kind == "bool" else ints.pop(0)
        return cls(**values)


_FROM_FLAT = {}  # (ints, floats) -> LossOptions: a training run meets a handful
_FROM_FLAT_SIZE = 256

# LossOptions' fields and their kinds as plain strings, which torch.compile traces (it does not trace
# typing's Tuple[int, ...])
_OPTION_KINDS = tuple((name, {float: "float", int: "int", bool: "bool"}.get(kind, "tuple"))
                      for name, kind in LossOptions.__annotations__.items())


class Walks(NamedTuple):
    """alpha and beta over the rows (N,), and the per-utterance negative log-likelihood nll (B,)."""
    alpha: torch.Tensor
    beta: torch.Tensor
    nll: torch.Tensor


class Lattice(NamedTuple):
    """What forward keeps for backward: the per-row log-probs and the walks over them."""
    layout: Layout
    lp: torch.Tensor                        # (N, 2): blank and label log-probs (TDT: token log-probs, sigma in)
    den: torch.Tensor                       # (N,) logsumexp of each row's (token) scores
    alpha: torch.Tensor                     # (N,)
    beta: torch.Tensor                      # (N,)
    nll: torch.Tensor                       # (B,)
    lp_arcs: Optional[torch.Tensor] = None  # the log-probs of the arcs of several frames: TDT's (N, D) duration
    #                                         log-probs, multi-blank's (N, K) big blanks' log-probs
    den_arcs: Optional[torch.Tensor] = None  # TDT: (N,) logsumexp of each row's duration scores
    rnnt: Optional[Walks] = None            # TDT with omega > 0: the walks of the plain RNN-T loss
