"""The autograd formulas of the custom operators (registered in `custom_ops.py`).

Forward gives (logp [N], entropy [N], lse [N]). Backward needs only per-token statistics, so only
those and the inputs are saved, never logits (the eager chunked call in `custom_ops.py` may keep
a small problem's single logits tile on ctx, outside saved_tensors). For a loss op the forward
also returns each token's dloss/dlogp (the epilogue's weight·dℓ/dlogp, or grpo_math's) and
dloss/dentropy, and

    g_logp = g_loss · dloss/dlogp,   g_entropy = g_loss · dloss/dentropy
    then the op's backward turns (g_logp, g_entropy) into input gradients.
"""

from __future__ import annotations

import torch

from .loss_terms import unpack_loss_args

# ---- autograd formulas of the custom ops (custom_ops.py registers them) ----------------------
# Forward saves the inputs and per-token statistics (lse, entropy [N]); backward turns the
# per-token gradients (g_logp, g_entropy [N] float32) into input gradients with the op's
# backward launcher. Unused outputs give None (set_materialize_grads(False)), so selective
# log-probs without entropy never pay for the entropy gradient.


def _per_token(g, like):
    return torch.zeros_like(like) if g is None else g.float().contiguous()


def linear_grads(ctx, g_logp, g_ent, backward=None):
    """(d hidden, d weight, d bias) from the saved (hidden, weight, bias, targets, lse, ent).
    backward: linear_logprobs_backward's eager body, called directly (default: the operator)."""
    hidden, weight, bias, targets, lse, ent = ctx.saved_tensors[:6]
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    if (g_logp is None and g_ent is None) or not any(needs):
        return None, None, None
    temperature, grad_filter, backend = ctx.config
    g_ent = None if g_ent is None else g_ent.float().contiguous()
    backward = backward or torch.ops.grpo_kernels.linear_logprobs_backward
    grads = backward(hidden, weight, bias, targets, lse, ent, _per_token(g_logp, lse), g_ent,
                     temperature, grad_filter, backend, needs)
    return tuple(g if need else None for g, need in zip(grads, needs))


def logits_grads(ctx, g_logp, g_ent, backward=None):
    """d logits from the saved (logits, targets, lse, ent); in place when ctx.inplace.
    backward: the eager bodies (out of place, in place) of logits_logprobs_backward[_], called
    directly (default: the operators)."""
    logits, targets, lse, ent = ctx.saved_tensors[:4]
    if (g_logp is None and g_ent is None) or not ctx.needs_input_grad[0]:
        return None
    temperature, backend, inplace = ctx.config
    args = (targets, lse, ent, _per_token(g_logp, lse),
            None if g_ent is None else g_ent.float().contiguous(), temperature, backend)
    ops = torch.ops.grpo_kernels
    out_of_place, in_place = backward or (ops.logits_logprobs_backward,
                                          ops.logits_logprobs_backward_)
    if inplace:
        in_place(logits, *args)
        return logits  # d logits now lives in the logits buffer (version counter bumped)
    return out_of_place(logits, *args)


def setup_linear(ctx, inputs, output):
    hidden, weight, bias, targets, temperature, grad_filter, backend, _ = inputs
    _, ent, lse = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
    ctx.config = (temperature, grad_filter, backend)


def linear_backward(ctx, g_logp, g_ent, _g_lse, backward=None):
    return (*linear_grads(ctx, g_logp, g_ent, backward), None, None, None, None, None)


def setup_logits(ctx, inputs, output):
    logits, targets, temperature, backend, _, inplace = inputs
    _, ent, lse = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, targets, lse, ent)
    ctx.config = (temperature, backend, inplace)


def logits_backward(ctx, g_logp, g_ent, _g_lse, backward=None):
    return logits_grads(ctx, g_logp, g_ent, backward), None, None, None, None, None


def loss_token_grads(ctx, g_loss):
    """(g_logp, g_entropy) [N] of a loss op: g_loss × the saved coefficients dloss/dlogp and
    dloss/dentropy (the latter empty when entropy_coef == 0)."""
    coef_logp, coef_ent = ctx.saved_tensors[-2:]
    if g_loss is None:
        return None, None
    g = g_loss.float()
    return coef_logp * g, (coef_ent * g if ctx.has_entropy_grad else None)


# ---- the loss ops: inputs (kernel tensors, targets, options, GRPO arguments) -> outputs (loss,
# metrics, lse, entropy, dloss/dlogp, dloss/dentropy); only the loss is differentiable.


def _save_loss(ctx, tensors, loss_args, output, n_inputs: int):
    """Saves (kernel tensors, targets, lse, ent, coef_logp, coef_ent); returns the params."""
    _, metrics, lse, ent, coef_logp, coef_ent = output
    _, params = unpack_loss_args(loss_args)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(metrics, lse, ent, coef_logp, coef_ent)
    ctx.has_entropy_grad = params.entropy_coef != 0.0
    ctx.n_inputs = n_inputs
    ctx.save_for_backward(*tensors, lse, ent, coef_logp, coef_ent)
    return params


def setup_linear_loss(ctx, inputs, output):
    hidden, weight, bias, targets, grad_filter, backend, *loss_args = inputs
    params = _save_loss(ctx, (hidden, weight, bias, targets), loss_args, output, len(inputs))
    ctx.config = (params.temperature, grad_filter, backend)


def linear_loss_backward(ctx, g_loss, *_):
    grads = linear_grads(ctx, *loss_token_grads(ctx, g_loss))
    return (*grads, *[None] * (ctx.n_inputs - len(grads)))


def setup_logits_loss(ctx, inputs, output):
    logits, targets, backend, inplace, *loss_args = inputs
    params = _save_loss(ctx, (logits, targets), loss_args, output, len(inputs))
    ctx.config = (params.temperature, backend, inplace)


def logits_loss_backward(ctx, g_loss, *_):
    grad = logits_grads(ctx, *loss_token_grads(ctx, g_loss))
    return (grad, *[None] * (ctx.n_inputs - 1))
