"""The three-pass route (`three_pass.py`) as autograd sees it: an eager autograd.Function for plain
eager calls, and the custom operator grpo_kernels::linear_grpo_loss_grad for everything that
must see an operator (torch.compile, export, dispatch modes, tensor subclasses other than
nn.Parameter), so that a compiled graph takes this route too.

    grpo_kernels::linear_grpo_loss_grad(hidden, weight, bias, targets, entropy_weights,
        temperature, backend, needs, compact, <the token-terms op's GRPO arguments>, logit_scale)
      -> (loss, policy_loss, logp, entropy, kl, ratio, d_hidden, d_weight, d_bias)

loss (0-dim) is the one differentiable output; its autograd formula multiplies the d_* outputs
(the gradients the forward computed, an empty tensor where `needs` says no) by the incoming
gradient. The eager Function hands the same tensors to autograd without a copy instead, and a
second backward of a retained graph recomputes them (`three_pass.recompute_grads`).
"""

from __future__ import annotations

import torch

from .autograd import N_GRPO_ARGS
from .custom_ops import TERMS_ARGS, direct
from .op_scalars import WithScalars, of_op
from .three_pass import (
    Saved,
    ThreePass,
    ThreePassLoss,
    grad_by_autograd,
    grad_in_op_body,
    loss_grad,
    recompute_grads,
)

F32 = torch.float32
torch.library.define(
    "grpo_kernels::linear_grpo_loss_grad",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, Tensor? entropy_weights, "
    f"Tensor temperature, str backend, bool[] needs, bool compact, {TERMS_ARGS}, "
    "Tensor? logit_scale=None) -> (Tensor loss, Tensor policy_loss, Tensor logp, Tensor entropy, "
    "Tensor kl, Tensor ratio, Tensor d_hidden, Tensor d_weight, Tensor d_bias)")


@torch.library.impl("grpo_kernels::linear_grpo_loss_grad", "default")
def _linear_grpo_loss_grad(hidden, weight, bias, targets, entropy_weights, temperature, backend,
                           needs, compact, *args):
    # five [N] tensors, then the hyperparameters as 0-d tensors (op_scalars.py): their values
    grpo_args = (*args[:5], *(of_op(a) for a in args[5:N_GRPO_ARGS]))
    temperature, logit_scale = of_op(temperature), of_op((tuple(args[N_GRPO_ARGS:]) + (None,))[0])
    out = loss_grad((hidden, weight, bias), targets, grpo_args, entropy_weights, needs, backend,
                    temperature, logit_scale, compact, differentiate=grad_in_op_body)
    grads = tuple(hidden.new_empty(0) if g is None else g for g in out.grads)
    return (out.loss, out.policy, out.logp, out.entropy, out.kl, out.ratio, *grads)


@torch.library.register_fake("grpo_kernels::linear_grpo_loss_grad")
def _linear_grpo_loss_grad_fake(hidden, weight, bias, targets, entropy_weights, temperature,
                                backend, needs, compact, *args):
    N = hidden.shape[0]
    scalars = [hidden.new_empty((), dtype=F32) for _ in range(2)]
    per_token = [hidden.new_empty(N, dtype=F32) for _ in range(4)]
    grads = [torch.empty_like(x) if x is not None and want else hidden.new_empty(0)
             for x, want in zip((hidden, weight, bias), needs)]
    return (*scalars, *per_token, *grads)


def _setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[1:])
    ctx.needs = [bool(n) for n in inputs[7]]
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(*output[6:])


def _backward(ctx, g, *_):
    if g is None:
        return (None,) * ctx.n_inputs
    grads = [g.to(x.dtype) * x if want else None for x, want in zip(ctx.saved_tensors, ctx.needs)]
    return (*grads, *[None] * (ctx.n_inputs - 3))


torch.library.register_autograd("grpo_kernels::linear_grpo_loss_grad", _backward,
                                setup_context=_setup)
LOSS_GRAD_OP = WithScalars(torch.ops.grpo_kernels.linear_grpo_loss_grad)  # Python numbers in


def linear_grpo_loss(head, ids, grpo_args, g_ent, backend: str, temperature: float,
                     logit_scale=None, compact: bool = True) -> ThreePass:
    """The three-pass loss of one call: `ThreePass` with `loss` differentiable w.r.t. the head's
    tensors that require grad, every other value detached and `grads` None. Arguments as
    `three_pass.loss_grad`. With grad mode off or nothing requiring grad, the forward-only
    route: the same call wanting no gradient (the chunks' GEMMs and row forward alone)."""
    hidden, weight, bias = head
    grad = torch.is_grad_enabled()  # off: the forward-only route (no d-logits, no products)
    needs = [grad and t is not None and t.requires_grad for t in head]
    if not direct(hidden, weight, bias):
        outputs = LOSS_GRAD_OP(
            hidden, weight, bias, ids, g_ent, temperature, backend, needs, compact, *grpo_args,
            logit_scale)
        return ThreePass(*outputs[:6], None, None, None)
    out = loss_grad(head, ids, grpo_args, g_ent, needs, backend, temperature, logit_scale,
                    compact, differentiate=grad_by_autograd)
    if not any(needs):  # forward only: nothing for autograd to hold
        return out._replace(grads=None)
    # not the gradients: autograd takes those as .grad; a copy of logp (N floats), which the
    # caller may change in place, for the target column's 1 - p (`recompute_grads`)
    stats = (out.lse, out.entropy, out.coef, out.logp.detach().clone())

    def recompute(hidden, weight, bias):
        return recompute_grads((hidden, weight, bias), ids, stats, g_ent, needs, backend,
                               temperature, logit_scale)

    saved = Saved(out.grads, recompute)
    value = out.loss
    out = out._replace(grads=None)  # only `saved` refers to the gradients now
    return out._replace(loss=ThreePassLoss.apply(value, hidden, weight, bias, saved))
