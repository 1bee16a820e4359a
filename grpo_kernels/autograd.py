"""Selective log-prob ops (linear head or logits, Triton or chunked PyTorch, with or without the
fused GRPO epilogue) and the autograd formulas of the custom operators built on them.

Forward gives (logp [N], entropy [N], lse [N]). Backward needs only per-token statistics, so only
those and the inputs are saved (never logits). For a loss op the forward also returns each
token's dloss/dlogp (the epilogue's weight·dℓ/dlogp, or grpo_math's) and dloss/dentropy, and

    g_logp = g_loss · dloss/dlogp,   g_entropy = g_loss · dloss/dentropy
    then the op's backward turns (g_logp, g_entropy) into input gradients.
"""

from __future__ import annotations

import torch

from . import chunked, fallback


class KernelOp:
    """One selective log-prob op on one backend's launchers (`impl`: the Triton launchers or
    `chunked`). Triton launches go through `fallback.run`: a kernel that fails to compile or
    launch is replaced by the chunked launcher of the same contract, and the op stays there
    (its backward runs on the backend its forward ran on)."""

    family = ""

    def __init__(self, impl, temperature: float):
        self.impl, self.temperature = impl, temperature

    @property
    def on_triton(self) -> bool:
        return self.impl is not chunked

    def on_torch(self):
        """The same op on the chunked PyTorch backend."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__, impl=chunked)
        return other

    def _launch(self, x, what, name, *args, **kw):
        if not self.on_triton:
            return getattr(chunked, name)(*args, **kw)

        def on_torch():
            self.impl = chunked  # backward follows the forward's backend
            return getattr(chunked, name)(*args, **kw)

        return fallback.run(self.family, x.device, x.dtype, what,
                            lambda: getattr(self.impl, name)(*args, **kw), on_torch)

    def failed(self, x) -> bool:
        """This op's Triton kernels already failed for x's dtype and device (see fallback)."""
        return self.on_triton and fallback.failed(self.family, x.device, x.dtype)


class LinearHeadOp(KernelOp):
    """z = (hidden [N, D] @ weight [V, D]^T + bias [V]) / τ, on one backend's launchers.
    grad_filter: None (exact backward) or the resolved gradient-filtering eps."""

    family = "linear-head"

    def __init__(self, impl, temperature: float, grad_filter: float | None = None):
        super().__init__(impl, temperature)
        self.grad_filter = grad_filter

    def forward(self, targets, epilogue, hidden, weight, bias):
        if epilogue is not None:  # a failure here is handled by the caller (fused_linear_grpo)
            return self.impl.linear_logprob_forward(hidden, weight, bias, targets,
                                                    self.temperature, epilogue=epilogue)
        return self._launch(hidden, "linear-head forward", "linear_logprob_forward", hidden,
                            weight, bias, targets, self.temperature)

    def backward(self, inputs, targets, lse, ent, g_logp, g_ent, needs):
        hidden, weight, bias = inputs
        return self._launch(hidden, "linear-head backward", "linear_logprob_backward", hidden,
                            weight, bias, targets, lse, ent, g_logp, g_ent, self.temperature,
                            needs=tuple(needs), grad_filter=self.grad_filter)


class LogitsOp(KernelOp):
    """z = logits [B, T, V] / τ. With `inplace`, d logits overwrites the logits buffer."""

    family = "logits"

    def __init__(self, impl, temperature: float, inplace: bool = False):
        super().__init__(impl, temperature)
        self.inplace = inplace

    def forward(self, targets, epilogue, logits):
        if epilogue is not None:  # a failure here is handled by the caller (fused_linear_grpo)
            return self.impl.logits_logprob_forward(logits, targets, self.temperature,
                                                    epilogue=epilogue)
        return self._launch(logits, "logits forward", "logits_logprob_forward", logits, targets,
                            self.temperature)

    def backward(self, inputs, targets, lse, ent, g_logp, g_ent, needs):
        (logits,) = inputs
        if not needs[0]:
            return (None,)
        dx = self._launch(logits, "logits backward", "logits_logprob_backward", logits, targets,
                          lse, ent, g_logp, g_ent, self.temperature,
                          out=logits if self.inplace else None)
        if self.inplace:
            # the kernel wrote through a raw pointer: bump the version so that any other
            # autograd node that saved these logits fails loudly instead of using gradients
            increment = getattr(torch.autograd.graph, "increment_version", None)
            if increment is not None:
                increment(logits)
        return (dx,)


# ---- autograd formulas of the custom ops (custom_ops.py registers them) ----------------------
# Forward saves the inputs and per-token statistics (lse, entropy [N]); backward turns the
# per-token gradients (g_logp, g_entropy [N] float32) into input gradients with the op's
# backward launcher. Unused outputs give None (set_materialize_grads(False)), so selective
# log-probs without entropy never pay for the entropy gradient.


def _per_token(g, like):
    return torch.zeros_like(like) if g is None else g.float().contiguous()


def linear_grads(ctx, g_logp, g_ent):
    """(d hidden, d weight, d bias) from the saved (hidden, weight, bias, targets, lse, ent)."""
    hidden, weight, bias, targets, lse, ent = ctx.saved_tensors[:6]
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    if (g_logp is None and g_ent is None) or not any(needs):
        return None, None, None
    temperature, grad_filter, backend = ctx.config
    g_ent = None if g_ent is None else g_ent.float().contiguous()
    grads = torch.ops.grpo_kernels.linear_logprobs_backward(
        hidden, weight, bias, targets, lse, ent, _per_token(g_logp, lse), g_ent, temperature,
        grad_filter, backend, needs)
    return tuple(g if need else None for g, need in zip(grads, needs))


def logits_grads(ctx, g_logp, g_ent):
    """d logits from the saved (logits, targets, lse, ent); in place when ctx.inplace."""
    logits, targets, lse, ent = ctx.saved_tensors[:4]
    if (g_logp is None and g_ent is None) or not ctx.needs_input_grad[0]:
        return None
    temperature, backend, inplace = ctx.config
    args = (targets, lse, ent, _per_token(g_logp, lse),
            None if g_ent is None else g_ent.float().contiguous(), temperature, backend)
    if inplace:
        torch.ops.grpo_kernels.logits_logprobs_backward_(logits, *args)
        return logits  # d logits now lives in the logits buffer (version counter bumped)
    return torch.ops.grpo_kernels.logits_logprobs_backward(logits, *args)


def setup_linear(ctx, inputs, output):
    hidden, weight, bias, targets, temperature, grad_filter, backend, _ = inputs
    _, ent, lse = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
    ctx.config = (temperature, grad_filter, backend)


def linear_backward(ctx, g_logp, g_ent, _g_lse):
    return (*linear_grads(ctx, g_logp, g_ent), None, None, None, None, None)


def setup_logits(ctx, inputs, output):
    logits, targets, temperature, backend, _, inplace = inputs
    _, ent, lse = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, targets, lse, ent)
    ctx.config = (temperature, backend, inplace)


def logits_backward(ctx, g_logp, g_ent, _g_lse):
    return logits_grads(ctx, g_logp, g_ent), None, None, None, None, None


def loss_token_grads(ctx, g_loss):
    """(g_logp, g_entropy) [N] of a loss op: g_loss × the saved coefficients dloss/dlogp and
    dloss/dentropy (the latter empty when entropy_coef == 0)."""
    coef_logp, coef_ent = ctx.saved_tensors[-2:]
    if g_loss is None:
        return None, None
    g = g_loss.float()
    return coef_logp * g, (coef_ent * g if ctx.has_entropy_grad else None)
