"""Peers that, like ours, compute per-token log-probs from hidden states and the lm head without
holding [N, V] logits: TRL's own head and Cut Cross-Entropy (CCE). Neither computes a GRPO loss,
so each provider takes the peer's per-token log-probs (with their gradient) and finishes with
grpo-kernels' PyTorch GRPO math (`grpo_math.grpo_loss_from_logps`, the code the reference and
the chunked path use), on the same inputs and LossConfig as every other provider. The work
differs from ours only in the head.

trl: `trl.kernels.chunked_logprob.ChunkedLogProbFunction`, the head TRL 1.16's GRPOTrainer runs
  by default, called as the trainer calls it: log-probs and entropies, TRL's vocabulary chunk,
  and on CUDA only the unmasked tokens (TRL compacts them on Triton devices, scores every
  position elsewhere). On CPU it folds its tiles with torch ops instead of Triton.
cce: `cut_cross_entropy.linear_cross_entropy(..., reduction="none")`: log p = -cross-entropy
  per token, padding passed as ignore_index. No entropy: that part of our work is left out.
  CUDA: impl "cce" (Triton), exact (filter_eps=None, as ours is by default); "cce-filter" keeps
  CCE's default gradient filter ("high"). CPU: impl "torch_compile", which computes the [N, V]
  logits inside one compiled graph.

Each library is imported lazily; a missing one reads "n/a: ... not installed" in the sweep.
"""

from __future__ import annotations

import importlib

import torch
import torch._functorch.config

IGNORE_INDEX = -100  # CCE's (and PyTorch's) ignore_index for padding positions
TRL_CHUNK = 32768  # TRL's vocabulary chunk (trl.trainer.utils), if that name is not found


# ---- availability ---------------------------------------------------------------------------


def _missing(module: str, package: str) -> str | None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if getattr(exc, "name", None) in (module, module.split(".")[0]):
            return f"{package} not installed"
        return f"{package}: import {module} failed: {exc}"
    return None


def trl_unavailable(device: torch.device) -> str | None:
    # the head's backward imports trl.trainer.utils (which needs accelerate, datasets, pandas)
    return _missing("trl.kernels.chunked_logprob", "trl") or _missing("trl.trainer.utils", "trl")


def cce_unavailable(device: torch.device) -> str | None:
    return _missing("cut_cross_entropy", "cut-cross-entropy")


def cce_filter_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs CUDA (filter_eps applies to CCE's Triton impl only)"
    return cce_unavailable(device)


# ---- the peers' per-token log-probs ---------------------------------------------------------


def trl_logps(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
              mask: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [B, T] (float32, zero at masked positions) from TRL's head,
    called as TRL's fused lm-head forward calls it."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer import utils as trl_utils

    chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", TRL_CHUNK)
    keep = mask.bool()
    compact = hidden.device.type in ("cuda", "xpu")  # TRL's rule: compact where Triton runs
    h = hidden[keep] if compact else hidden.reshape(-1, hidden.shape[-1])
    t = ids[keep] if compact else ids.reshape(-1)
    logp, ent, *_ = ChunkedLogProbFunction.apply(h, weight, None, t, temperature, chunk, None,
                                                 1.0, ("log_probs", "entropy"))
    if compact:
        return (logp.new_zeros(keep.shape).masked_scatter(keep, logp),
                ent.new_zeros(keep.shape).masked_scatter(keep, ent))
    return logp.view(keep.shape), ent.view(keep.shape)


def cce_logps(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
              impl: str, filter_eps: float | str | None = None) -> torch.Tensor:
    """Log-probs [B, T] (float32, zero at masked positions) from CCE's per-token loss."""
    from cut_cross_entropy import linear_cross_entropy

    targets = ids.masked_fill(mask == 0, IGNORE_INDEX)
    kw = dict(filter_eps=filter_eps) if impl == "cce" else {}  # torch_compile takes none
    ce = linear_cross_entropy(hidden, weight, targets, reduction="none", impl=impl, **kw)
    return -ce.float()


def loss_from_logps(logp, entropy, hidden, weight, ids, adv, mask, old, ref, hyper: dict):
    """grpo-kernels' GRPO loss (and metrics) on given per-token log-probs: the inputs are
    validated as `fused_linear_grpo_loss` validates them, on every call, as ours does."""
    from grpo_kernels.grpo_math import grpo_loss_from_logps
    from grpo_kernels.params import GRPOParams
    from grpo_kernels.validation import check_linear_loss_inputs

    params = GRPOParams(**hyper)
    _, inputs = check_linear_loss_inputs(hidden, weight, None, ids, params, mask, adv, old, ref,
                                         None, None)
    if entropy is None:
        if params.entropy_coef != 0.0:
            raise ValueError("this head gives no entropy: entropy_coef must be 0")
        entropy = torch.zeros_like(logp)  # read only by the entropy metric
    return grpo_loss_from_logps(logp, entropy, inputs, params)


# ---- adapters -------------------------------------------------------------------------------


def _build_trl(shape, dtype, device, cfg):
    from .cases import fused_case, fused_inputs

    inputs = fused_inputs(shape, dtype, device, cfg)
    h, w, ids, adv, mask, old, ref = inputs
    hyper = cfg.ours()

    def loss():
        logp, ent = trl_logps(h, w, ids, mask, cfg.temperature)
        return loss_from_logps(logp, ent, h, w, ids, adv, mask, old, ref, hyper)[0]

    note = "unmasked tokens only" if device.type == "cuda" else "all positions; torch tiles"
    return fused_case(loss, inputs, note)


def _build_cce(filter_eps: float | str | None):
    def build(shape, dtype, device, cfg):
        from .cases import fused_case, fused_inputs

        inputs = fused_inputs(shape, dtype, device, cfg)
        h, w, ids, adv, mask, old, ref = inputs
        impl = "cce" if device.type == "cuda" else "torch_compile"
        hyper = cfg.ours()
        if cfg.temperature != 1.0:  # CCE takes no temperature
            raise ValueError("cce: temperature must be 1.0")

        if impl == "torch_compile":
            # The sweep's backward mode calls backward(retain_graph=True) on one graph again and
            # again, which a compiled backward that donates its buffers refuses. A patch around
            # the call does not reach CCE's graph, so donation is turned off for the process
            # (on CPU, where no memory of compiled graphs is measured; a saving, not a result).
            torch._functorch.config.donated_buffer = False

        def loss():
            logp = cce_logps(h, w, ids, mask, impl, filter_eps)
            return loss_from_logps(logp, None, h, w, ids, adv, mask, old, ref, hyper)[0]

        note = f"impl={impl}; no entropy" + (f"; filter_eps={filter_eps}" if impl == "cce"
                                             else "")
        return fused_case(loss, inputs, note, cpu_memory=impl != "torch_compile")

    return build


# (kernel, name, build, unavailable, note) of each peer; providers.py registers them
PEERS = (
    ("fused_linear", "trl", _build_trl, trl_unavailable,
     "TRL 1.16's chunked log-prob head (log-probs + entropy) + grpo-kernels' GRPO math"),
    ("fused_linear", "cce", _build_cce(None), cce_unavailable,
     "Cut Cross-Entropy log-probs (exact; no entropy, so less work than ours) + grpo-kernels' "
     "GRPO math; CPU: its torch_compile impl, which holds [N, V] logits"),
    ("fused_linear", "cce-filter", _build_cce("high"), cce_filter_unavailable,
     "cce with CCE's default gradient filter (filter_eps='high', approximate)"),
)
