"""The oracle: a plain PyTorch transducer loss on padded logits, differentiated by autograd.

It loops over utterances and cells in Python and is meant for tests on small
shapes only. Every fast path of the library is checked against it.
"""

import math
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["transducer_loss_reference", "tdt_loss_reference", "multiblank_loss_reference", "tdt_loss_from_log_probs"]


def _logsumexp(terms):
    return torch.logsumexp(torch.stack(terms), dim=0)


def _label_log_probs(label_lp, fastemit_lambda, delay_penalty):
    """The label log-probs (T, U) of one utterance as every loss's recursion reads them: FastEmit (Yu et al.
    2021) keeps their value and scales their gradient by 1 + fastemit_lambda; k2's delay penalty adds
    delay_penalty * ((T - 1) / 2 - t) to the label log-prob of frame t."""
    if fastemit_lambda:
        label_lp = (1 + fastemit_lambda) * label_lp - fastemit_lambda * label_lp.detach()
    if delay_penalty:
        T = label_lp.size(0)
        frames = torch.arange(T, dtype=label_lp.dtype)[:, None]
        label_lp = label_lp + delay_penalty * ((T - 1) / 2 - frames)
    return label_lp


def transducer_loss_reference(
    logits: Tensor,
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    blank: int = 0,
    one_sym_per_frame: bool = False,
    from_log_softmax: bool = False,
    fastemit_lambda: float = 0.0,
    delay_penalty: float = 0.0,
) -> Tensor:
    """Negative log-likelihood per utterance, shape (B,), in logits' dtype.

    logits (B, maxT, maxU+1, V); targets (B, S); logit_lengths, target_lengths (B,).
    RNN-T: blank moves (t, u) -> (t+1, u), label y_u moves (t, u) -> (t, u+1).
    one_sym_per_frame (RNA): label y_u moves (t, u) -> (t+1, u+1).
    Both end with a blank from (T-1, U). delay_penalty (k2): the label log-prob of cell (t, u) gets
    delay_penalty * ((T - 1) / 2 - t) before the recursion. fastemit_lambda (FastEmit, Yu et al. 2021):
    the loss is unchanged, the gradient w.r.t. every label log-prob is scaled by 1 + fastemit_lambda. An
    utterance with no alignment gets +inf; one with a NaN or infinite logit among its cells gets NaN (with
    from_log_softmax, where -inf log-probs are legal, one with a NaN blank log-prob in a cell).
    """
    log_probs = logits if from_log_softmax else logits.log_softmax(dim=-1)
    losses = []
    for b in range(logits.size(0)):
        T, U = int(logit_lengths[b]), int(target_lengths[b])
        if from_log_softmax:  # -inf log-probs are legal; a NaN blank log-prob anywhere is not
            non_finite = bool(torch.isnan(log_probs[b, :T, : U + 1, blank]).any())
        else:
            non_finite = not torch.isfinite(logits[b, :T, : U + 1]).all()
        if one_sym_per_frame and U > T - 1:
            losses.append(log_probs.new_tensor(math.nan if non_finite else math.inf))
            continue
        y = targets[b, :U].long()
        blank_lp = log_probs[b, :T, : U + 1, blank]
        emit_lp = _label_log_probs(log_probs[b, :T, torch.arange(U), y], fastemit_lambda, delay_penalty)  # (T, U)
        alpha = {(0, 0): log_probs.new_zeros(())}
        for t in range(T):
            for u in range(U + 1):
                if (t, u) == (0, 0):
                    continue
                terms = []
                if (t - 1, u) in alpha:
                    terms.append(alpha[t - 1, u] + blank_lp[t - 1, u])
                if one_sym_per_frame:
                    if (t - 1, u - 1) in alpha:
                        terms.append(alpha[t - 1, u - 1] + emit_lp[t - 1, u - 1])
                elif (t, u - 1) in alpha:
                    terms.append(alpha[t, u - 1] + emit_lp[t, u - 1])
                if terms:
                    alpha[t, u] = _logsumexp(terms)
        loss = -(alpha[T - 1, U] + blank_lp[T - 1, U])
        if non_finite:
            loss = loss + math.nan
        losses.append(loss)
    return torch.stack(losses)


def tdt_loss_reference(
    logits: Tensor,
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    durations: Sequence[int],
    blank: int = 0,
    sigma: float = 0.0,
    omega: float = 0.0,
    fastemit_lambda: float = 0.0,
    delay_penalty: float = 0.0,
) -> Tensor:
    """The Token-and-Duration Transducer (TDT) loss (Xu et al. 2023, NeMo's semantics) per utterance, shape (B,),
    in logits' dtype.

    logits (B, maxT, maxU+1, V + D): V token scores (blank among them) then D duration scores per cell;
    durations: D distinct ints >= 0, at least one >= 1. With tok = log_softmax of the token columns - sigma
    and dur = log_softmax of the duration columns, from cell (t, u) a label y_{u+1} with duration d goes to
    (t + d, u + 1) if t + d < T (d may be 0); a blank with duration d >= 1 goes to (t + d, u) if t + d < T, or
    ends the alignment if u == U and t + d == T; the arc weighs tok + dur. The loss is
    (1 - omega) * tdt + omega * rnnt, rnnt being the plain RNN-T loss (transducer_loss_reference) of the token
    columns (no sigma). fastemit_lambda and delay_penalty: on every label token log-prob, in both terms, as
    transducer_loss_reference applies them. An utterance with no TDT alignment gets +inf
    (a constant: no gradient, whatever omega); one with a NaN or infinite logit among its cells gets NaN.
    """
    durations = [int(d) for d in durations]
    V = logits.size(-1) - len(durations)
    tok = logits[..., :V].log_softmax(dim=-1) - sigma
    dur = logits[..., V:].log_softmax(dim=-1)
    tdt = tdt_loss_from_log_probs(
        tok, dur, targets, logit_lengths, target_lengths, durations, blank, fastemit_lambda, delay_penalty
    )
    rnnt = None
    if omega:
        rnnt = transducer_loss_reference(
            logits[..., :V],
            targets,
            logit_lengths,
            target_lengths,
            blank,
            fastemit_lambda=fastemit_lambda,
            delay_penalty=delay_penalty,
        )
    losses = []
    for b in range(logits.size(0)):
        T, U = int(logit_lengths[b]), int(target_lengths[b])
        loss = tdt[b]
        if omega and math.isfinite(float(loss.detach())):
            loss = (1 - omega) * loss + omega * rnnt[b]
        if not torch.isfinite(logits[b, :T, : U + 1]).all():
            loss = loss + math.nan
        losses.append(loss)
    return torch.stack(losses)


