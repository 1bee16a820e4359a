"""One small adapter per provider: fresh random inputs for a shape, and a loss call to time.

Every provider computes the same GRPO loss (LossConfig: TRL's dapo aggregation with beta, eps and
old/ref log-probs given, so the ratio, the clip and the k3 KL are all exercised) on inputs drawn
the same way: hidden states and weight with O(1) logits, random ids, random advantages, ~25%
padding at the end of the sequences, old/ref log-probs within ~0.1 nats of the policy's.

Kernels:
  fused_linear: hidden [B, T, D] + weight [V, D] -> loss (gradients for hidden and weight)
  logits:       logits [B, T, V] -> loss (gradient for the logits)
The inputs, the loss configuration and the Case a provider builds are in cases.py.
`ours` is the library's default call (the three-pass route, gradient formed in the forward,
where the call allows it); `ours-4pass` is the same call with GRPO_KERNELS_THREE_PASS=0 (the
four-pass route, the minimum-memory setting); each sets its variables around its own calls only.
Liger's adapters import liger_kernel lazily; when it is missing the provider is reported
"not installed" instead of failing the sweep. TRL's head and Cut Cross-Entropy (fused_linear
only) are in peer_providers.py.
"""

from __future__ import annotations

import contextlib
import functools

from .cases import (  # noqa: F401  (GRADED, Case, logits_inputs: re-exported for the harness)
    GRADED,
    Case,
    LossConfig,
    Provider,
    env_vars,
    fused_case,
    fused_inputs,
    logits_case,
    logits_inputs,
)
from .peer_providers import PEERS

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


# The library's switches, read at each call (the linear backward's in the backward itself)
THREE_PASS_ENV = "GRPO_KERNELS_THREE_PASS"  # "0": the four-pass route (minimum memory)
BACKWARD_ENV = "GRPO_KERNELS_LINEAR_BACKWARD"  # the four-pass Triton backward: gemm / atomic


def _fused_ours(shape, dtype, device, cfg, three_pass=True, backward=None, grad_filter=None):
    """three_pass: False sets GRPO_KERNELS_THREE_PASS=0 (the four-pass route); True leaves the
    route to the library (the three-pass route where the call allows it). backward:
    GRPO_KERNELS_LINEAR_BACKWARD (None: the library's choice; "atomic": the atomic backward of
    the four-pass route); grad_filter: gradient filtering (None: exact). Both variables are set
    (or unset) around each call and backward of this case only (`Case.env`)."""
    import grpo_kernels
    from grpo_kernels.ops import route
    from grpo_kernels.ops.backends import backend_for

    inputs = fused_inputs(shape, dtype, device, cfg)
    h, w, ids, adv, mask, old, ref = inputs
    ctx = (lambda: grpo_kernels.force_backend(cfg.backend)) if cfg.backend else (
        contextlib.nullcontext)
    with ctx():
        backend = cfg.backend or backend_for(h)

    def loss():
        with ctx():
            return grpo_kernels.fused_linear_grpo_loss(h, w, ids, adv, mask, old, ref,
                                                       grad_filter=grad_filter, **cfg.ours())[0]

    env = {THREE_PASS_ENV: None if three_pass else "0", BACKWARD_ENV: backward}
    note = f"backend={backend}" + ("" if three_pass else f"; {THREE_PASS_ENV}=0")
    if backward is not None:
        note += f"; {BACKWARD_ENV}={backward}"
    if grad_filter is not None:
        note += f"; grad_filter={grad_filter}"
    extra, path = {}, route.FOUR_PASS
    if _takes_three_pass(h, w, backend, cfg, grad_filter, env):
        note += f"; {THREE_PASS_NOTE}"
        extra, path = dict(rated_modes=("score", "fwd+bwd"),
                           unmeasured={"backward": THREE_PASS_NA}), route.THREE_PASS
    # the route each graded call must take (checked against the one it took, in every row)
    expect = {m: path for m in GRADED + ("forward",)}
    return fused_case(loss, inputs, note, env=env, expect_route=expect, **extra)


# The three-pass route forms the gradient in the forward, and the first backward of the graph
# hands it to autograd. The backward mode times later backwards of one retained graph, which
# recompute it (the four-pass backward): a cost no training step pays. So that route's case has
# no backward time, and its forward (the whole work) no rate, as Liger's.
THREE_PASS_NOTE = "three-pass route: gradient formed in the forward (forward unrated)"
THREE_PASS_NA = ("three-pass route: the gradient is formed in the forward (see forward and "
                 "fwd+bwd); a retained graph's repeated backward would time a recompute")


