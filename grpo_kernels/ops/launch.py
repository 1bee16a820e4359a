"""The launchers of one backend bound to an op's options, and the eager body of the GRPO
token-terms ops.

`LinearHeadOp` / `LogitsOp`: forward gives (logp [N], entropy [N], lse [N]); backward turns
per-token gradients (g_logp, g_entropy [N]) into input gradients. Triton launches go through
`fallback.run`, so a kernel that fails to compile or launch is replaced by the chunked PyTorch
launcher of the same contract.

`grpo_token_terms`: the body of the token-terms ops (`custom_ops.py`). On Triton the forward
kernel runs the GRPO epilogue (`kernels/epilogue.py`) on each token's log-prob as it is produced
and writes weight·ℓ, weight·dℓ/dlogp, kl and the ratio per token; a kernel that fails to build
re-runs on the chunked path (under its own variant key, `epilogue_variant`), and `grpo_math`
gives the same four per-token values.
"""

from __future__ import annotations

import torch

from .. import chunked
from ..grpo_math import per_token_loss
from ..kernels.epilogue import (
    BIAS_CORRECT_KL,
    HAS_DELTA,
    HAS_ISR,
    HAS_KL,
    HAS_OLD,
    epilogue_args,
)
from ..params import TokenLossArgs
from . import fallback
from .op_scalars import of_op


