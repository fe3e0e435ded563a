"""Argument checks shared by the losses, pack and the other entry points: each error names the argument
and says what was expected. Conventions (dtypes) come from ``ops``."""

import collections.abc
import math
import numbers
import operator

import numpy as np
import torch

from ops import FLOAT_DTYPES, INDEX_DTYPES

from .layout import CELLS_CAP, MAX_DURATION, MAX_ROWS, Stats

__all__ = [
    "check_tensor",
    "check_batch",
    "is_index",
    "check_blank",
    "check_loss_values",
    "bad_labels_error",
    "check_blank_type",
    "duration_scores_note",
    "plural",
    "check_pack_values",
    "check_durations",
    "check_big_blank_durations",
    "check_rows",
    "row_count",
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "REDUCTIONS",
]

REDUCTIONS = ("none", "sum", "mean")


def plural(n, word, words=None):
    """``n word``, or for n != 1 ``n words`` (default: the word and an s)."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def check_tensor(name, x, dtypes, ndim, device, of="logits"):
    """A tensor of one of ``dtypes``, with a number of dimensions in ``ndim``, on ``device`` (if given: the device
    of the argument ``of``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if x.dim() not in ndim:
        dims = plural(ndim[0], "dimension") if len(ndim) == 1 else f"{' or '.join(map(str, ndim))} dimensions"
        raise ValueError(f"{name}: expected {dims}, got shape {tuple(x.shape)}")
    if device is not None and x.device != device:
        owner = f"{of}'" if of.endswith("s") else f"{of}'s"
        raise ValueError(f"{name}: expected a tensor on {device} ({owner} device), got {x.device}")


def check_batch(logits, targets, logit_lengths, target_lengths):
    """A loss's targets and lengths: index tensors on the logits' device, one row / entry per utterance; and the
    logits' rows (check_rows). The batch size is the one most of padded logits, logit_lengths, target_lengths and
    targets agree on (on a tie, the first in that order), so that an error names the argument that differs from
    the others."""
    device = logits.device
    check_tensor("targets", targets, INDEX_DTYPES, (2,), device)
    check_tensor("logit_lengths", logit_lengths, INDEX_DTYPES, (1,), device)
    check_tensor("target_lengths", target_lengths, INDEX_DTYPES, (1,), device)
    if not torch.compiler.is_compiling():  # from the shape, before the caller copies an expanded view
        check_rows(logits)
    given = {"logits": logits} if logits.dim() == 4 else {}  # compact logits do not give the batch size
    given.update(logit_lengths=logit_lengths, target_lengths=target_lengths, targets=targets)
    sizes = [x.size(0) for x in given.values()]
    counts = [sum(1 for other in sizes if other == size) for size in sizes]  # comparisons torch.compile traces
    B = sizes[counts.index(max(counts))]  # the most common size; on a tie, the first
    agree = [name for name, x in given.items() if x.size(0) == B]
    if B == 0:
        raise ValueError(f"{agree[0]}: expected at least one utterance, got an empty batch")
    expected = {
        "logits": f"padded logits of {plural(B, 'utterance')}",
        "targets": f"{plural(B, 'row')}, one per utterance",
    }
    for name, x in given.items():
        if x.size(0) != B:
            names = " and ".join([", ".join(agree[:-1]), agree[-1]] if len(agree) > 1 else agree)
            raise ValueError(
                f"{name}: expected {expected.get(name, f'shape ({B},), one entry per utterance')} (the "
                f"batch size of {names}), got shape {tuple(x.shape)}"
            )


def is_index(x):
    """An integer usable as an index (int, numpy integer, 0-d integer tensor), not a bool."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def is_number(x):
    """A real number (int, float, numpy integer or floating scalar), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_flag(x):
    """A bool (Python's or numpy's), or an integer index equal to 0 or 1."""
    return isinstance(x, (bool, np.bool_)) or (is_index(x) and operator.index(x) in (0, 1))


def check_blank(blank, num_columns, columns="the vocabulary size is logits.size(-1)"):
    """The blank's column in [0, num_columns): ``blank`` in [-num_columns, num_columns), negative values
    counting from the end (torchaudio's convention: -1 is the last column); TypeError for a non-int."""
    check_blank_type(blank)
    if not -num_columns <= operator.index(blank) < num_columns:
        raise ValueError(
            f"blank: expected an int in [{-num_columns}, {num_columns}) ({columns}; negative values "
            f"count from the end), got {blank!r}"
        )
    return operator.index(blank) % num_columns


def check_blank_type(blank):
    """``blank`` as an int (negative: from the end), before the vocabulary is known; TypeError for another type."""
    if not is_index(blank):
        raise TypeError(
            f"blank: expected an int (negative values count from the end), got {type(blank).__name__} {blank!r}"
        )
    return operator.index(blank)


def duration_scores_note(D, total, whose, unit):
    """What may explain bad labels where the last D of ``total`` score columns (or weight rows) were taken as
    TDT's duration scores: "; the last D of whose total unit are the D durations' scores, leaving ..."."""
    return f"; the last {D} of {whose} {total} {unit} are the {D} durations' scores, leaving {total - D} token {unit}"


def bad_labels_error(targets, stats, vocab_size, blank, big_blanks, extra=""):
    """The ValueError for the bad labels a Layout's stats count: how many, and the first, by utterance and
    position, with its value (read from ``targets``: a transfer on this error path alone); ``extra``: what may
    explain them."""
    stats = Stats(*stats)
    b, u = divmod(stats.first_bad_label, targets.size(1))
    blanks = f"a blank ({blank - big_blanks} ... {blank})" if big_blanks else f"blank = {blank}"
    count = (
        "1 entry within target_lengths is"
        if stats.bad_labels == 1
        else f"{stats.bad_labels} entries within target_lengths are"
    )
    return ValueError(
        f"targets: {count} outside [0, {vocab_size}) or equal to {blanks}; the first is targets[{b}, "
        f"{u}] = {int(targets[b, u])} (utterance {b}){extra}"
    )


def check_loss_values(logits, targets, stats, blank, vocab_size=None, big_blanks=0):
    """Lengths and target range against the tensors, from a Layout's stats (a list); labels in
    [0, vocab_size) (default: logits.size(-1)) and not a blank, [blank - big_blanks, blank]."""
    V, S = logits.size(-1) if vocab_size is None else vocab_size, targets.size(1)
    t_min, t_max, u_min, u_max, cells, bad, _ = Stats(*stats)
    if t_min < 1:
        raise ValueError(f"logit_lengths: every T_b must be >= 1, got min {t_min}")
    if u_min < 0:
        raise ValueError(f"target_lengths: every U_b must be >= 0, got min {u_min}")
    if cells >= CELLS_CAP:
        raise ValueError(
            f"logit_lengths, target_lengths: sum_b T_b*(U_b+1) overflows (2^61 or more; T_b up to "
            f"{t_max}, U_b up to {u_max})"
        )
    if u_max > S:
        raise ValueError(f"target_lengths: U_b = {u_max} exceeds targets.size(1) = {S}")
    if logits.dim() == 4:
        if t_max > logits.size(1):
            raise ValueError(f"logit_lengths: T_b = {t_max} exceeds logits.size(1) = {logits.size(1)}")
        if u_max + 1 > logits.size(2):
            raise ValueError(f"target_lengths: U_b + 1 = {u_max + 1} exceeds logits.size(2) = {logits.size(2)}")
    elif cells != logits.size(0):
        raise ValueError(
            f"logits: compact logits must have sum_b T_b*(U_b+1) = {cells} rows, got shape {tuple(logits.shape)}"
        )
    if bad:
        # TDT's duration scores after the tokens
        extra = (
            duration_scores_note(logits.size(-1) - V, logits.size(-1), "the logits'", "columns")
            if V < logits.size(-1)
            else ""
        )
        raise bad_labels_error(targets, stats, V, blank, big_blanks, extra)


def check_pack_values(encoder_out, predictor_out, stats):
    """pack's lengths against its inputs, from a Layout's stats (a list); returns the number of rows."""
    max_t, max_u1 = encoder_out.size(1), predictor_out.size(1)
    t_min, t_max, u_min, u_max, num_rows, _, _ = Stats(*stats)
    if t_min < 1 or t_max > max_t:
        raise ValueError(
            f"logit_lengths: expected values in [1, {max_t}] (encoder_out.size(1)), got [{t_min}, {t_max}]"
        )
    if u_min < 0 or u_max + 1 > max_u1:
        raise ValueError(
            f"target_lengths: expected values in [0, {max_u1 - 1}] (predictor_out.size(1) - 1), got [{u_min}, {u_max}]"
        )
    if num_rows > MAX_ROWS:
        raise ValueError(
            f"logit_lengths, target_lengths: sum_b T_b*(U_b+1) = {row_count(num_rows)} rows; at most "
            f"2^31 - 1 are supported"
        )
    return num_rows


def row_count(cells):
    """A Layout's cell count as an error states it: the saturated count (CELLS_CAP) as what it stands for."""
    return "2^61 or more (it overflows)" if cells >= CELLS_CAP else cells


def _duration_ints(durations, name):
    """A sequence of durations as a tuple of Python ints (ints, numpy integers, 0-d integer tensors; no bools or
    floats), each at most MAX_DURATION; ValueError naming ``name`` otherwise, and for a set or a mapping, whose
    order is not the one the caller wrote (the durations' order is their columns')."""
    if isinstance(durations, (collections.abc.Set, collections.abc.Mapping)):
        raise ValueError(
            f"{name}: expected a sequence of ints in their columns' order (a list or tuple), got a "
            f"{type(durations).__name__} {durations!r}"
        )
    try:
        given = list(durations)
    except TypeError:
        raise ValueError(f"{name}: expected a sequence of ints, got {durations!r}") from None
    if not all(is_index(d) for d in given):
        raise ValueError(f"{name}: expected a sequence of ints, got {given!r}")
    ds = tuple(operator.index(d) for d in given)
    if ds and max(ds) > MAX_DURATION:
        raise ValueError(f"{name}: expected durations of at most {MAX_DURATION} frames, got {max(ds)}")
    return ds


def check_durations(durations, num_durations=None, name="durations"):
    """The durations as a tuple of Python ints; ValueError (naming ``name``) unless they are distinct ints in
    [0, MAX_DURATION], at least one >= 1 (and ``num_durations`` of them, when given)."""
    ds = _duration_ints(durations, name)
    if not ds or min(ds) < 0 or max(ds) < 1 or len(set(ds)) != len(ds):
        raise ValueError(
            f"{name}: expected distinct ints >= 0 with at least one >= 1 (a blank must advance time), got {list(ds)}"
        )
    if num_durations is not None and len(ds) != num_durations:
        raise ValueError(f"{name}: {len(ds)} durations for {num_durations} duration columns")
    return ds


def check_big_blank_durations(big_blank_durations, blank):
    """The big blanks' durations as a tuple of ints: at least one, distinct, each in [2, MAX_DURATION] (1 is the
    standard blank's), all fitting before ``blank`` (big blank i sits in column blank - 1 - i; None: not known
    yet)."""
    name = "big_blank_durations"
    ds = _duration_ints(big_blank_durations, name)
    if not ds:
        raise ValueError(f"{name}: expected at least one big blank (without big blanks the loss is transducer_loss)")
    if min(ds) < 2 or len(set(ds)) != len(ds):
        raise ValueError(f"{name}: expected distinct ints >= 2 (the standard blank has duration 1), got {list(ds)}")
    if blank is not None and blank - len(ds) < 0:
        raise ValueError(
            f"{name}: {len(ds)} big blanks sit in the columns blank - 1 ... blank - {len(ds)}, which "
            f"do not fit before the blank's column {blank}"
        )
    return ds


def check_rows(logits):
    """At most MAX_ROWS rows (cells, padding included) in compact or padded logits: rows are int32 in the
    kernels."""
    rows = math.prod(logits.shape[:-1])
    if rows > MAX_ROWS:
        raise ValueError(
            f"logits: at most 2^31 - 1 rows (cells, padding included) are supported, got shape "
            f"{tuple(logits.shape)} with {rows} rows"
        )
