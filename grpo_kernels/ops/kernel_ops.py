"""A selective log-prob op bound to one backend's launchers: the linear head or the logits.

Forward gives (logp [N], entropy [N], lse [N]); backward turns per-token gradients (g_logp,
g_entropy [N]) into input gradients. Triton launches go through `fallback.run`, so a kernel that
fails to compile or launch is replaced by the chunked PyTorch launcher of the same contract.
"""

from __future__ import annotations

import torch

from ..cpu import chunked
from . import fallback


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

    def forward(self, targets, epilogue, hidden, weight, bias, keep=None):
        """keep: a dict for the chunked launcher's kept logits tile (chunked backend only)."""
        if epilogue is not None:  # a failure here is handled by the caller (fused_linear_grpo)
            return self.impl.linear_logprob_forward(hidden, weight, bias, targets,
                                                    self.temperature, epilogue=epilogue)
        extra = {} if keep is None or self.on_triton else {"keep": keep}
        return self._launch(hidden, "linear-head forward", "linear_logprob_forward", hidden,
                            weight, bias, targets, self.temperature, **extra)

    def backward(self, inputs, targets, lse, ent, g_logp, g_ent, needs, kept=None):
        hidden, weight, bias = inputs
        extra = {} if not kept or self.on_triton else {"kept": kept}
        return self._launch(hidden, "linear-head backward", "linear_logprob_backward", hidden,
                            weight, bias, targets, lse, ent, g_logp, g_ent, self.temperature,
                            needs=tuple(needs), grad_filter=self.grad_filter, **extra)


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
