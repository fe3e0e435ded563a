"""A small transducer: conv-subsampled LSTM or Conformer encoder, LSTM or stateless predictor,
and a joiner fused with the loss (``transducer.FusedJoinerLoss``) or building the compact
(sum_b T_b*(U_b+1), V) logits through ``transducer.pack``."""

import math

import torch
from asr_data import num_subsampled
from torch import nn


class Subsampling(nn.Module):
    """Two stride-2 convolutions: 4x fewer frames."""

    def __init__(self, num_mel_bins, d_model, channels=32):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, channels, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.out = nn.Linear(channels * num_subsampled(num_mel_bins), d_model)

    def forward(self, x, lengths):
        x = self.conv(x.unsqueeze(1))  # (B, C, T/4, F/4)
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        return x, num_subsampled(lengths)


class Encoder(nn.Module):
    def __init__(self, kind, num_mel_bins, d_model, num_layers, dropout=0.1):
        super().__init__()
        self.kind = kind
        self.subsampling = Subsampling(num_mel_bins, d_model)
        self.dropout = nn.Dropout(dropout)
        if kind == "lstm":  # bidirectional: the recipe decodes whole utterances
            self.rnn = nn.LSTM(
                d_model,
                d_model // 2,
                num_layers=num_layers,
                batch_first=True,
                bidirectional=True,
                dropout=dropout if num_layers > 1 else 0.0,
            )
        elif kind == "conformer":
            from torchaudio.models import Conformer

            self.conformer = Conformer(
                input_dim=d_model,
                num_heads=4,
                ffn_dim=4 * d_model,
                num_layers=num_layers,
                depthwise_conv_kernel_size=15,
                dropout=dropout,
            )
        else:
            raise ValueError(f"unknown encoder {kind!r}")

    def forward(self, x, lengths):
        x, lengths = self.subsampling(x, lengths)
        x = self.dropout(x)
        if self.kind == "lstm":
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            x, _ = self.rnn(packed)
            x, _ = nn.utils.rnn.pad_packed_sequence(x, batch_first=True)
        else:
            x, lengths = self.conformer(x, lengths)
        return x, lengths


class Predictor(nn.Module):
    """Label context -> (B, U+1, d). Position 0 sees only the start symbol (the blank id)."""

    def __init__(self, kind, vocab_size, d_model, blank=0, context=2):
        super().__init__()
        self.kind, self.blank, self.context = kind, blank, context
        self.embed = nn.Embedding(vocab_size, d_model)
        if kind == "lstm":
            self.rnn = nn.LSTM(d_model, d_model, batch_first=True)
        elif kind == "stateless":  # the last `context` labels only (Ghodsi et al. 2020)
            self.mix = nn.Linear(context * d_model, d_model)
        else:
            raise ValueError(f"unknown predictor {kind!r}")

    def forward(self, y, state=None):
        """y (B, S) label ids. LSTM: state is (h, c). Stateless: state is the previous
        context-1 labels (B, context-1). Returns (out (B, S, d), new state)."""
        if self.kind == "lstm":
            out, state = self.rnn(self.embed(y), state)
            return out, state
        if state is None:
            state = y.new_full((y.size(0), self.context - 1), self.blank)
        full = torch.cat([state, y], 1)
        windows = full.unfold(1, self.context, 1)  # (B, S, context)
        out = torch.relu(self.mix(self.embed(windows).flatten(2)))
        return out, full[:, full.size(1) - (self.context - 1) :]

    def initial(self, batch_size, device):
        return self.forward(torch.full((batch_size, 1), self.blank, dtype=torch.long, device=device))

    def prepend_blank(self, targets):
        return torch.cat([targets.new_full((targets.size(0), 1), self.blank), targets], 1)


def select_state(state, keep, new):
    """Where keep (B,) is False take ``new``'s rows, else ``state``'s (LSTM tuples or tensors)."""
    if isinstance(state, tuple):
        return tuple(select_state(s, keep, n) for s, n in zip(state, new))
    if state.dim() == 3:  # LSTM (layers, B, d)
        return torch.where(keep[None, :, None], state, new)
    return torch.where(keep[:, None], state, new)


class Joiner(nn.Module):
    """The unfused joiner and its loss: ``output(tanh(enc + pred))`` as compact (sum_b T_b*(U_b+1), V) logits
    through ``transducer.pack``, then ``criterion``. The same interface as ``transducer.FusedJoinerLoss``
    (``forward`` gives the loss, ``logits`` the scores for decoding, ``output`` the Linear)."""

    def __init__(self, joiner_dim, outputs, criterion):
        super().__init__()
        self.output = nn.Linear(joiner_dim, outputs)
        self.criterion = criterion

    def forward(self, enc, pred, targets, enc_lens, target_lens):
        from transducer import pack

        # the logits as they are (bf16 / fp16 under autocast): the loss reads them in their own dtype and
        # accumulates in fp32, where a .float() copy would double the largest tensor of the step
        logits = self.output(torch.tanh(pack(enc, pred, enc_lens, target_lens)))
        return self.criterion(logits, targets, enc_lens, target_lens)

    def logits(self, enc, pred):
        return self.output(torch.tanh(enc + pred))