class BoundOp:
    """One selective log-prob op on one backend's launchers (`impl`: the Triton launchers or
    `chunked`). Triton launches go through `fallback.run` under their variant's key
    (`variant`): a kernel that fails to compile or launch is replaced by the chunked launcher of
    the same contract, and the op stays there (its backward runs on the backend its forward ran
    on; across ops, a backward follows its plain forward's variant)."""

    family = ""

    def __init__(self, impl, temperature: float, softcap: float | None = None,
                 logit_scale: float | None = None):
        # an operator's body gets the values as 0-d tensors, an eager call as floats
        self.impl, self.temperature = impl, of_op(temperature)
        # the logit transform z = cap(s·y) before the temperature (kernels/logit_transform.py);
        # given to the launchers only when set, so that they keep their plain calls otherwise
        self.transform = {k: of_op(v) for k, v in (("softcap", softcap),
                                                   ("logit_scale", logit_scale))
                          if v is not None}

    @property
    def on_triton(self) -> bool:
        return self.impl is not chunked

    def on_torch(self):
        """The same op on the chunked PyTorch backend."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__, impl=chunked)
        return other

    def head_options(self, tensors) -> tuple[str, ...]:
        """The options of this op and its inputs that select a differently compiled kernel, for
        its forward and backward alike (a variant key's last parts)."""
        return tuple(self.transform)

    def variant(self, what: str, tensors, *extra: str) -> str:
        """The fallback key of this op's kernel `what` on these inputs (fallback.variant)."""
        x = tensors[0]
        return fallback.variant(self.family, what, x.device, x.dtype,
                                *self.head_options(tensors), *extra)

    def _launch(self, tensors, what, extra, name, *args, torch_kw=None, triton_kw=None, **kw):
        """Launcher `name` on this op's backend; on Triton through `fallback.run` under the key
        of (`what`, the inputs `tensors`, the backward's `extra` options). torch_kw: keywords
        for the chunked launcher only (also when it replaces a Triton kernel that failed);
        triton_kw: for the Triton launcher only."""
        if not self.on_triton:
            return getattr(chunked, name)(*args, **kw, **(torch_kw or {}))

        def on_torch():
            self.impl = chunked  # backward follows the forward's backend
            return getattr(chunked, name)(*args, **kw, **(torch_kw or {}))

        follows = self.variant("forward", tensors) if what == "backward" else None
        return fallback.run(self.variant(what, tensors, *extra), tensors[0].device,
                            lambda: getattr(self.impl, name)(*args, **kw, **(triton_kw or {})),
                            on_torch, follows)


class LinearHeadOp(BoundOp):
    """z = cap(s·(hidden [N, D] @ weight [V, D]^T + bias [V])) / τ, on one backend's launchers
    (cap(s·y) = y without softcap and logit_scale). grad_filter: None (exact backward) or the
    resolved gradient-filtering eps."""

    family = "linear-head"

    def __init__(self, impl, temperature: float, grad_filter: float | None = None,
                 softcap: float | None = None, logit_scale: float | None = None):
        super().__init__(impl, temperature, softcap, logit_scale)
        self.grad_filter = grad_filter

    def head_options(self, tensors) -> tuple[str, ...]:
        hidden, weight, bias = tensors
        head = "" if weight.dtype == hidden.dtype else "head=" + fallback.dtype_name(weight.dtype)
        return head, "" if bias is None else "bias", *self.transform

    def forward(self, targets, epilogue, hidden, weight, bias, keep=None, lse_sum=None):
        """keep: a dict for the chunked launcher's kept logits tile (chunked backend only);
        lse_sum: a float32 [N] tensor that the chunked launcher writes its S into
        (`chunked.linear_launchers.linear_logprob_forward`), also when it replaces a Triton
        kernel."""
        if epilogue is not None:  # a failure here is handled by `grpo_token_terms`
            return self.impl.linear_logprob_forward(hidden, weight, bias, targets,
                                                    self.temperature, epilogue=epilogue,
                                                    **self.transform)
        extra = {} if keep is None or self.on_triton else {"keep": keep}
        return self._launch((hidden, weight, bias), "forward", (), "linear_logprob_forward",
                            hidden, weight, bias, targets, self.temperature, **extra,
                            **self.transform, torch_kw=_torch_kw(lse_sum=lse_sum))

    def backward(self, inputs, targets, lse, ent, g_logp, g_ent, needs, kept=None,
                 shard_targets: bool = False, logp=None, lse_sum=None, own_sums=None):
        """shard_targets: a vocabulary shard's backward (grpo_kernels/parallel), where an id
        outside [0, V) is another shard's and adds no one-hot term. The Triton kernels compare
        column ids, so only the chunked launcher is told. logp: None or the forward's
        log-probs [N], from which the chunked launcher takes the target column's gradient
        (precise 1 - p of a dominant target); the Triton kernels read the lse. lse_sum: None or
        the chunked forward's S [N], from which it reads every column's p (precise p of a
        dominant token, target or not). own_sums: None or a function of the S [Na] the chunked
        launcher forms over its own recomputed logits (`chunked.tiles.tile_sums`) giving the S
        it reads p with, in place of lse_sum (a backward whose forward's GEMM rounded
        otherwise, as the three-pass route's)."""
        hidden, weight, bias = inputs
        extra = {} if not kept or self.on_triton else {"kept": kept}
        wanted = [n for n, need, x in zip(("hidden", "weight", "bias"), needs, inputs)
                  if need and x is not None]
        options = ("d=" + "+".join(wanted), "" if g_ent is None else "g_entropy",
                   "" if self.grad_filter is None else "grad_filter")
        return self._launch(inputs, "backward", options, "linear_logprob_backward", hidden,
                            weight, bias, targets, lse, ent, g_logp, g_ent, self.temperature,
                            needs=tuple(needs), grad_filter=self.grad_filter, **extra,
                            **self.transform,
                            torch_kw=_torch_kw(shard_targets=shard_targets or None,
                                               logp=logp, lse_sum=lse_sum,
                                               own_sums=own_sums))


def _torch_kw(**kw) -> dict | None:
    """The given (not None) keywords for the chunked launcher only, or None."""
    return {k: v for k, v in kw.items() if v is not None} or None


class LogitsOp(BoundOp):
    """z = cap(s·logits [B, T, V]) / τ (the logits as given without softcap and logit_scale).
    With `inplace`, d logits overwrites the logits buffer."""

    family = "logits"

    def __init__(self, impl, temperature: float, inplace: bool = False,
                 softcap: float | None = None, logit_scale: float | None = None):
        super().__init__(impl, temperature, softcap, logit_scale)
        self.inplace = inplace

    def forward(self, targets, epilogue, logits, keep=None):
        """(logp, entropy, lse, lse_terms), float32 [B·T] each but lse_terms [2, B·T]: the
        lse's terms (m, log s) as the Triton forward formed them (lse = m + log s), with which
        its backward reads p as that forward did; (lse, 0) where the chunked launcher ran.
        keep: a dict for the chunked launcher's per-token statistics (chunked backend only)."""
        terms = logits.new_empty(2, targets.shape[0], dtype=torch.float32)
        if epilogue is not None:  # a failure here is handled by `grpo_token_terms`
            # padding (weight 0) is not read: its log-prob and entropy are 0, its lse and m
            # NaN, which the backward resolves (`skipped_rows`) should such a row get a gradient
            out = self.impl.logits_logprob_forward(logits, targets, self.temperature,
                                                   epilogue=epilogue, skip_zero_weight=True,
                                                   split_out=tuple(terms), **self.transform)
            return (*out, terms)
        extra = {} if keep is None or self.on_triton else {"keep": keep}
        out = self._launch((logits,), "forward", (), "logits_logprob_forward", logits,
                           targets, self.temperature, **extra, **self.transform,
                           triton_kw={"split_out": tuple(terms)})
        if not self.on_triton:  # the chunked launcher (also in place of a failed kernel)
            terms[0].copy_(out[2])
            terms[1].zero_()
        return (*out, terms)

    def backward(self, inputs, targets, lse, ent, g_logp, g_ent, needs, kept=None, logp=None,
                 lse_terms=None):
        """logp: None or the forward's log-probs [B·T], from which the Triton kernel takes the
        target column's 1 - p (the chunked launcher has the forward's statistics in `kept`).
        lse_terms: None or the forward's (m, log s) [2, B·T] (`forward`), against which the
        Triton kernel reads every other column's p."""
        (logits,) = inputs
        if not needs[0]:
            return (None,)
        options = ("" if g_ent is None else "g_entropy", "inplace" if self.inplace else "")
        extra = {} if not kept or self.on_triton else {"kept": kept}
        dx = self._launch(inputs, "backward", options, "logits_logprob_backward", logits,
                          targets, lse, ent, g_logp, g_ent, self.temperature,
                          out=logits if self.inplace else None, skipped_rows=True, **extra,
                          **self.transform,
                          triton_kw=_torch_kw(logp=logp, split=None if lse_terms is None
                                              else tuple(lse_terms)))
        if self.inplace:
            # the kernel wrote through a raw pointer: bump the version so that any other
            # autograd node that saved these logits fails loudly instead of using gradients
            increment = getattr(torch.autograd.graph, "increment_version", None)
            if increment is not None:
                increment(logits)
        return (dx,)


# ---- the GRPO token-terms ops' body ------------------------------------------------------------

# The epilogue's option bits (kernels/epilogue.py) as a variant key names them: each is a
# constexpr, so each combination is its own compiled kernel.
EPILOGUE_OPTIONS = (("old", HAS_OLD), ("delta", HAS_DELTA), ("kl", HAS_KL),
                    ("bias_correct_kl", BIAS_CORRECT_KL), ("isr", HAS_ISR))


def epilogue_variant(rule: TokenLossArgs, flags: int) -> str:
    """What a forward with the GRPO epilogue computes, as its variant key says it: the objective
    (its kernel's LOSS_KIND) and the option flags on, e.g. "forward+epilogue:cispo+old+kl"."""
    on = [name for name, bit in EPILOGUE_OPTIONS if flags & bit.value]
    return "+".join([f"forward+epilogue:{rule.spec.objective.name}", *on])


def grpo_token_terms(op: BoundOp, targets, tensors, rule: TokenLossArgs, weights, advantages,
                     old_logps=None, ref_logps=None, importance_sampling_ratio=None):
    """Token-level GRPO on a bound op: (logp, entropy, lse, weight·ℓ, weight·dℓ/dlogp, kl,
    ratio), each [N] float32 (kl is 0 when beta == 0), then the logits op's lse_terms
    [2, N] (`LogitsOp.forward`).

    targets [N]; tensors: the op's inputs (hidden, weight, bias) or (logits,); the GRPO inputs
    are [N] float32 in the kernels' token order, weights = grpo_math.token_weights flattened.
    On Triton the forward kernel's epilogue computes the four per-token values. On the chunked
    backend, or where the Triton kernel failed to build (then once more unfused, see
    fallback.py), `grpo_math.per_token_loss` does, and torch.func.grad gives its derivative:
    token n's ℓ depends on logp[n] alone, so the gradient of Σ weight·ℓ is the per-token
    derivative. That branch runs eagerly only (inside the operator's body)."""
    if op.on_triton:
        epilogue = epilogue_args(rule, weights, advantages, old_logps, ref_logps,
                                 importance_sampling_ratio)
        key = op.variant(epilogue_variant(rule, epilogue.flags), tensors)
        if not fallback.use_fallback(key):
            try:
                logp, ent, lse, *terms = op.forward(targets, epilogue, *tensors)
            except Exception as exc:
                # the epilogue runs only inside the Triton forward: a kernel that fails to
                # compile or launch re-runs unfused on the chunked PyTorch backend
                if not fallback.note_failure(exc, key, tensors[0].device):
                    raise
            else:
                fallback.succeeded(key)
                return (logp, ent, lse, *epilogue.outputs, *terms)
        op = op.on_torch()
    logp, ent, lse, *terms = op.forward(targets, None, *tensors)

    def weighted_loss(lp):  # Σ weight·ℓ over [N] (token level: no layout needed)
        loss, ratio, kl = per_token_loss(lp, old_logps, ref_logps, advantages, weights, rule,
                                         importance_sampling_ratio)
        lossw = weights * loss
        return lossw.sum(), (lossw, ratio, kl)

    coef_logp, (lossw, ratio, kl) = torch.func.grad(weighted_loss, has_aux=True)(logp)
    kl = torch.zeros_like(logp) if kl is None else kl
    return logp, ent, lse, lossw, coef_logp, kl, ratio, *terms
