"""The losses and pack as registered operators (``torch.ops.transducer.*``): torch.compile and torch.export
see one opaque op each, with a fake (meta) implementation for shapes and an autograd formula, instead of
tracing into the kernel launches.

    transducer::loss(logits, extra_scores, targets, logit_lengths, target_lengths, vocab_size, option_ints,
                     option_floats, check_inputs, inplace_grad)
        -> (nll, table, lp, den, lp_arcs, den_arcs, alpha, beta, walk_nll, alpha_r, beta_r, rnnt_nll)
    transducer::loss_backward(grad_nll, logits, extra_scores, targets, table, lp, ..., rnnt_nll, vocab_size,
                              option_ints, option_floats, out, out_extra) -> ()
    transducer::pack(encoder_out, predictor_out, logit_lengths, target_lengths) -> (rows, table)
    transducer::pack_backward(grad_rows, table, max_t, max_u1) -> (grad_encoder_out, grad_predictor_out)

One op serves every loss (RNN-T, RNA, TDT, multi-blank): its ``LossOptions`` travel flat (``option_ints``,
``option_floats``: ``LossOptions.flat``, torch.library's types) and pick the lattice (transducer/lattices.py);
inside, the options are one ``LossOptions`` again and what forward keeps one ``Lattice``
(transducer/lattices.py), which the stages take whole. ``logits`` holds the token scores, and TDT's duration
scores after them unless ``extra_scores`` holds them (a second head); ``vocab_size`` is the token columns.
``nll`` is the (B,) loss (float32, or float64 for float64 logits); the lattice's tensors follow it
(``lattice_outputs``), empty where a lattice has no such array. Logits and targets reach ``loss`` contiguous
or with rows readable in place (the public functions make them so, where autograd sees the copy).

``loss`` and ``pack`` below (``Op``s) are what the rest of the package calls: the registered ops while
torch.compile or torch.export traces, and in eager mode autograd Functions around the same implementations,
the same setup and the same backward, without the registered op's Python layers (their host time:
DESIGN.md: Small steps are host-bound).
"""

import inspect
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ops import accumulate_dtype
from ops.cuda import host_reader

from .backend import stages_for
from .checks import check_loss_values, check_pack_values, check_rows
from .lattices import Lattice, Walks, check_supported, kind_of
from .layout import NUM_STATS, LabelCheck, Layout, table_size
from .options import LossOptions

__all__ = [
    "Op",
    "loss",
    "loss_call",
    "pack",
    "make_layout",
    "saved_layout",
    "gradient_buffer",
    "lattice_outputs",
    "lattice_of",
    "fake_outputs",
    "score_views",
    "in_place_rows",
    "saved_tensors",
]


def make_layout(
    logits, targets, logit_lengths, target_lengths, blank=0, with_stats=False, vocab_size=None, big_blanks=0
):
    """The Layout of compact (N, V) or padded (B, maxT, maxU+1, V) logits (one launch on CUDA, no sync);
    labels are checked against ``vocab_size`` (default: logits.size(-1)) and the blanks."""
    padded = logits.dim() == 4
    labels = LabelCheck(targets, logits.size(-1) if vocab_size is None else vocab_size, blank, big_blanks)
    return stages_for(logits.device).layout(
        logit_lengths,
        target_lengths,
        logits.size(2) if padded else targets.size(1) + 1,
        logits.size(1) if padded else 0,
        labels,
        with_stats,
    )


def saved_layout(table, logits, targets):
    """The Layout of a table that forward made (backward gets the table alone): padded (B, maxT, maxU+1, ...)
    logits give maxT and maxU + 1, compact ones targets.size(1) + 1."""
    if logits.dim() == 4:
        return Layout(table, True, logits.size(2), logits.size(1))
    return Layout(table, False, targets.size(1) + 1)


def checked_log_probs(layout, logits, targets, options, check_inputs, log_probs, vocab_size=None):
    """``log_probs()`` (the loss's first stage) with the value checks of ``check_inputs``: lengths and labels
    against the tensors (checks.check_loss_values; labels in [0, vocab_size), default logits.size(-1), and
    not a blank of ``options``). On CUDA log_probs is queued first (it reads within bounds whatever the values,
    and nothing else runs unchecked), and the layout's stats are read behind the layout launch alone
    (ops.cuda.HostReader): the host reaches the first big kernel sooner, and waits for the layout and the
    copy, not for log_probs. The CPU stages need valid values to run at all: checked first."""
    if not check_inputs:
        return log_probs()
    table = layout.table
    if not table.is_cuda:
        check_loss_values(
            logits, targets, layout.stats.tolist(), options.blank, vocab_size, len(options.big_blank_durations)
        )
        return log_probs()
    reader = host_reader(table.device, NUM_STATS, torch.int64)
    reader.mark()  # after the layout launch
    out = log_probs()
    check_loss_values(
        logits, targets, reader.read(layout.stats), options.blank, vocab_size, len(options.big_blank_durations)
    )
    return out


