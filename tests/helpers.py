"""Shared test inputs and error bounds (imported by the kernel tests)."""

from __future__ import annotations

import itertools

import torch

from grpo_kernels import reference
from grpo_kernels.loss_specs import TOKEN_LOSS_TYPES, spec_of

# Every loss type with a per-token epilogue (TRL's or not) at every importance-sampling level it
# is defined at, from the registry: a new per-token type is in every matrix below by itself.
TYPE_LEVELS = [(t, level) for t in TOKEN_LOSS_TYPES for level in spec_of(t).levels]
# loss type × importance-sampling level × beta × temperature × delta × bias
MATRIX = [(t, level, *rest) for t, level in TYPE_LEVELS
          for rest in itertools.product([0.0, 0.04], [1.0, 0.7], [None, 1.5], [False, True])]


def triton_unavailable() -> str | None:
    """Why the Triton backend cannot run CPU tensors here (None when it can: Triton's
    interpreter is on, as tests/conftest.py sets it up without a GPU)."""
    from grpo_kernels import force_backend
    from grpo_kernels.ops.backends import backend_for

    try:
        with force_backend("triton"):
            backend_for(torch.zeros(1))
    except RuntimeError as exc:
        return str(exc)
    return None


def hyper(loss_type, level, beta, temperature, delta, **extra):
    """Keyword hyperparameters of one matrix cell (cispo takes its raw cap as epsilon_high)."""
    kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=beta,
              temperature=temperature, delta=delta, max_completion_length=64,
              epsilon_high=5.0 if loss_type == "cispo" else 0.28)
    kw.update(extra)
    return kw


def make_head(B, T, D, V, dtype, device, seed=0, bias=False, scale=1.0):
    """Random hidden [B, T, D], weight [V, D], bias [V] | None, ids [B, T] (never zeros).

    `scale` sets the logit spread: ~N(0, scale²) logits with these magnitudes."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g)
    weight = torch.randn(V, D, generator=g) * (scale / max(D, 1) ** 0.5)
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    cast = lambda x: None if x is None else x.to(device=device, dtype=dtype)  # noqa: E731
    return cast(hidden), cast(weight), cast(b), ids.to(device)


def make_grpo_batch(hidden, weight, bias, ids, seed=0, masked_row=True, temperature=1.0,
                    token_adv=False):
    """Mask with padding (and optionally a fully masked row), advantages, and old/ref log-probs
    near the current policy's so ratios straddle the clip range."""
    B, T = ids.shape
    g = torch.Generator().manual_seed(seed + 1)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask *= (torch.arange(T)[None, :] < lengths[:, None]).float()
    if masked_row and B > 1:
        mask[1] = 0.0
    adv = torch.randn(B, T, generator=g) if token_adv else torch.randn(B, generator=g)
    with torch.no_grad():
        logp = reference.selective_logprobs(hidden.double().cpu(), weight.double().cpu(),
                                            ids.cpu(),
                                            None if bias is None else bias.double().cpu(),
                                            temperature=temperature).float()
    old = logp + 0.25 * torch.randn(B, T, generator=g)
    ref = logp + 0.25 * torch.randn(B, T, generator=g)
    dev = hidden.device
    return mask.to(dev), adv.to(dev), old.to(dev), ref.to(dev)


# Where the Triton backend's tests launch the kernels: the GPU when there is one, else the CPU
# (Triton's interpreter). The truths stay on the CPU in float64.
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _move(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)  # differentiable: a CPU leaf receives the gradient
    if isinstance(x, (tuple, list)):
        return type(x)(_move(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _move(v, device) for k, v in x.items()}
    return x


def on_device(fn, backend):
    """`fn` with its tensor arguments moved (differentiably) to the device the backend's tests
    run on and its outputs moved back to the CPU: the Triton backend runs on KERNEL_DEVICE, the
    chunked backend on the CPU. On a machine without a GPU this is `fn` itself."""
    device = KERNEL_DEVICE if backend == "triton" else torch.device("cpu")
    if device.type == "cpu":
        return fn

    def moved(*args, **kwargs):
        out = fn(*_move(args, device), **_move(kwargs, device))
        return _move(out, torch.device("cpu"))
    return moved


def leaf(x, dtype=None):
    if x is None:
        return None
    return x.detach().to(dtype or x.dtype).clone().requires_grad_(True)


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def scaled_err(a, b) -> float:
    """Max abs error relative to the truth's max magnitude (∞-norm relative error)."""
    if not a.numel():
        return 0.0
    return max_err(a, b) / max(b.double().abs().max().item(), 1e-30)


def transformed_head(inputs, targets, temperature, softcap, logit_scale, g_logp, g_ent,
                     dtype=torch.float64, raw=None):
    """PyTorch autograd in `dtype` (float64: the truth) of the log-probs of raw logits
    y = raw(*inputs) (default: hidden @ weight.T + bias) with the logit transform
    z = cap(s·y) / τ: (logp, entropy, lse, gradients of Σ g·logp + Σ g_H·H w.r.t. the inputs
    that are not None)."""
    leaves = [None if x is None else leaf(x, dtype) for x in inputs]
    if raw is None:
        def raw(h, w, b):
            return h @ w.T if b is None else h @ w.T + b
    z = reference.transform_logits(raw(*leaves), softcap, logit_scale) / temperature
    log_p = torch.log_softmax(z, -1)
    logp = log_p.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    loss = (g_logp.to(z.dtype) * logp).sum()
    if g_ent is not None:
        loss = loss + (g_ent.to(z.dtype) * ent).sum()
    grads = torch.autograd.grad(loss, [x for x in leaves if x is not None])
    return logp.detach(), ent.detach(), torch.logsumexp(z, -1).detach(), list(grads)