class Transducer(nn.Module):
    """Encoder, predictor and joiner ``out(tanh(enc_proj(enc) + pred_proj(pred)))``; ``forward`` gives the
    batch's mean loss. ``loss``: "rnnt", "rna" (one symbol per frame), "tdt" (Token-and-Duration
    Transducer: the joiner also scores ``durations``) or "multiblank" (multi-blank RNN-T: the joiner also scores
    big blanks of ``big_blank_durations`` frames and, last, the blank of the loss; the predictor's start
    symbol 0 is then no output). ``self.joiner`` holds ``out`` and the loss: with ``joiner="fused"`` it is a
    transducer.FusedJoinerLoss (joiner and loss together, no logits in memory); with ``"unfused"`` a Joiner
    (the compact logits through transducer.pack, then the loss); both give the same loss."""

    def __init__(
        self,
        vocab_size,
        num_mel_bins=80,
        encoder="lstm",
        encoder_dim=256,
        encoder_layers=3,
        predictor="lstm",
        predictor_dim=256,
        joiner_dim=256,
        dropout=0.1,
        blank=0,
        joiner="fused",
        loss="rnnt",
        durations=(0, 1, 2, 3, 4),
        sigma=0.0,
        omega=0.0,
        fastemit_lambda=0.0,
        delay_penalty=0.0,
        big_blank_durations=(2, 4, 8),
    ):
        super().__init__()
        from transducer import FusedJoinerLoss, MultiblankLoss, TDTLoss, TransducerLoss

        if joiner not in ("fused", "unfused"):
            raise ValueError(f"joiner: expected 'fused' or 'unfused', got {joiner!r}")
        if loss not in ("rnnt", "rna", "tdt", "multiblank"):
            raise ValueError(f"loss: expected 'rnnt', 'rna', 'tdt' or 'multiblank', got {loss!r}")
        self.loss = loss
        self.durations = list(durations) if loss == "tdt" else []
        self.big_blank_durations = list(big_blank_durations) if loss == "multiblank" else []
        # the output's blank: the predictor's start symbol, or with big blanks the last column (they sit before it)
        self.blank = vocab_size + len(self.big_blank_durations) if loss == "multiblank" else blank
        self.encoder = Encoder(encoder, num_mel_bins, encoder_dim, encoder_layers, dropout)
        self.predictor = Predictor(predictor, vocab_size, predictor_dim, blank)
        self.enc_proj = nn.Linear(encoder_dim, joiner_dim)
        self.pred_proj = nn.Linear(predictor_dim, joiner_dim)
        if loss == "tdt":
            self.loss_options = dict(
                blank=blank, sigma=sigma, omega=omega, fastemit_lambda=fastemit_lambda, delay_penalty=delay_penalty
            )
            extra = dict(durations=self.durations)
            criterion = TDTLoss(self.durations, **self.loss_options)
        elif loss == "multiblank":
            self.loss_options = dict(
                blank=-1, sigma=sigma, fastemit_lambda=fastemit_lambda, delay_penalty=delay_penalty
            )
            extra = dict(big_blank_durations=self.big_blank_durations)
            criterion = MultiblankLoss(self.big_blank_durations, **self.loss_options)
        else:
            # RNA utterances with more labels than frames have no alignment: they are left out of the loss
            rna = loss == "rna"
            self.loss_options = dict(
                blank=blank,
                one_sym_per_frame=rna,
                zero_infinity=rna,
                fastemit_lambda=fastemit_lambda,
                delay_penalty=delay_penalty,
            )
            extra = {}
            criterion = TransducerLoss(**self.loss_options)
        # the big blanks and the blank are output columns; the durations are columns after them
        outputs = vocab_size + (len(self.big_blank_durations) + 1 if loss == "multiblank" else 0)
        if joiner == "fused":
            self.joiner = FusedJoinerLoss(joiner_dim, outputs, **self.loss_options, **extra)
        else:
            self.joiner = Joiner(joiner_dim, outputs + len(self.durations), criterion)

    @property
    def out(self):
        """The joiner's output Linear (joiner_dim, output columns)."""
        return self.joiner.output

    def forward(self, feats, feat_lens, targets, target_lens):
        """The mean loss of the batch (float32; the joiner's GEMMs in the autocast dtype under autocast)."""
        enc, enc_lens = self.encoder(feats, feat_lens)
        pred, _ = self.predictor(self.predictor.prepend_blank(targets))
        return self.joiner(self.enc_proj(enc), self.pred_proj(pred), targets, enc_lens, target_lens)

    @torch.no_grad()
    def decode(self, feats, feat_lens, max_symbols=5):
        """Batched greedy search for the model's loss: a list of label-id lists."""
        if self.loss == "tdt":
            return self.greedy_decode_tdt(feats, feat_lens, max_symbols)
        if self.loss == "multiblank":
            return self.greedy_decode_multiblank(feats, feat_lens, max_symbols)
        return self.greedy_decode(feats, feat_lens, max_symbols, one_sym_per_frame=self.loss == "rna")

    @torch.no_grad()
    def greedy_decode_tdt(self, feats, feat_lens, max_symbols=5):
        """TDT greedy search (Xu et al. 2023): at each step the best token and the best duration; a label is
        emitted (and the predictor advanced), and the frame moves on by the duration (at least 1 for a blank,
        and after ``max_symbols`` labels on one frame)."""
        V = self.out.out_features - len(self.durations)
        durations = torch.tensor(self.durations, device=feats.device)

        def choose(scores):
            token = scores[:, :V].argmax(-1)
            return token, token != self.blank, durations[scores[:, V:].argmax(-1)]

        return self._greedy_decode_skipping(feats, feat_lens, max_symbols, choose)

    @torch.no_grad()
    def greedy_decode_multiblank(self, feats, feat_lens, max_symbols=5):
        """Multi-blank greedy search (Xu et al. 2023): at each step the best column; a label is emitted (and the
        predictor advanced) on the same frame, the blank moves on one frame, big blank i (column blank - 1 - i)
        by its duration; after ``max_symbols`` labels on one frame, the frame moves on by one."""
        # the frames each column moves on by: 0 for a label, 1 for the blank, d_i for big blank i
        step_of = torch.zeros(self.out.out_features, dtype=torch.long, device=feats.device)
        step_of[self.blank] = 1
        for i, d in enumerate(self.big_blank_durations):
            step_of[self.blank - 1 - i] = d

        def choose(scores):
            scores[:, 0] = -math.inf  # the predictor's start symbol: no output
            best = scores.argmax(-1)
            return best, step_of[best] == 0, step_of[best]

        return self._greedy_decode_skipping(feats, feat_lens, max_symbols, choose)

    def _greedy_start(self, feats, feat_lens):
        """What every greedy search starts from: the encoder's output projected for the joiner (B, T, d) and its
        lengths, the predictor's output for the start symbol projected for the joiner (B, d) and its state, and
        an empty hypothesis per utterance."""
        enc, enc_lens = self.encoder(feats, feat_lens)
        enc = self.enc_proj(enc)
        pred, state = self.predictor.initial(enc.size(0), enc.device)
        return enc, enc_lens, self.pred_proj(pred[:, 0]), state, [[] for _ in range(enc.size(0))]

    def _greedy_emit(self, hyps, token, emit, pred, state):
        """Append ``token`` to the hypotheses of the rows where ``emit`` and feed it to the predictor there; the
        other rows keep their predictor output and state. Returns the new (pred, state)."""
        for b in emit.nonzero().flatten().tolist():
            hyps[b].append(int(token[b]))
        # rows that emit nothing feed the start symbol: a blank's column need not be a predictor input
        new_pred, new_state = self.predictor(token.masked_fill(~emit, self.predictor.blank).unsqueeze(1), state)
        keep = ~emit
        return torch.where(keep[:, None], pred, self.pred_proj(new_pred[:, 0])), select_state(state, keep, new_state)

    def _greedy_decode_skipping(self, feats, feat_lens, max_symbols, choose):
        """The batched greedy search of the outputs that skip frames (TDT, multi-blank). ``choose(scores)``
        gives each row's (token, emit, step): where emit, the token is emitted and the predictor advanced;
        the frame moves on by step, at least 1 where nothing is emitted or after ``max_symbols`` labels on
        one frame."""
        enc, enc_lens, pred, state, hyps = self._greedy_start(feats, feat_lens)
        B, T, _ = enc.shape
        t = torch.zeros(B, dtype=torch.long, device=enc.device)
        emitted = torch.zeros(B, dtype=torch.long, device=enc.device)  # labels emitted on the current frame
        rows = torch.arange(B, device=enc.device)
        while True:
            active = t < enc_lens
            if not bool(active.any()):
                break
            token, emit, step = choose(self.joiner.logits(enc[rows, t.clamp(max=T - 1)], pred))
            emit = active & emit
            if bool(emit.any()):
                pred, state = self._greedy_emit(hyps, token, emit, pred, state)
            emitted = torch.where(emit, emitted + 1, 0)
            step = torch.where(emit, step, step.clamp(min=1))  # a blank moves on
            step = torch.where(emitted >= max_symbols, step.clamp(min=1), step)
            emitted = torch.where(step > 0, 0, emitted)
            t = torch.where(active, t + step, t)
        return hyps

    @torch.no_grad()
    def greedy_decode(self, feats, feat_lens, max_symbols=5, one_sym_per_frame=False):
        """Batched greedy search: at most ``max_symbols`` labels per frame (1 with RNA,
        where a label also moves to the next frame). Returns a list of label-id lists."""
        enc, enc_lens, pred, state, hyps = self._greedy_start(feats, feat_lens)
        for t in range(enc.size(1)):
            active = enc_lens > t
            for _ in range(1 if one_sym_per_frame else max_symbols):
                best = self.joiner.logits(enc[:, t], pred).argmax(-1)
                emit = active & (best != self.blank)
                if not bool(emit.any()):
                    break
                pred, state = self._greedy_emit(hyps, best, emit, pred, state)
                active = emit
        return hyps