def gradient_buffer(logits, wide_rows):
    """An uninitialised tensor of the logits' shape and dtype for their gradient. With ``wide_rows`` its rows
    are ``gradient_row_width`` wide (a stage function: on CUDA, 16-bit rows up to 4 KiB padded to a multiple
    of 16 bytes), the gradient a view of their first V columns, which the op that made the logits (the
    joint Linear) reads faster in its backward. The loss passes ``wide_rows`` for eager logits that an op
    produced: a leaf's .grad would be copied to the leaf's strides, and a compiled graph expects the
    strides of its fake."""
    V = logits.size(-1)
    width = stages_for(logits.device).gradient_row_width(V, logits.element_size()) if wide_rows else V
    if width == V:
        return torch.empty_like(logits)
    return logits.new_empty(logits.shape[:-1] + (width,))[..., :V]


def wide_gradient_rows(ctx, logits):
    """Whether the gradient of ``logits`` goes into gradient_buffer's wide rows: eager (ctx.eager, set by
    Op's eager path) and made by an op rather than a leaf."""
    return getattr(ctx, "eager", False) and logits.grad_fn is not None


def saved_tensors(ctx):
    """``ctx.saved_tensors`` as the eager backward unpacked them, once: a second unpack fails under saved-tensor hooks
    (non-reentrant checkpointing) and, after inplace_grad wrote over the logits, autograd's version check."""
    unpacked = getattr(ctx, "unpacked", None)
    return ctx.saved_tensors if unpacked is None else unpacked


class _FirstOrderOnly(torch.autograd.Function):
    """The gradients of a backward run with ``create_graph=True``, as aliases whose own backward raises: the ops have
    no second derivative. The aliases hang on the incoming gradient and the saved inputs that require grad, so that
    any derivative of a gradient with respect to what made the op's inputs reaches the error; a gradient taken as a
    constant would make it silently wrong (torch.autograd.function.once_differentiable hangs its error on the
    incoming gradient alone)."""

    @staticmethod
    def forward(ctx, name, count, *tensors):
        ctx.name = name
        return tuple(g.detach() for g in tensors[:count])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            f"{ctx.name}: no second derivative; a gradient of its gradient (backward with "
            f"create_graph=True, then a derivative of the result) is not supported"
        )

    @staticmethod
    def wrap(name, grads, sources):
        tensors = [g for g in grads if g is not None]
        sources = [x for x in sources if isinstance(x, Tensor) and x.requires_grad]
        aliases = iter(_FirstOrderOnly.apply(name, len(tensors), *tensors, *sources))
        return tuple(None if g is None else next(aliases) for g in grads)