def _takes_three_pass(h, w, backend, cfg, grad_filter, env) -> bool:
    """Whether the loss call takes the three-pass route, by the library's own rule
    (`route.linear_loss_route`) under the case's variables. h [B, T, D], w [V, D]."""
    from grpo_kernels.ops import route
    from grpo_kernels.params import GRPOParams

    with env_vars(env):
        return route.linear_loss_route(h.reshape(-1, h.shape[-1]), w, None, backend,
                                       GRPOParams(**cfg.ours()), grad_filter=grad_filter
                                       ).three_pass


def _fused_reference(compiled: bool):
    def build(shape, dtype, device, cfg):
        from grpo_kernels import reference

        fn = _compiled(reference.fused_linear_grpo_loss) if compiled else (
            reference.fused_linear_grpo_loss)
        inputs = fused_inputs(shape, dtype, device, cfg)
        return fused_case(lambda: fn(*inputs, **cfg.ours())[0], inputs)

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
    inputs = fused_inputs(shape, dtype, device, cfg)
    h, w, ids, adv, mask, old, ref = inputs

    def loss():
        return module(h, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)[0]

    note = "grads computed in forward" + ("" if device.type == "cuda" else "; compiled=False")
    return fused_case(loss, inputs, note, rated_modes=("fwd+bwd",))


def _logits_ours(shape, dtype, device, cfg):
    import grpo_kernels

    inputs = logits_inputs(shape, dtype, device, cfg)
    logits, ids, adv, mask, old, ref = inputs

    def loss():
        return grpo_kernels.grpo_loss(logits, ids, adv, mask, old, ref, **cfg.ours(),
                                      inplace=cfg.inplace)[0]

    return logits_case(loss, inputs, f"inplace={cfg.inplace}")


def _logits_reference(compiled: bool):
    def build(shape, dtype, device, cfg):
        from grpo_kernels import reference

        fn = _compiled(reference.grpo_loss) if compiled else reference.grpo_loss
        inputs = logits_inputs(shape, dtype, device, cfg)
        return logits_case(lambda: fn(*inputs, **cfg.ours())[0], inputs)

    return build


def _logits_liger(shape, dtype, device, cfg):
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    inputs = logits_inputs(shape, dtype, device, cfg, extra=1)
    logits, ids, adv, mask, old, ref = inputs

    def loss():
        # Liger's defaults differ from TRL's (temperature 0.9, eps_high 0.4): pass all of ours.
        return triton_grpo_loss(
            logits, old, ref, ids, adv, mask, temperature=cfg.temperature, beta=cfg.beta,
            eps_low=cfg.epsilon_low, eps_high=cfg.epsilon_high, inplace=cfg.inplace,
            loss_type=cfg.loss_type, reduce=True,
        )[0]

    return logits_case(loss, inputs, f"inplace={cfg.inplace}; logits [B,T+1,V]")


def _references(kernel: str, build, eager_note: str, compiled_note: str) -> tuple[Provider, ...]:
    """The eager reference of one kernel and the same under torch.compile; build(compiled)."""
    return (Provider(kernel, "reference", build(False), _always, f"{eager_note}, eager"),
            Provider(kernel, "reference-compile", build(True), _always,
                     f"{compiled_note} under torch.compile(dynamic=False)"))


PROVIDERS: dict[str, Provider] = {
    p.key: p
    for p in (
        Provider("fused_linear", "ours", _fused_ours, _always,
                 "grpo_kernels.fused_linear_grpo_loss, default route: three passes (gradient "
                 "formed in the forward) where the call allows it; Triton on CUDA"),
        Provider("fused_linear", "ours-4pass",
                 functools.partial(_fused_ours, three_pass=False), _always,
                 "ours on the four-pass route (GRPO_KERNELS_THREE_PASS=0, the minimum-memory "
                 "setting): forward statistics, the backward recomputes the logits"),
        Provider("fused_linear", "ours-atomic",
                 functools.partial(_fused_ours, three_pass=False, backward="atomic"),
                 _needs_cuda,
                 "ours-4pass with the atomic backward (GRPO_KERNELS_LINEAR_BACKWARD=atomic)"),
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
NAMES = ("ours", "ours-4pass", "ours-atomic", "ours-filter", "trl", "cce", "cce-filter", "liger",
         "reference", "reference-compile")


def select(kernels, names) -> list[Provider]:
    """Providers in the order `names` gives them (the default: NAMES, ours first), the compiled
    references last: their compile time is what most often runs a time budget out, and a sweep
    with a time budget skips the pairs it has not started. A device run lists the providers its
    goals compare with first, so that slow providers (seconds a call) cannot crowd them out."""
    order = {n: i for i, n in enumerate(names)}
    chosen = [p for p in PROVIDERS.values() if p.kernel in kernels and p.name in names]
    return sorted(chosen, key=lambda p: (p.name.endswith("-compile"), order[p.name], p.kernel))
