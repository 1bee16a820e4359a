"""The GRPO loss of a linear head with its gradient computed in the forward (chunked backend).

When the loss is what a training step differentiates (a scalar, not the per-token terms) and
every token's loss reads its own log-prob only, the chunked path can compute each row chunk's
gradient as soon as that chunk's logits exist (`chunked/loss_grad.py`): three [N, V, D] matrix
products (logits, d hidden, d weight) instead of the four of a forward that keeps per-token
statistics and a backward that recomputes the logits. The backward then only scales the saved
gradients by the loss's incoming gradient.

`linear_loss_route` decides, in one place, whether a call takes this path and says why
(`Route`); `functional.fused_linear_grpo_loss` asks it and otherwise runs the token-terms or
selective log-prob route as before. `loss_and_metrics` computes what `functional` would:
Σ weight·ℓ plus the entropy bonus, and the metrics of `grpo_math.grpo_metrics`.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch
from torch._C import _functions

from ..chunked import launchers as chunked
from ..chunked.loss_grad import CPU_BUDGET_BYTES, chunk_rows, linear_loss_grad
from ..chunked.tiles import compute_dtype
from ..grpo_math import entropy_bonus_weights, grpo_metrics, per_token_loss
from ..params import GRPOParams, TokenLossArgs
from ..token_layouts import layout_of
from ..validation import LossInputs, check_finite_advantages, check_token_id_values
from .custom_ops import direct

ENV = "GRPO_KERNELS_THREE_PASS"  # "0" turns the path off (the four-pass route runs)
ONCE = b"trying to differentiate twice a function that was marked with @once_differentiable"


_LOG = logging.getLogger("grpo_kernels")
_LOGGED: set = set()  # the routes already logged in this process


class Route(NamedTuple):
    three_pass: bool
    reason: str

    def log_once(self) -> Route:
        """One INFO line on the "grpo_kernels" logger the first time a route (path and reason)
        is taken in this process: which path the linear-head loss ran, and why."""
        if self not in _LOGGED:
            _LOGGED.add(self)
            _LOG.info("grpo_kernels: linear-head loss on the %s path: %s",
                      "three-pass" if self.three_pass else "four-pass", self.reason)
        return self


def linear_loss_route(hidden, weight, bias, backend: str, params: GRPOParams, softcap=None,
                      per_token_outputs: bool = False) -> Route:
    """Does a linear-head GRPO loss call take the three-pass path, and why (or why not)?
    hidden [N, D], weight [V, D], bias [V] | None: the tensors the head's op would get."""
    def no(reason):
        return Route(False, reason)

    if per_token_outputs:
        return no("per-token outputs asked for (return_terms): they stay differentiable")
    if backend != "chunked":
        return no(f"backend {backend!r}: the token-terms op runs")
    if os.environ.get(ENV, "1") == "0":
        return no(f"{ENV}=0")
    if params.needs_whole_sequences:
        return no("the loss needs whole sequences or the batch before any token's loss")
    if softcap is not None:
        return no("soft cap: the capped head keeps its four-pass path")
    if not torch.is_grad_enabled():
        return no("no gradient: grad mode is off")
    if not any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return no("no gradient: neither the hidden states nor the head require grad")
    if not direct(hidden, weight, bias):
        return no("traced, under a dispatch or function mode, or tensor subclasses: the "
                  "operators run")
    rows, why = chunk_rows(hidden.shape[0], *weight.shape, weight.dtype, CPU_BUDGET_BYTES,
                           dtype=compute_dtype(hidden, weight, bias), want_dw=weight.requires_grad)
    if rows is None:
        return no(why)
    return Route(True, "scalar loss with a gradient, token-level loss, chunked backend")


class _Saved:
    """The forward's gradients for the first backward, and what a later backward (of a graph
    kept with retain_graph=True) recomputes them from with the chunked backward launcher."""

    def __init__(self, grads, recompute):
        self.grads, self.recompute = grads, recompute

    def take(self, ctx, g):
        grads, self.grads = self.grads, None  # handed over: nothing is held after a backward
        if grads is None:
            grads = self.recompute(*ctx.saved_tensors)
        if not bool(g == 1):
            grads = tuple(None if x is None else x.mul_(g) for x in grads)
        return grads


