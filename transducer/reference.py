"""The oracle: a plain PyTorch transducer loss on padded logits, differentiated by autograd.

It loops over utterances and cells in Python and is meant for tests on small
shapes only. Every fast path of the library is checked against it.
"""

import math

import torch


def _logsumexp(terms):
    return torch.logsumexp(torch.stack(terms), dim=0)


def transducer_loss_reference(logits, targets, logit_lengths, target_lengths, blank=0,
                              one_sym_per_frame=False, from_log_softmax=False, fastemit_lambda=0.0,
                              delay_penalty=0.0):
    """Negative log-likelihood per utterance, shape (B,), in logits' dtype.

    logits (B, maxT, maxU+1, V); targets (B, S); logit_lengths, target_lengths (B,).
    RNN-T: blank moves (t, u) -> (t+1, u), label y_u moves (t, u) -> (t, u+1).
    one_sym_per_frame (RNA): label y_u moves (t, u) -> (t+1, u+1).
    Both end with a blank from (T-1, U). delay_penalty (k2): the label log-prob of cell (t, u) gets
    delay_penalty * ((T - 1) / 2 - t) before the recursion. fastemit_lambda (FastEmit, Yu et al. 2021):
    the loss is unchanged, the gradient w.r.t. every label log-prob is scaled by 1 + fastemit_lambda. An utterance with no alignment gets +inf; one with a NaN or
    infinite logit among its cells gets NaN (with from_log_softmax, where -inf log-probs are legal, one
    with a NaN blank log-prob in a cell).
    """
    log_probs = logits if from_log_softmax else logits.log_softmax(dim=-1)
    losses = []
    for b in range(logits.size(0)):
        T, U = int(logit_lengths[b]), int(target_lengths[b])
        if from_log_softmax:  # -inf log-probs are legal; a NaN blank log-prob anywhere is not
            non_finite = bool(torch.isnan(log_probs[b, :T, :U + 1, blank]).any())
        else:
            non_finite = not torch.isfinite(logits[b, :T, :U + 1]).all()
        if one_sym_per_frame and U > T - 1:
            losses.append(log_probs.new_tensor(math.nan if non_finite else math.inf))
            continue
        y = targets[b, :U].long()
        blank_lp = log_probs[b, :T, :U + 1, blank]
        emit_lp = log_probs[b, :T, torch.arange(U), y]  # (T, U)
        if fastemit_lambda:  # the value of emit_lp, with (1 + lambda) times its gradient
            emit_lp = (1 + fastemit_lambda) * emit_lp - fastemit_lambda * emit_lp.detach()
        if delay_penalty:
            frames = torch.arange(T, dtype=emit_lp.dtype)[:, None]
            emit_lp = emit_lp + delay_penalty * ((T - 1) / 2 - frames)
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
