"""One small adapter per provider: fresh random inputs for a shape, and a loss call to time.

Every provider computes the same GRPO loss (LossConfig: TRL's dapo aggregation with beta, eps and
old/ref log-probs given, so the ratio, the clip and the k3 KL are all exercised) on inputs drawn
the same way: hidden states and weight with O(1) logits, random ids, random advantages, ~25%
padding at the end of the sequences, old/ref log-probs within ~0.1 nats of the policy's.

Kernels:
  fused_linear: hidden [B, T, D] + weight [V, D] -> loss (gradients for hidden and weight)
  logits:       logits [B, T, V] -> loss (gradient for the logits)
Liger's adapters import liger_kernel lazily; when it is missing the provider is reported
"not installed" instead of failing the sweep. TRL's head and Cut Cross-Entropy (fused_linear
only) are in peer_providers.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from . import Shape
from .peer_providers import PEERS

GRADED = ("backward", "fwd+bwd")  # modes that produce gradients


@dataclass(frozen=True)
class LossConfig:
    loss_type: str = "dapo"
    beta: float = 0.04
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    temperature: float = 1.0
    inplace: bool = False  # logits path: may the backward overwrite the logits with their grad?
    backend: str | None = None  # ours, fused linear: force "chunked" / "triton"; None = dispatch

    def ours(self) -> dict:
        return dict(beta=self.beta, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                    temperature=self.temperature, loss_type=self.loss_type)


@dataclass
class Case:
    """Inputs built for one (provider, shape) and the loss call on them."""

    loss: Callable[[], torch.Tensor]  # returns the 0-dim loss, with an autograd graph
    leaves: list[torch.Tensor]  # tensors that receive gradients
    input_bytes: int
    note: str = ""
    keep: list = field(default_factory=list)  # the other inputs, kept alive with the case
    # Modes whose time covers the work the FLOP/byte accounting assumes. Liger's fused linear
    # loss computes the gradients inside forward, so only its fwd+bwd gets a rate.
    rated_modes: tuple[str, ...] = ("forward", "backward", "fwd+bwd")
    # False where the CPU memory tracker (a dispatch mode) cannot run the call: torch.compile
    # skips frames under a dispatch mode, and a fullgraph compile then raises
    cpu_memory: bool = True

    @property
    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.leaves)

    def step(self, mode: str) -> Callable[[], None]:
        """The callable to time for `mode` (for "backward", the forward runs here, untimed)."""
        if mode == "forward":
            def forward():
                self.loss()  # the graph (saved activations) is built, then dropped

            return forward
        if mode == "fwd+bwd":
            return lambda: self.loss().backward()
        if mode == "backward":
            loss = self.loss()
            return lambda: loss.backward(retain_graph=True)
        raise ValueError(f"unknown mode {mode!r}")

    def timed_fresh_step(self, mode: str) -> Callable[[], float]:
        """`step(mode)` with the leaves' gradients cleared first (a fresh accumulation, as in a
        training step); each call returns the step's wall time in seconds (the clearing
        untimed). For CPU timings: a device step needs a synchronize."""
        step = self.step(mode)

        def call() -> float:
            for t in self.leaves:
                t.grad = None
            t0 = time.perf_counter()
            step()
            return time.perf_counter() - t0

        return call


@dataclass(frozen=True)
class Provider:
    kernel: str  # "fused_linear" | "logits"
    name: str  # one of NAMES
    build: Callable[[Shape, torch.dtype, torch.device, LossConfig], Case]
    unavailable: Callable[[torch.device], str | None]  # reason it cannot run here, or None
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.kernel}/{self.name}"


# ---- inputs ---------------------------------------------------------------------------------


def _batch(shape: Shape, device, seed: int):
    """ids, advantages [B], int64 mask [B, T] with 0-50% trailing padding per sequence."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, T = shape.B, shape.T
    ids = torch.randint(0, shape.V, (B, T), device=device, generator=g)
    adv = torch.randn(B, device=device, generator=g)
    keep = torch.randint(T // 2, T + 1, (B,), device=device, generator=g)
    mask = (torch.arange(T, device=device)[None, :] < keep[:, None]).long()
    return g, ids, adv, mask


def _near(logp: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A log-prob within ~0.1 nats of logp (ratios straddle the clip range), still <= 0."""
    noise = torch.randn(logp.shape, device=logp.device, generator=g)
    return (logp + 0.1 * noise).clamp(max=0.0).contiguous()


@torch.no_grad()
def _logp_blocks(blocks: Iterable[tuple[int, torch.Tensor]], ids: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """Policy log-probs [B, T] from (first row, logits [rows, V]) blocks (never [N, V])."""
    flat = ids.reshape(-1)
    out = torch.empty(flat.numel(), device=ids.device, dtype=torch.float32)
    for i, rows in blocks:
        z = rows.float() / temperature
        j = i + z.shape[0]
        out[i:j] = z.gather(1, flat[i:j, None]).squeeze(1) - z.logsumexp(1)
    return out.reshape(ids.shape)


def _chunk(V: int) -> int:
    return max(1, 2**27 // V)  # [chunk, V] float32 scratch of at most 512 MiB


def fused_inputs(shape: Shape, dtype, device, cfg: LossConfig, seed: int = 0):
    """hidden [B, T, D] and weight [V, D] (leaves), ids, adv, mask, old, ref ([B, T])."""
    g, ids, adv, mask = _batch(shape, device, seed)
    hidden = torch.randn(shape.B, shape.T, shape.D, device=device, dtype=dtype, generator=g)
    weight = torch.randn(shape.V, shape.D, device=device, dtype=dtype, generator=g)
    weight.mul_(2.0 / shape.D**0.5)  # logits ~ N(0, 4): softmax neither flat nor one-hot
    h2, c = hidden.reshape(shape.N, shape.D), _chunk(shape.V)
    blocks = ((i, h2[i:i + c] @ weight.T) for i in range(0, shape.N, c))
    logp = _logp_blocks(blocks, ids, cfg.temperature)
    old, ref = _near(logp, g), _near(logp, g)
    del logp
    return hidden.requires_grad_(), weight.requires_grad_(), ids, adv, mask, old, ref


def logits_inputs(shape: Shape, dtype, device, cfg: LossConfig, seed: int = 0, extra: int = 0):
    """logits [B, T + extra, V] (leaf), ids, adv, mask, old, ref. Liger's logits kernel takes
    one more position per sequence (the model's last logit, ignored): extra=1."""
    g, ids, adv, mask = _batch(shape, device, seed)
    logits = torch.randn(shape.B, shape.T + extra, shape.V, device=device, dtype=dtype,
                         generator=g)
    logits.mul_(2.0)
    T, c = shape.T, _chunk(shape.V)
    blocks = ((b * T + t, logits[b, t:min(t + c, T)]) for b in range(shape.B)
              for t in range(0, T, c))  # only the first T positions of each sequence
    logp = _logp_blocks(blocks, ids, cfg.temperature)
    old, ref = _near(logp, g), _near(logp, g)
    del logp
    return logits.requires_grad_(), ids, adv, mask, old, ref


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


# ---- availability ---------------------------------------------------------------------------


def _always(device) -> str | None:
    return None


def _needs_cuda(device) -> str | None:
    return None if device.type == "cuda" else "needs CUDA (Triton kernel)"


def _liger(device, needs_cuda: bool) -> str | None:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "liger-kernel not installed"
    return _needs_cuda(device) if needs_cuda else None


def _ours_logits(device) -> str | None:
    import grpo_kernels

    if not hasattr(grpo_kernels, "grpo_loss"):
        return "not available: grpo_kernels.grpo_loss (logits input) not in this tree"
    return None


# ---- adapters -------------------------------------------------------------------------------


def _compiled(fn):
    """torch.compile with static shapes (one graph per shape, the best case for the compiler);
    the recompile limits are raised because a sweep visits many shapes."""
    import torch._dynamo

    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    return torch.compile(fn, dynamic=False)


def _fused_ours(shape, dtype, device, cfg, backward="auto", grad_filter=None):
    """backward: GRPO_KERNELS_LINEAR_BACKWARD ("auto": the default choice, the atomic-free
    d-logits + GEMM backward unless grad_filter > 0; "atomic": the atomic backward);
    grad_filter: gradient filtering (None: exact)."""
    import grpo_kernels
    from grpo_kernels.ops.backends import backend_for

    h, w, ids, adv, mask, old, ref = fused_inputs(shape, dtype, device, cfg)
    ctx = (lambda: grpo_kernels.force_backend(cfg.backend)) if cfg.backend else (
        contextlib.nullcontext)
    with ctx():
        backend = cfg.backend or backend_for(h)

    def loss():
        # read again by the backward that follows (ours and ours-atomic alternate in a sweep)
        os.environ["GRPO_KERNELS_LINEAR_BACKWARD"] = backward
        with ctx():
            return grpo_kernels.fused_linear_grpo_loss(h, w, ids, adv, mask, old, ref,
                                                       grad_filter=grad_filter, **cfg.ours())[0]

    note = f"backend={backend}" + (f"; backward={backward}" if backend == "triton" else "")
    if grad_filter is not None:
        note += f"; grad_filter={grad_filter}"
    return Case(loss, [h, w], nbytes(h, w, ids, adv, mask, old, ref), note,
                [ids, adv, mask, old, ref])


def _fused_reference(compiled: bool):
    def build(shape, dtype, device, cfg):
        from grpo_kernels import reference

        fn = _compiled(reference.fused_linear_grpo_loss) if compiled else (
            reference.fused_linear_grpo_loss)
        h, w, ids, adv, mask, old, ref = fused_inputs(shape, dtype, device, cfg)
        return Case(lambda: fn(h, w, ids, adv, mask, old, ref, **cfg.ours())[0], [h, w],
                    nbytes(h, w, ids, adv, mask, old, ref), keep=[ids, adv, mask, old, ref])

    return build


def _fused_liger(shape, dtype, device, cfg):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    # Same loss as ours: dapo normalizer, beta with ref log-probs given, eps_low/eps_high,
    # temperature. chunk_size counts sequences. Liger's default compiles its loss math; on CPU
    # that is turned off (inductor compile time would dominate a short CPU run).
    module = LigerFusedLinearGRPOLoss(
        beta=cfg.beta, compiled=device.type == "cuda", use_ref_model=cfg.beta != 0.0,
        chunk_size=1, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
        loss_type=cfg.loss_type, temperature=cfg.temperature,
    )
    h, w, ids, adv, mask, old, ref = fused_inputs(shape, dtype, device, cfg)

    def loss():
        return module(h, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)[0]

    note = "grads computed in forward" + ("" if device.type == "cuda" else "; compiled=False")
    return Case(loss, [h, w], nbytes(h, w, ids, adv, mask, old, ref), note,
                [ids, adv, mask, old, ref], rated_modes=("fwd+bwd",))


def _logits_ours(shape, dtype, device, cfg):
    import grpo_kernels

    logits, ids, adv, mask, old, ref = logits_inputs(shape, dtype, device, cfg)

    def loss():
        return grpo_kernels.grpo_loss(logits, ids, adv, mask, old, ref, **cfg.ours(),
                                      inplace=cfg.inplace)[0]

    return Case(loss, [logits], nbytes(logits, ids, adv, mask, old, ref),
                f"inplace={cfg.inplace}", [ids, adv, mask, old, ref])


def _logits_reference(compiled: bool):
    def build(shape, dtype, device, cfg):
        from grpo_kernels import reference

        fn = _compiled(reference.grpo_loss) if compiled else reference.grpo_loss
        logits, ids, adv, mask, old, ref = logits_inputs(shape, dtype, device, cfg)
        return Case(lambda: fn(logits, ids, adv, mask, old, ref, **cfg.ours())[0], [logits],
                    nbytes(logits, ids, adv, mask, old, ref), keep=[ids, adv, mask, old, ref])

    return build


def _logits_liger(shape, dtype, device, cfg):
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    logits, ids, adv, mask, old, ref = logits_inputs(shape, dtype, device, cfg, extra=1)

    def loss():
        # Liger's defaults differ from TRL's (temperature 0.9, eps_high 0.4): pass all of ours.
        return triton_grpo_loss(
            logits, old, ref, ids, adv, mask, temperature=cfg.temperature, beta=cfg.beta,
            eps_low=cfg.epsilon_low, eps_high=cfg.epsilon_high, inplace=cfg.inplace,
            loss_type=cfg.loss_type, reduce=True,
        )[0]

    return Case(loss, [logits], nbytes(logits, ids, adv, mask, old, ref),
                f"inplace={cfg.inplace}; logits [B,T+1,V]", [ids, adv, mask, old, ref])


def _references(kernel: str, build, eager_note: str, compiled_note: str) -> tuple[Provider, ...]:
    """The eager reference of one kernel and the same under torch.compile; build(compiled)."""
    return (Provider(kernel, "reference", build(False), _always, f"{eager_note}, eager"),
            Provider(kernel, "reference-compile", build(True), _always,
                     f"{compiled_note} under torch.compile(dynamic=False)"))


PROVIDERS: dict[str, Provider] = {
    p.key: p
    for p in (
        Provider("fused_linear", "ours", _fused_ours, _always,
                 "grpo_kernels.fused_linear_grpo_loss (Triton on CUDA)"),
        Provider("fused_linear", "ours-atomic",
                 functools.partial(_fused_ours, backward="atomic"), _needs_cuda,
                 "ours with the atomic backward (GRPO_KERNELS_LINEAR_BACKWARD=atomic)"),
        Provider("fused_linear", "ours-filter",
                 functools.partial(_fused_ours, grad_filter="auto"), _needs_cuda,
                 "ours with gradient filtering (approximate). Its saving grows with how peaked "
                 "the softmax is: these N(0, 4) logits (entropy 9.9 nats at V=152k) keep every "
                 "128x64 tile, so this row shows the filter's overhead, not its saving"),
        *_references("fused_linear", _fused_reference, "grpo_kernels.reference: [N, V] logits",
                     "grpo_kernels.reference"),
        Provider("fused_linear", "liger", _fused_liger, lambda d: _liger(d, False),
                 "LigerFusedLinearGRPOLoss: no entropy; grads computed in forward"),
        Provider("logits", "ours", _logits_ours, _ours_logits, "grpo_kernels.grpo_loss"),
        *_references("logits", _logits_reference, "grpo_kernels.reference.grpo_loss",
                     "grpo_kernels.reference.grpo_loss"),
        Provider("logits", "liger", _logits_liger, lambda d: _liger(d, True),
                 "liger triton_grpo_loss: no entropy; skips masked tokens; logits [B,T+1,V]"),
        *(Provider(*peer) for peer in PEERS),
    )
}
NAMES = ("ours", "ours-atomic", "ours-filter", "trl", "cce", "cce-filter", "liger", "reference",
         "reference-compile")


def select(kernels, names) -> list[Provider]:
    """Providers in sweep order: ours, TRL, CCE, Liger, the eager reference, the compiled
    reference (the sweep runs compiled providers after all the others: their compile time is
    what most often runs a time budget out)."""
    order = {n: i for i, n in enumerate(NAMES)}
    chosen = [p for p in PROVIDERS.values() if p.kernel in kernels and p.name in names]
    return sorted(chosen, key=lambda p: (order[p.name], p.kernel))