class Op:
    """``transducer::<name>`` and ``transducer::<name>_backward`` registered with torch.library (what
    torch.compile and torch.export trace), and an eager autograd Function around the same forward,
    setup_context and gradient (without the registered op's Python layers). ``gradient(ctx, grad, backward)``
    turns the incoming gradient into the inputs' gradients with ``backward`` (the backward op while tracing,
    its plain implementation in eager mode) and returns them as a dict by input name (forward's parameter
    names); inputs it leaves out get None. ``eager_forward``, if given, is what the eager path runs in forward's
    place: ``(outputs, state)``, forward's outputs and what it made on the host for backward (no tensor of the
    graph), which setup_context finds as ``ctx.eager_state``. Calling the Op picks the path."""

    def __init__(
        self,
        name,
        forward,
        backward,
        setup_context,
        gradient,
        backward_mutates=(),
        after_backward=None,
        eager_forward=None,
    ):
        self.input_names = tuple(inspect.signature(forward).parameters)
        self.name = f"transducer::{name}"
        self.op = torch.library.custom_op(self.name, forward, mutates_args=())
        self.backward_op = torch.library.custom_op(
            f"transducer::{name}_backward", backward, mutates_args=backward_mutates
        )
        self.op.register_autograd(
            lambda ctx, grad, *_: self.ordered(gradient(ctx, grad, self.backward_op)), setup_context=setup_context
        )
        op = self

        # forward(ctx, *inputs), not a separate setup_context: torch's apply then skips binding the
        # arguments to forward's signature (inspect.signature, each call). The outputs other than the first
        # are non-differentiable: without materialised gradients autograd does not fill zeros for them.
        class Eager(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                ctx.set_materialize_grads(False)
                ctx.eager = True  # setup_context may read it (wide_gradient_rows)
                if eager_forward is None:
                    output = forward(*inputs)
                else:
                    output, ctx.eager_state = eager_forward(*inputs)
                setup_context(ctx, inputs, output)
                ctx.eager_state = None  # setup_context has kept what it keeps of it
                ctx.first_output = (output[0].shape, output[0].dtype, output[0].device)
                return output

            @staticmethod
            def backward(ctx, grad, *_):
                if grad is None:
                    # autograd handed no gradient for the first output (gradcheck's check_undefined_grad, a
                    # consumer whose backward returns None): its gradient is zeros, so the inputs' are too, and
                    # they are given defined (the registered op, which materialises gradients, does the same)
                    shape, dtype, device = ctx.first_output
                    grad = torch.zeros(shape, dtype=dtype, device=device)
                create_graph = torch.is_grad_enabled()  # backward(create_graph=True) runs in grad mode
                ctx.unpacked = ctx.saved_tensors  # unpacked once (saved_tensors)
                try:
                    with torch.no_grad():
                        grads = op.ordered(gradient(ctx, grad, backward))
                        if after_backward is not None:
                            after_backward(ctx, grads)
                    if create_graph:
                        return _FirstOrderOnly.wrap(op.name, grads, (grad, *ctx.unpacked))
                    return grads
                finally:
                    del ctx.unpacked

        self.eager = Eager

    def ordered(self, grads):
        """The gradients by input name (a dict) as the tuple autograd expects, None for the others."""
        unknown = set(grads) - set(self.input_names)
        if unknown:
            raise KeyError(f"gradients for inputs that {self.op} does not have: {sorted(unknown)}")
        return tuple(grads.get(name) for name in self.input_names)

    def __call__(self, *inputs):
        return self.op(*inputs) if torch.compiler.is_compiling() else self.eager.apply(*inputs)


# ---------------------------------------------------------------------------------------------- loss


def lattice_outputs(lattice):
    """A Lattice's tensors as op outputs (after the loss): (table, lp, den, lp_arcs, den_arcs, alpha, beta, nll,
    alpha_r, beta_r, rnnt_nll); empty where the lattice has no such array (op outputs may not alias each
    other)."""
    empty = lattice.lp.new_empty
    rnnt = lattice.rnnt or Walks(empty(0), empty(0), empty(0))
    return (
        lattice.layout.table,
        lattice.lp,
        lattice.den,
        lattice.lp_arcs if lattice.lp_arcs is not None else empty(0),
        lattice.den_arcs if lattice.den_arcs is not None else empty(0),
        lattice.alpha,
        lattice.beta,
        lattice.nll,
    ) + tuple(rnnt)


def lattice_of(layout, tensors, options):
    """The Lattice of lattice_outputs' tensors after the table: backward's saved tensors."""
    lp, den, lp_arcs, den_arcs, alpha, beta, nll, alpha_r, beta_r, rnnt_nll = tensors
    kind = kind_of(options)
    return Lattice(
        layout,
        lp,
        den,
        alpha,
        beta,
        nll,
        lp_arcs if kind.arcs(options) else None,
        den_arcs if kind.extra_columns(options) else None,
        Walks(alpha_r, beta_r, rnnt_nll) if options.omega else None,
    )


def fake_outputs(like, acc, B, N, options):
    """The op outputs (nll, *lattice_outputs) of ``B`` utterances over ``N`` rows, as empty tensors like
    ``like`` (the register_fake implementations; ``acc``: the per-row arrays' dtype)."""
    kind = kind_of(options)
    K, D = kind.arcs(options), kind.extra_columns(options)
    new = lambda *shape: like.new_empty(shape, dtype=acc)  # noqa: E731
    r = N if options.omega else 0
    return (
        new(B),
        like.new_empty(table_size(B), dtype=torch.int64),
        new(N, 2),
        new(N),
        new(N, K) if K else new(0),
        new(N) if D else new(0),
        new(N),
        new(N),
        new(B),
        new(r),
        new(r),
        new(B if options.omega else 0),
    )


def in_place_rows(x):
    """``x`` itself when its rows can be read in place (unit column stride, leading dims that flatten to one
    row index: a column slice of a wider joint output, such as the token and duration columns of a joint
    whose width is padded to a multiple of 8), else a contiguous copy."""
    if x.is_contiguous():
        return x
    if x.stride(-1) == 1:
        try:
            x.view(-1, x.size(-1))
            return x
        except RuntimeError:
            pass
    return x.contiguous()


def score_views(logits, extra_scores, vocab_size):
    """(tokens (N, V), extra (N, D) or None): 2-D views of the rows (no copy; one op: each costs host time)."""
    rows = logits if logits.dim() == 2 else logits.view(-1, logits.size(-1))
    if extra_scores is not None:
        return rows, extra_scores if extra_scores.dim() == 2 else extra_scores.view(-1, extra_scores.size(-1))
    if vocab_size < rows.size(1):
        return rows.split_with_sizes([vocab_size, rows.size(1) - vocab_size], 1)
    return rows, None


def _loss_forward(
    logits: Tensor,
    extra_scores: Optional[Tensor],
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    vocab_size: int,
    option_ints: List[int],
    option_floats: List[float],
    check_inputs: bool,
    inplace_grad: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    check_rows(logits)  # here, not in the Python caller: under torch.compile the rows may be symbolic
    options = LossOptions.from_flat(option_ints, option_floats)
    kind = kind_of(options)
    check_supported(options, kind, logits.device.type)
    stages = stages_for(logits.device)
    tokens, extra = score_views(logits, extra_scores, vocab_size)
    layout = make_layout(
        logits,
        targets,
        logit_lengths,
        target_lengths,
        options.blank,
        check_inputs,
        vocab_size,
        len(options.big_blank_durations),
    )
    log_probs = checked_log_probs(
        layout,
        logits,
        targets,
        options,
        check_inputs,
        lambda: kind.log_probs(stages, tokens, extra, targets, layout, options),
        vocab_size,
    )
    lattice = kind.lattice(stages, layout, log_probs, options)
    return (kind.nll(lattice, options),) + lattice_outputs(lattice)


def _loss_backward(
    grad_nll: Tensor,
    logits: Tensor,
    extra_scores: Optional[Tensor],
    targets: Tensor,
    table: Tensor,
    lp: Tensor,
    den: Tensor,
    lp_arcs: Tensor,
    den_arcs: Tensor,
    alpha: Tensor,
    beta: Tensor,
    nll: Tensor,
    alpha_r: Tensor,
    beta_r: Tensor,
    rnnt_nll: Tensor,
    vocab_size: int,
    option_ints: List[int],
    option_floats: List[float],
    out: Tensor,
    out_extra: Tensor,
) -> None:
    """out (the logits' shape and dtype; may be the logits) and out_extra (extra_scores', or empty) = the
    gradient of sum_b grad_nll[b] * nll[b]."""
    options = LossOptions.from_flat(option_ints, option_floats)
    lattice = lattice_of(
        saved_layout(table, logits, targets),
        (lp, den, lp_arcs, den_arcs, alpha, beta, nll, alpha_r, beta_r, rnnt_nll),
        options,
    )
    tokens, extra = score_views(logits, extra_scores, vocab_size)
    out_tokens, out_extra = score_views(out, out_extra if extra_scores is not None else None, vocab_size)
    kind_of(options).gradient(
        stages_for(logits.device),
        (tokens, extra),
        targets,
        lattice,
        grad_nll.to(lp.dtype),
        options,
        (out_tokens, out_extra),
    )


def _loss_setup_context(ctx, inputs, output):
    logits, extra_scores, targets, _, _, vocab_size, option_ints, option_floats, _, inplace_grad = inputs
    nll, *lattice = output
    ctx.mark_non_differentiable(*lattice)
    ctx.save_for_backward(logits, extra_scores, targets, *lattice)
    ctx.vocab_size = vocab_size
    ctx.option_flat = (option_ints, option_floats)
    ctx.inplace_grad = inplace_grad
    ctx.wide_rows = wide_gradient_rows(ctx, logits)


def _loss_gradient(ctx, grad_nll, backward):
    logits, extra_scores, targets, *lattice = saved_tensors(ctx)
    out = logits if ctx.inplace_grad else gradient_buffer(logits, ctx.wide_rows)
    out_extra = torch.empty_like(extra_scores) if extra_scores is not None else logits.new_empty(0)
    backward(grad_nll, logits, extra_scores, targets, *lattice, ctx.vocab_size, *ctx.option_flat, out, out_extra)
    return {"logits": out, "extra_scores": out_extra if extra_scores is not None else None}


def _after_eager_backward(ctx, grads):
    if ctx.inplace_grad:  # the kernel wrote through a raw pointer; tell autograd
        torch.autograd.graph.increment_version(grads[0])


loss = Op(
    "loss",
    _loss_forward,
    _loss_backward,
    _loss_setup_context,
    _loss_gradient,
    backward_mutates=("out", "out_extra"),
    after_backward=_after_eager_backward,
)
loss_op, loss_backward_op = loss.op, loss.backward_op


@loss_op.register_fake
def _(logits, extra_scores, targets, logit_lengths, target_lengths, vocab_size, option_ints, option_floats, *rest):
    N = logits.numel() // logits.size(-1)
    return fake_outputs(
        logits,
        accumulate_dtype(logits.dtype),
        logit_lengths.size(0),
        N,
        LossOptions.from_flat(option_ints, option_floats),
    )


@loss_backward_op.register_fake
def _(*args):
    return None


def loss_call(scores, targets, logit_lengths, target_lengths, vocab_size, options, check_inputs, inplace_grad=False):
    """The per-utterance loss (B,) of the ``loss`` op for ``options`` (a LossOptions); ``scores`` = (logits,
    extra_scores or None)."""
    logits, extra_scores = scores
    ints, floats = options.flat()
    return loss(
        logits,
        extra_scores,
        targets,
        logit_lengths,
        target_lengths,
        vocab_size,
        ints,
        floats,
        bool(check_inputs),
        bool(inplace_grad),
    )[0]


# ---------------------------------------------------------------------------------------------- pack


def _pack_forward(
    encoder_out: Tensor, predictor_out: Tensor, logit_lengths: Tensor, target_lengths: Tensor
) -> Tuple[Tensor, Tensor]:
    stages = stages_for(encoder_out.device)
    layout = stages.layout(logit_lengths, target_lengths, predictor_out.size(1))
    num_rows = check_pack_values(encoder_out, predictor_out, layout.stats.tolist())
    return stages.pack_forward(encoder_out, predictor_out, layout, num_rows), layout.table


def _pack_backward(grad_rows: Tensor, table: Tensor, max_t: int, max_u1: int) -> Tuple[Tensor, Tensor]:
    return stages_for(grad_rows.device).pack_backward(grad_rows, Layout(table, False, max_u1), max_t, max_u1)


def _pack_setup_context(ctx, inputs, output):
    encoder_out, predictor_out, _, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1])
    ctx.sizes = (encoder_out.size(1), predictor_out.size(1))
    ctx.dtypes = (encoder_out.dtype, predictor_out.dtype)


