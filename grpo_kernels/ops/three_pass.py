"""The three-pass route's computation: a linear-head GRPO loss with its gradient formed in the
forward.

For a loss of per-token terms L = Σ_n t_n(logp_n) + Σ_n g_H,n·H_n, where t_n = weight_n·ℓ_n
reads token n's own log-prob (the token-level GRPO losses) and g_H is the entropy bonus's fixed
per-token coefficient, each row of dL/dlogits depends on its own row only:

    d logits_n = [c_n·(onehot_n - p_n) - g_H,n·p_n·(ln p_n + H_n)] / τ,   c_n = dt_n/dlogp_n

So once a chunk of rows holds its logits over the whole vocabulary, its log-sum-exp, log-probs,
GRPO terms and d-logits are known, and the chunk goes straight into d hidden = d logits @ W and
d W += d logits^T @ h: three [N, V, D] products in all (logits, d hidden, d weight) where a
forward that keeps statistics and a backward that recomputes the logits take four. The backward
then only scales the saved gradients by the loss's incoming gradient.

Backends (`route.py` decides whether a call comes here):
    chunked  `chunked.loss_grad.linear_loss_grad`: PyTorch tiles; c_n from `grpo_math`'s
             per-token loss, differentiated per chunk (`_TokenTerms`)
    triton   `kernels.linear_loss_grad.linear_loss_grad`: library GEMMs (cuBLAS on CUDA) around
             the Triton row kernels, whose GRPO epilogue computes c_n in the kernel; a kernel
             that fails to build runs the chunked computation instead (`fallback.py`)

Rows: tokens whose weight and entropy coefficient are both 0 (padding) are never computed when
the call compacts them. Finding them is a host read of their count, which on CUDA waits for the
queue, so a CUDA call compacts padded [B, T] batches only; packed batches hold no padding (a
token masked inside one costs its rows of the products, and gives zeros). No other host read on
CUDA: the value checks are device checks (`value_checks.py`).

Two ways in (`loss_and_metrics`): a plain eager call runs `_ThreePassLoss`, an autograd.Function
whose backward hands the forward's gradient tensors to autograd without a copy; a traced call
(torch.compile), a call under a dispatch mode and tensor subclasses other than nn.Parameter go
through the custom operator grpo_kernels::linear_grpo_loss_grad (its autograd formula scales
the same gradients), so a compiled graph takes this route too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import value_checks
from ..chunked import loss_grad as chunked_loss_grad
from ..grpo_math import per_token_loss
from ..kernels import linear_loss_grad as triton_loss_grad
from ..kernels.epilogue import epilogue_args
from ..params import TokenLossArgs
from . import fallback
from .autograd import once_differentiable
from .backends import IMPLS
from .launch import LinearHeadOp, epilogue_variant
from .route import chunk_budget_bytes


class ThreePass(NamedTuple):
    """What one three-pass call computes; per-token values [N] float32 in the kernels' token
    order (fills at rows not computed: 0, and 1 for the ratio)."""

    loss: torch.Tensor  # 0-dim: Σ weight·ℓ + Σ g_H·H
    policy: torch.Tensor  # 0-dim: Σ weight·ℓ
    logp: torch.Tensor
    entropy: torch.Tensor
    kl: torch.Tensor  # 0 where beta == 0
    ratio: torch.Tensor
    grads: tuple  # (d hidden [N, D], d weight [V, D], d bias [V]): input dtypes, None unwanted
    lse: torch.Tensor  # what a second backward recomputes the gradients from
    coef: torch.Tensor  # c = dt/dlogp


# ---- the per-token math of the chunked backend ------------------------------------------------


def grad_by_autograd(f, x):
    """(df/dx, aux) of f(x) -> (0-dim, aux) with torch.autograd: in an eager forward, also
    under saved-tensor hooks (where torch.func transforms refuse to run)."""
    x = x.detach().requires_grad_()
    with torch.enable_grad():
        total, aux = f(x)
        (grad,) = torch.autograd.grad(total, x)
    return grad, tuple(None if a is None else a.detach() for a in aux)


def grad_in_op_body(f, x):
    """The same inside an operator's body, which runs below autograd and, under a dispatch mode
    or in a compiled graph, below torch.func's keys too: the derivative of this small per-token
    function runs with the dispatcher's default key sets (nothing excluded), as it would
    outside the operator. Only tensors made here and detached inputs take part."""
    include = torch._C._dispatch_tls_local_include_set()
    nothing = include - include  # an empty key set
    with torch._C._ForceDispatchKeyGuard(include, nothing):
        return grad_by_autograd(f, x)


class _TokenTerms:
    """The per-token GRPO loss on the computed rows (`rows`, in their order): `d_logp` is the
    chunked launcher's callback; it keeps weight·ℓ, the ratio and the KL of every chunk."""

    def __init__(self, grpo_args, rows, differentiate):
        weights, advantages, old, ref, isr, *values = grpo_args
        self.rule = TokenLossArgs.of_op_args(values)
        self.differentiate = differentiate
        self.args = [x if x is None or rows is None else x.index_select(0, rows)
                     for x in (weights, advantages, old, ref, isr)]
        Na = self.args[0].shape[0]
        self.weighted_loss, self.ratio, self.kl = (
            torch.zeros(Na, dtype=torch.float32, device=weights.device) for _ in range(3))

    def d_logp(self, r0: int, r: int, logp: torch.Tensor) -> torch.Tensor:
        """d(weight·ℓ)/d logp [r] for the computed rows r0:r0 + r: token n's ℓ reads logp[n]
        only, so the gradient of their sum is the per-token derivative."""
        weights, advantages, old, ref, isr = (None if x is None else x[r0:r0 + r]
                                              for x in self.args)

        def total(lp):
            loss, ratio, kl = per_token_loss(lp, old, ref, advantages, weights, self.rule, isr)
            weighted = weights * loss
            return weighted.sum(), (weighted, ratio) + (() if kl is None else (kl,))

        coef, (weighted, ratio, *kl) = self.differentiate(total, logp)
        self.weighted_loss[r0:r0 + r] = weighted
        self.ratio[r0:r0 + r] = ratio
        if kl:
            self.kl[r0:r0 + r] = kl[0]
        return coef