def tdt_loss_from_log_probs(
    tok: Tensor,
    dur: Tensor,
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    durations: Sequence[int],
    blank: int = 0,
    fastemit_lambda: float = 0.0,
    delay_penalty: float = 0.0,
) -> Tensor:
    """-log of the summed weight of every TDT alignment, per utterance, from the token log-probs tok
    (B, maxT, maxU+1, V) (sigma already subtracted) and the duration log-probs dur (B, maxT, maxU+1, D).
    +inf (a constant) where no alignment exists. No check of finiteness."""
    losses = []
    for b in range(tok.size(0)):
        T, U = int(logit_lengths[b]), int(target_lengths[b])
        y = targets[b, :U].long()
        blank_lp = tok[b, :T, : U + 1, blank]  # (T, U+1)
        label_lp = _label_log_probs(tok[b, :T, torch.arange(U), y], fastemit_lambda, delay_penalty)  # y_{u+1}, (t, u)
        dur_lp = dur[b, :T, : U + 1]  # (T, U+1, D)
        alpha = {(0, 0): tok.new_zeros(())} if T > 0 else {}
        for t in range(T):
            for u in range(U + 1):
                if (t, u) == (0, 0):
                    continue
                terms = []
                for i, d in enumerate(durations):
                    if d >= 1 and (t - d, u) in alpha:  # a blank of duration d from (t - d, u)
                        terms.append(alpha[t - d, u] + blank_lp[t - d, u] + dur_lp[t - d, u, i])
                    if u >= 1 and (t - d, u - 1) in alpha:  # label y_u of duration d from (t - d, u - 1)
                        terms.append(alpha[t - d, u - 1] + label_lp[t - d, u - 1] + dur_lp[t - d, u - 1, i])
                if terms:
                    alpha[t, u] = _logsumexp(terms)
        final = [
            alpha[T - d, U] + blank_lp[T - d, U] + dur_lp[T - d, U, i]
            for i, d in enumerate(durations)
            if d >= 1 and (T - d, U) in alpha
        ]
        losses.append(-_logsumexp(final) if final else tok.new_tensor(math.inf))
    return torch.stack(losses)


def multiblank_loss_reference(
    logits: Tensor,
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    big_blank_durations: Sequence[int],
    blank: int,
    sigma: float = 0.0,
    fastemit_lambda: float = 0.0,
    delay_penalty: float = 0.0,
) -> Tensor:
    """The multi-blank RNN-T loss (Xu et al. 2023, NeMo's semantics) per utterance, shape (B,), in logits' dtype.

    logits (B, maxT, maxU+1, V); every log-prob is log_softmax(logits) - sigma. From cell (t, u) the label y_{u+1}
    goes to (t, u + 1), the blank (column ``blank``, in [0, V)) to (t + 1, u), big blank i (column blank - 1 - i,
    duration big_blank_durations[i] >= 2) to (t + d_i, u); an alignment ends on reaching t = T with u = U through
    any blank. fastemit_lambda and delay_penalty: on every label log-prob, as transducer_loss_reference applies
    them. An utterance with a NaN or infinite logit among its cells gets NaN.
    """
    durations = [1] + [int(d) for d in big_blank_durations]
    columns = [blank] + [blank - 1 - i for i in range(len(big_blank_durations))]
    lp = logits.log_softmax(dim=-1) - sigma
    losses = []
    for b in range(logits.size(0)):
        T, U = int(logit_lengths[b]), int(target_lengths[b])
        y = targets[b, :U].long()
        blanks = lp[b, :T, : U + 1][..., columns]  # (T, U+1, 1 + K): the blank arcs' log-probs
        label_lp = _label_log_probs(lp[b, :T, torch.arange(U), y], fastemit_lambda, delay_penalty)  # y_{u+1}, (t, u)
        alpha = {(0, 0): lp.new_zeros(())}
        for t in range(T):
            for u in range(U + 1):
                if (t, u) == (0, 0):
                    continue
                terms = [alpha[t - d, u] + blanks[t - d, u, i] for i, d in enumerate(durations) if (t - d, u) in alpha]
                if u >= 1 and (t, u - 1) in alpha:
                    terms.append(alpha[t, u - 1] + label_lp[t, u - 1])
                if terms:
                    alpha[t, u] = _logsumexp(terms)
        final = [alpha[T - d, U] + blanks[T - d, U, i] for i, d in enumerate(durations) if (T - d, U) in alpha]
        loss = -_logsumexp(final) if final else lp.new_tensor(math.inf)
        if not torch.isfinite(logits[b, :T, : U + 1]).all():
            loss = loss + math.nan
        losses.append(loss)
    return torch.stack(losses)
