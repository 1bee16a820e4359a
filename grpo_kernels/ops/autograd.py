"""The autograd formulas of the custom operators (registered in `custom_ops.py`).

Forward gives (logp [N], entropy [N], lse [N]; linear_logprobs also lse_sum, the chunked
forward's S = Σ 2^(z - lse·log2(e)) [N], 1 where it did not run). Backward needs only per-token
statistics, so only those (logp too: the chunked backward takes a dominant target's 1 - p from
it; and lse_sum: with it, p of any token to float32's precision) and the inputs are saved, never
logits (the eager chunked call in `custom_ops.py` may keep
a small problem's single logits tile on ctx, outside saved_tensors). A token-terms op also
returns each token's weighted loss t = weight·ℓ(logp) and its derivative c = dt/dlogp (the
epilogue's, or grpo_math's); t of token n depends on logp[n] alone, so by the chain rule

    g_logp_total = g_logp + g_t · c,   g_entropy as given
    then the op's backward turns (g_logp_total, g_entropy) into input gradients.

Every op takes the logit transform (softcap, logit_scale: kernels/logit_transform.py) as its last
two arguments, defaulting to None; setup_context sees them filled in, and ctx.config keeps them
for the backward op.
"""

from __future__ import annotations

from dataclasses import fields

import torch
from torch._C import _functions

from ..params import TokenLossArgs

ONCE = b"trying to differentiate twice a function that was marked with @once_differentiable"

# A token-terms op's GRPO arguments: weights, advantages, old/ref log-probs, the rollout ratios,
# then TokenLossArgs' fields; the logit transform (softcap, logit_scale) follows them.
N_GRPO_ARGS = 5 + len(fields(TokenLossArgs))

# ---- autograd formulas of the custom ops (custom_ops.py registers them) ----------------------
# Forward saves the inputs and per-token statistics (lse, entropy [N]); backward turns the
# per-token gradients (g_logp, g_entropy [N] float32) into input gradients with the op's
# backward launcher. Unused outputs give None (set_materialize_grads(False)), so selective
# log-probs without entropy never pay for the entropy gradient.


def _saved_logp(logp):
    """A copy of the forward's log-probs [N] to save: the output itself may be changed in place
    by the caller (the version counter would then fail the backward), a copy is N floats."""
    return logp.detach().clone()


def _per_token(g, like):
    return torch.zeros_like(like) if g is None else g.float().contiguous()


def _transform(rest) -> tuple:
    """(softcap, logit_scale) from an op's trailing arguments (None where left out)."""
    rest = tuple(rest) + (None, None)
    return rest[0], rest[1]


def _grads_for(ctx, grads):
    """Input gradients padded with None to the op's number of inputs."""
    return (*grads, *[None] * (ctx.n_inputs - len(grads)))


def linear_grads(ctx, g_logp, g_ent, backward=None, lse_sum=None):
    """(d hidden, d weight, d bias) from the saved (hidden, weight, bias, targets, lse, ent,
    logp). backward: linear_logprobs_backward's eager body, called directly (default: the
    operator). lse_sum: linear_logprobs' saved output of that name, or None."""
    hidden, weight, bias, targets, lse, ent, logp = ctx.saved_tensors[:7]
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    if (g_logp is None and g_ent is None) or not any(needs):
        return None, None, None
    temperature, grad_filter, backend, softcap, logit_scale = ctx.config
    g_ent = None if g_ent is None else g_ent.float().contiguous()
    backward = backward or torch.ops.grpo_kernels.linear_logprobs_backward
    grads = backward(hidden, weight, bias, targets, lse, ent, _per_token(g_logp, lse), g_ent,
                     temperature, grad_filter, backend, needs, softcap, logit_scale, logp=logp,
                     lse_sum=lse_sum)
    return tuple(g if need else None for g, need in zip(grads, needs))


def logits_grads(ctx, g_logp, g_ent, backward=None):
    """d logits from the saved (logits, targets, lse_terms, ent, logp); in place when
    ctx.inplace. The lse is m + log s, as the forward summed it (bitwise its lse; NaN at a row
    it skipped). backward: the eager bodies (out of place, in place) of
    logits_logprobs_backward[_], called directly (default: the operators)."""
    logits, targets, terms, ent, logp = ctx.saved_tensors[:5]
    if (g_logp is None and g_ent is None) or not ctx.needs_input_grad[0]:
        return None
    temperature, backend, inplace, softcap, logit_scale = ctx.config
    lse = terms[0] + terms[1]
    args = (targets, lse, ent, _per_token(g_logp, lse),
            None if g_ent is None else g_ent.float().contiguous(), temperature, backend, softcap,
            logit_scale)
    ops = torch.ops.grpo_kernels
    out_of_place, in_place = backward or (ops.logits_logprobs_backward,
                                          ops.logits_logprobs_backward_)
    if inplace:
        in_place(logits, *args, logp=logp, lse_terms=terms)
        return logits  # d logits now lives in the logits buffer (version counter bumped)
    return out_of_place(logits, *args, logp=logp, lse_terms=terms)