# ---- one call ---------------------------------------------------------------------------------


def _rows(weights, g_ent, compact: bool):
    """int64 indices of the tokens to compute, or None for all of them (see the module
    docstring: on CUDA, compacting is one host read)."""
    if not compact:
        return None
    busy = weights != 0 if g_ent is None else (weights != 0) | (g_ent != 0)
    rows = busy.nonzero().squeeze(1)
    return None if rows.shape[0] == weights.shape[0] else rows


def _full(x, rows, N: int, fill: float):
    """[Na] on the computed rows -> [N], `fill` elsewhere."""
    return x if rows is None else x.new_full((N,), fill).index_copy_(0, rows, x)


def _chunked(head, ids, grpo_args, g_ent, rows, needs, temperature, logit_scale, budget,
             differentiate):
    hidden, weight, bias = head
    terms = _TokenTerms(grpo_args, rows, differentiate)
    out = chunked_loss_grad.linear_loss_grad(
        hidden, weight, bias, ids, temperature, terms.d_logp, g_ent, rows, needs,
        budget_bytes=budget, logit_scale=logit_scale)
    stats = (out.logp, out.entropy, out.lse, out.coef)
    return stats, (terms.weighted_loss, terms.kl, terms.ratio), (
        out.d_hidden, out.d_weight, out.d_bias)


def _triton(head, ids, ep, g_ent, rows, needs, temperature, logit_scale, budget):
    """ep: the epilogue bundle of the computed rows (their [Na] inputs, four [Na] outputs)."""
    hidden, weight, bias = head
    pick = lambda x: x if x is None or rows is None else x.index_select(0, rows)  # noqa: E731
    out = triton_loss_grad.linear_loss_grad(
        pick(hidden).contiguous(), weight, bias, pick(ids), temperature, ep, pick(g_ent), needs,
        budget_bytes=budget, logit_scale=logit_scale)
    lossw, _, kl, ratio = ep.outputs
    d_hidden = out.d_hidden
    if d_hidden is not None and rows is not None:
        d_hidden = torch.zeros_like(hidden).index_copy_(0, rows, d_hidden)
    return (out.logp, out.entropy, out.lse, out.coef), (lossw, kl, ratio), (
        d_hidden, out.d_weight, out.d_bias)


def loss_grad(head, ids, grpo_args, g_ent, needs, backend: str, temperature: float,
              logit_scale=None, compact: bool = True, differentiate=grad_by_autograd
              ) -> ThreePass:
    """One three-pass call. head = (hidden [N, D], weight [V, D], bias [V] | None), ids [N]
    int64, grpo_args: the token-terms op's GRPO arguments ([N] float32 weights, advantages,
    old/ref log-probs, rollout ratios, then TokenLossArgs' values), g_ent [N] float32 or None,
    needs: (d hidden, d weight, d bias) wanted. differentiate: `grad_by_autograd` or
    `grad_in_op_body` (the chunked backend's per-token derivative, see their docstrings)."""
    hidden, weight, bias = head
    N, V = hidden.shape[0], weight.shape[0]
    failed = value_checks.check_ids_and_advantages(ids, V, grpo_args[1])
    if failed is not None:  # CUDA: the kernels must not read out of bounds before the error
        ids = ids.clamp(0, V - 1)
    rows = _rows(grpo_args[0], g_ent, compact)
    budget = chunk_budget_bytes(backend)
    with torch.no_grad():
        if rows is not None and rows.numel() == 0:  # every token masked: nothing to compute
            z = hidden.new_zeros(0, dtype=torch.float32)
            stats, terms = (z,) * 4, (z,) * 3
            grads = tuple(torch.zeros_like(x) if x is not None and want else None
                          for x, want in zip(head, needs))
        else:
            stats, terms, grads = _compute(head, ids, grpo_args, g_ent, rows, needs, backend,
                                           temperature, logit_scale, budget, differentiate)
        full = lambda x, fill=0.0: _full(x, rows, N, fill)  # noqa: E731
        logp, ent, lse, coef = (full(x) for x in stats)
        lossw, kl, ratio = full(terms[0]), full(terms[1]), full(terms[2], 1.0)
        policy = lossw.sum()
        # a tensor of its own: an operator's outputs may not alias one another
        loss = policy.clone() if g_ent is None else policy + (g_ent * ent).sum()
        loss = value_checks.poison(loss, failed)
    return ThreePass(loss, policy, logp, ent, kl, ratio, grads, lse, coef)