class _ThreePassLoss(torch.autograd.Function):
    """The loss value (0-dim) as a function of (hidden, weight, bias) whose gradients are
    already computed: backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, value, hidden, weight, bias, saved: _Saved):
        ctx.saved = saved
        ctx.save_for_backward(hidden, weight, bias)  # for a recompute (version-checked)
        return value.clone()

    @staticmethod
    def backward(ctx, g):
        with torch.no_grad():
            grads = ctx.saved.take(ctx, g)
        if torch.is_grad_enabled():  # create_graph=True
            grads = _once_differentiable(grads)
        return None, *grads, None


def _once_differentiable(grads):
    """The gradients as outputs of a node that raises when differentiated, as the operators'
    once-differentiable backward returns them under create_graph=True (no second derivative
    goes through the linear head on either path)."""
    given = [x for x in grads if x is not None]
    if not given:
        return grads
    error = _functions.DelayedError(ONCE, len(given))
    out = error(*[x.detach().requires_grad_() for x in given])
    out = iter(out if isinstance(out, tuple) else (out,))
    return tuple(None if x is None else next(out) for x in grads)


def loss_and_metrics(head, ids, inputs: LossInputs, params: GRPOParams, grpo_args,
                     logit_scale=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of a call `linear_loss_route` sent here. head = (hidden [N, D], weight
    [V, D], bias [V] | None), ids [N]; grpo_args: `functional._terms_args` (the [N] weights,
    advantages, old/ref log-probs and rollout ratios, then TokenLossArgs' values)."""
    hidden, weight, bias = head
    check_token_id_values("completion_ids", ids, weight.shape[0], "weight.shape[0]")
    check_finite_advantages(inputs.advantages)
    N = hidden.shape[0]
    mask = inputs.mask.reshape(-1)  # [N], the kernels' token order
    busy = mask != 0  # tokens with a mask of 0 weigh nothing in the loss and in the metrics
    rows = None if bool(busy.all()) else busy.nonzero().squeeze(1)
    g_ent = None
    if params.entropy_coef != 0.0:  # d(entropy bonus)/d entropy per token
        g_ent = entropy_bonus_weights(inputs.mask, params.entropy_coef).reshape(-1)
    terms = _TokenTerms(grpo_args, rows, N)
    needs = tuple(t is not None and t.requires_grad for t in head)
    out = linear_loss_grad(hidden, weight, bias, ids, params.temperature, terms.d_logp, g_ent,
                           rows, needs, CPU_BUDGET_BYTES, logit_scale)
    value = terms.weighted_loss.sum()  # Σ weight·ℓ
    full = terms.full
    ent = full(out.entropy, 0.0)
    if g_ent is not None:  # + the entropy bonus, as grpo_math.finish_loss adds it
        value = value + (g_ent * ent).sum()

    grads, lse, coef = (out.d_hidden, out.d_weight, out.d_bias), out.lse, out.coef

    def recompute(hidden, weight, bias):  # the chunked backward of the same gradients
        return chunked.linear_logprob_backward(
            hidden, weight, bias, ids, full(lse, 0.0), ent, full(coef, 0.0), g_ent,
            params.temperature, needs, logit_scale=logit_scale)

    # only _Saved refers to the gradients now: autograd takes them as .grad without a copy
    out = None
    loss = _ThreePassLoss.apply(value, hidden, weight, bias, _Saved(grads, recompute))
    shape = inputs.mask.shape
    kl = None if params.beta == 0.0 else full(terms.kl, 0.0).reshape(shape)
    metrics = grpo_metrics(ent.reshape(shape), full(terms.ratio, 1.0).reshape(shape), kl,
                           inputs.advantages, inputs.mask, params,
                           layout_of(inputs.mask, inputs.cu_seqlens), old_logps=inputs.old_logps)
    return loss, metrics


class _TokenTerms:
    """The per-token GRPO loss on the computed rows (`rows`, in their order): `d_logp` is the
    launcher's callback; it keeps weight·ℓ, the ratio and the KL of every chunk ([Na] each)."""

    def __init__(self, grpo_args, rows, N):
        weights, advantages, old, ref, isr, *values = grpo_args
        self.rule = TokenLossArgs.of_op_args(values)
        self.rows, self.N = rows, N
        self.args = [x if x is None or rows is None else x.index_select(0, rows)
                     for x in (weights, advantages, old, ref, isr)]
        Na = N if rows is None else rows.numel()
        self.weighted_loss, self.ratio, self.kl = (
            torch.zeros(Na, dtype=torch.float32, device=weights.device) for _ in range(3))

    def d_logp(self, r0: int, r: int, logp: torch.Tensor) -> torch.Tensor:
        """d(weight·ℓ)/d logp [r] for the computed rows r0:r0 + r: token n's ℓ reads logp[n]
        only, so the gradient of their sum is the per-token derivative."""
        weights, advantages, old, ref, isr = (None if x is None else x[r0:r0 + r]
                                              for x in self.args)
        lp = logp.detach().requires_grad_()
        with torch.enable_grad():
            loss, ratio, kl = per_token_loss(lp, old, ref, advantages, weights, self.rule, isr)
            weighted = weights * loss
            (coef,) = torch.autograd.grad(weighted.sum(), lp)
        self.weighted_loss[r0:r0 + r] = weighted.detach()
        self.ratio[r0:r0 + r] = ratio
        if kl is not None:
            self.kl[r0:r0 + r] = kl.detach()
        return coef

    def full(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """[Na] on the computed rows -> [N], `fill` elsewhere."""
        if self.rows is None:
            return x
        return x.new_full((self.N,), fill).index_copy_(0, self.rows, x)