def setup_linear(ctx, inputs, output):
    """Saves (inputs, lse, entropy, logp, lse_sum): lse_sum [N] is the chunked forward's S,
    with which its backward reads p to float32's precision."""
    hidden, weight, bias, targets, temperature, grad_filter, backend, _, *rest = inputs
    logp, ent, lse, lse_sum = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, lse_sum)
    ctx.save_for_backward(hidden, weight, bias, targets, lse, ent, _saved_logp(logp), lse_sum)
    ctx.n_inputs = len(inputs)
    ctx.config = (temperature, grad_filter, backend, *_transform(rest))


def linear_backward(ctx, g_logp, g_ent, _g_lse, _g_lse_sum, backward=None):
    with torch.no_grad():  # the backward op has no autograd formula: nothing to record
        grads = linear_grads(ctx, g_logp, g_ent, backward, lse_sum=ctx.saved_tensors[7])
    return _grads_for(ctx, once_differentiable(grads))


def setup_logits(ctx, inputs, output):
    """Saves (logits, targets, lse_terms, entropy, logp): the lse's terms m and log s [2, N]
    in place of the lse [N] (4 bytes more per row), so that the backward reads p as the
    forward formed it."""
    logits, targets, temperature, backend, _, inplace, *rest = inputs
    logp, ent, lse, terms = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, terms)
    ctx.save_for_backward(logits, targets, terms, ent, _saved_logp(logp))
    ctx.n_inputs = len(inputs)
    ctx.config = (temperature, backend, inplace, *_transform(rest))


def logits_backward(ctx, g_logp, g_ent, _g_lse, _g_lse_terms, backward=None):
    with torch.no_grad():
        grads = (logits_grads(ctx, g_logp, g_ent, backward),)
    return _grads_for(ctx, once_differentiable(grads))


# ---- the token-terms ops: inputs (kernel tensors, targets, options, GRPO tensors, hyperparameters)
# -> outputs (logp, entropy, lse, token_loss, coef_logp, kl, ratio); logp, entropy and token_loss
# are differentiable.


def split_terms_args(args) -> tuple:
    """A token-terms op's arguments after its backend (and inplace) flag -> (GRPO arguments,
    softcap, logit_scale)."""
    return (tuple(args[:N_GRPO_ARGS]), *_transform(args[N_GRPO_ARGS:]))


def _save_terms(ctx, tensors, output, n_inputs: int):
    """Saves (kernel tensors, targets, lse, entropy, logp, coef_logp); the logits op's
    lse_terms [2, N] in place of its lse (`setup_logits`)."""
    logp, ent, lse, _, coef_logp, kl, ratio, *terms = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, coef_logp, kl, ratio, *terms)
    ctx.n_inputs = n_inputs
    ctx.save_for_backward(*tensors, *(terms or [lse]), ent, _saved_logp(logp), coef_logp)


def _token_grads(ctx, g_logp, g_token_loss):
    """g_logp + g_token_loss · coef_logp (None when neither output has a gradient)."""
    if g_token_loss is None:
        return g_logp
    g = g_token_loss.float() * ctx.saved_tensors[-1]
    return g if g_logp is None else g_logp.float() + g


def setup_linear_terms(ctx, inputs, output):
    hidden, weight, bias, targets, temperature, grad_filter, backend, *rest = inputs
    _, softcap, logit_scale = split_terms_args(rest)
    _save_terms(ctx, (hidden, weight, bias, targets), output, len(inputs))
    ctx.config = (temperature, grad_filter, backend, softcap, logit_scale)


def linear_terms_backward(ctx, g_logp, g_ent, _g_lse, g_token_loss, *_):
    with torch.no_grad():
        grads = linear_grads(ctx, _token_grads(ctx, g_logp, g_token_loss), g_ent)
    grads = once_differentiable(grads)
    return (*grads, *[None] * (ctx.n_inputs - len(grads)))


def setup_logits_terms(ctx, inputs, output):
    logits, targets, temperature, backend, inplace, *rest = inputs
    _, softcap, logit_scale = split_terms_args(rest)
    _save_terms(ctx, (logits, targets), output, len(inputs))
    ctx.config = (temperature, backend, inplace, softcap, logit_scale)


def logits_terms_backward(ctx, g_logp, g_ent, _g_lse, g_token_loss, *_):
    with torch.no_grad():
        grad = logits_grads(ctx, _token_grads(ctx, g_logp, g_token_loss), g_ent)
    return (*once_differentiable((grad,)), *[None] * (ctx.n_inputs - 1))


def once_differentiable(grads: tuple) -> tuple:
    """The gradients as they are, or, under create_graph=True (grad mode on in a backward), as
    outputs of a node that raises when differentiated: no second derivative goes through the
    head's kernels, and saying so beats the silent zeros of an operator without an autograd
    formula for its backward (as @once_differentiable does for an autograd.Function)."""
    given = [x for x in grads if x is not None]
    if not torch.is_grad_enabled() or not given:
        return grads
    error = _functions.DelayedError(ONCE, len(given))
    out = error(*[x.detach().requires_grad_() for x in given])
    out = iter(out if isinstance(out, tuple) else (out,))
    return tuple(None if x is None else next(out) for x in grads)