def _compute(head, ids, grpo_args, g_ent, rows, needs, backend, temperature, logit_scale,
             budget, differentiate):
    def on_torch():
        return _chunked(head, ids, grpo_args, g_ent, rows, needs, temperature, logit_scale,
                        budget, differentiate)

    if backend == "chunked":
        return on_torch()
    weights, advantages, old, ref, isr, *values = grpo_args
    pick = lambda x: x if x is None or rows is None else x.index_select(0, rows)  # noqa: E731
    rule = TokenLossArgs.of_op_args(values)
    ep = epilogue_args(rule, pick(weights), pick(advantages), pick(old), pick(ref), pick(isr))
    op = LinearHeadOp(IMPLS["triton"], temperature, logit_scale=logit_scale)
    what = "three-pass" if any(needs) else "forward-only"  # the forward-only route: no grads
    key = op.variant(epilogue_variant(rule, ep.flags).replace("forward", what, 1), head)
    return fallback.run(key, head[0].device, lambda: _triton(
        head, ids, ep, g_ent, rows, needs, temperature, logit_scale, budget), on_torch)


def recompute_grads(head, ids, stats, g_ent, needs, backend, temperature, logit_scale=None
                    ) -> tuple:
    """The same input gradients from the saved statistics stats = (lse, entropy, coef, logp)
    [N] (a second backward of a graph kept with retain_graph). The recomputed logits' GEMMs
    round unlike the forward's chunk, so p is read against statistics over the recomputed
    logits. Triton: the three-pass passes again from coef (`kernels.linear_loss_grad.
    recompute_grads`: each chunk's row forward gives m and log s, and logp, of its own logits).
    Chunked: the backward launcher; its target column's gradient from the forward's logp (1 - p
    of a dominant target, not through the lse), every other column's p against S over its own
    recomputed logits (`own_sums`)."""
    lse, ent, coef, logp = stats

    def on_torch():
        op = LinearHeadOp(IMPLS["chunked"], temperature, logit_scale=logit_scale)
        return op.backward(head, ids, lse, ent, coef, g_ent, needs, logp=logp,
                           own_sums=_whole_head)

    if backend == "chunked":
        return on_torch()
    hidden, weight, bias = head
    op = LinearHeadOp(IMPLS["triton"], temperature, logit_scale=logit_scale)
    return fallback.run(op.variant("three-pass-recompute", head), hidden.device, lambda: (
        triton_loss_grad.recompute_grads(
            hidden.contiguous(), weight, bias, ids, temperature, coef, g_ent, needs,
            budget_bytes=chunk_budget_bytes(backend), logit_scale=logit_scale)), on_torch)


def _whole_head(sums):
    """A whole head's S over the recomputed logits is the S to read p with."""
    return sums


# ---- the eager autograd.Function ----------------------------------------------------------------


class Saved:
    """The forward's gradients for the first backward, and what a later backward (of a graph
    kept with retain_graph=True) recomputes them from."""

    def __init__(self, grads, recompute):
        self.grads, self.recompute = grads, recompute

    def take(self, ctx, g):
        grads, self.grads = self.grads, None  # handed over: nothing is held after a backward
        if grads is None:
            grads = self.recompute(*ctx.saved_tensors)
        # on CUDA the factor is not read on the host (that would wait for the queue)
        if g.device.type == "cuda" or not bool(g == 1):
            grads = tuple(None if x is None else x.mul_(g.to(x.dtype)) for x in grads)
        return grads


class ThreePassLoss(torch.autograd.Function):
    """The loss value (0-dim) as a function of (hidden, weight, bias) whose gradients are
    already computed: backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, value, hidden, weight, bias, saved: Saved):
        ctx.saved = saved
        ctx.save_for_backward(hidden, weight, bias)  # for a recompute (version-checked)
        return value.clone()

    @staticmethod
    def backward(ctx, g):
        value_checks.raise_ready()
        with torch.no_grad():
            grads = ctx.saved.take(ctx, g)
        return None, *once_differentiable(grads), None  # create_graph=True: no second order