def _pack_gradient(ctx, grad_rows, backward):
    (table,) = saved_tensors(ctx)
    grad_enc, grad_pred = backward(grad_rows.contiguous(), table, *ctx.sizes)
    # summed in the rows' (the promoted) dtype, then in each input's own, as autograd does for enc + pred
    return {"encoder_out": grad_enc.to(ctx.dtypes[0]), "predictor_out": grad_pred.to(ctx.dtypes[1])}


pack = Op("pack", _pack_forward, _pack_backward, _pack_setup_context, _pack_gradient)
pack_op, pack_backward_op = pack.op, pack.backward_op


@pack_op.register_fake
def _(encoder_out, predictor_out, logit_lengths, target_lengths):
    # the number of rows, sum_b T_b * (U_b + 1), depends on the lengths' values
    num_rows = torch.library.get_ctx().new_dynamic_size()
    dtype = torch.promote_types(encoder_out.dtype, predictor_out.dtype)
    return (
        encoder_out.new_empty(num_rows, encoder_out.size(2), dtype=dtype),
        encoder_out.new_empty(table_size(logit_lengths.size(0)), dtype=torch.int64),
    )


@pack_backward_op.register_fake
def _(grad_rows, table, max_t, max_u1):
    B = (table.numel() - 1 - NUM_STATS) // 4
    return grad_rows.new_empty(B, max_t, grad_rows.size(1)), grad_rows.new_empty(B, max_u1, grad_rows.size(1))
