"""The GRPO per-token epilogue as a Triton function, shared by the linear-head and logits kernels.

It is the Triton twin of `grpo_math.per_token_loss` for token-level importance sampling, and the
tests cross-check the two. Besides the loss it returns its derivative w.r.t. logp, so the forward
kernel can hand backward a single per-token coefficient (backward never recomputes this math).

Gradient algebra (token level: w = exp(logp - old), dw/dlogp = w; old and ref are constants):
  clipped  ℓ = -min(u·A, c·A),  u = min(w, δ), c = clamp(w, 1-ε_lo, 1+ε_hi)
           du = w·[w <= δ], dc = w·[1-ε_lo <= w <= 1+ε_hi]   (torch.clamp passes ties)
           dℓ = -A·du if u·A < c·A, -A·dc if greater, the mean of both on a tie (torch.minimum)
  cispo    ℓ = -min(w, ε_hi)·A·logp (the cap is detached)   dℓ = -min(w, ε_hi)·A
  sapo     s = σ(t·(w-1)), ℓ = -(4/t)·s·A                    dℓ = -4·A·s·(1-s)·w
  dppo     k = min(w, δ)·[p - p_old <= ε_hi if A > 0 else p - p_old >= -ε_lo], p = e^logp,
           ℓ = -k·A·logp (k detached: the ratio truncated at δ, times the trust-region mask)
           dℓ = -k·A
  then ℓ, dℓ *= isr (rollout correction), then with β != 0 and d = ref - logp:
  kl = e^d - d - 1, dkl = 1 - e^d; bias-corrected: kl·w, (dkl + kl)·w;  ℓ += β·kl, dℓ += β·dkl.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import loss_specs

# The LOSS_KIND codes of the kernels, from the loss-type registry (loss_specs.py), as constexprs
# the jitted code compares by name.
KIND_CLIPPED = tl.constexpr(loss_specs.KERNEL_CLIPPED)  # grpo, bnpo, dr_grpo, dapo, luspo
KIND_CISPO = tl.constexpr(loss_specs.KERNEL_CISPO)
KIND_SAPO = tl.constexpr(loss_specs.KERNEL_SAPO)
KIND_DPPO = tl.constexpr(loss_specs.KERNEL_DPPO)


@triton.jit
def grpo_token_epilogue(
    logp, old, ref, adv, isr,
    epsilon_low, epsilon_high, delta, beta, sapo_pos, sapo_neg,
    LOSS_KIND: tl.constexpr, HAS_OLD: tl.constexpr, HAS_DELTA: tl.constexpr,
    HAS_KL: tl.constexpr, BIAS_CORRECT_KL: tl.constexpr, HAS_ISR: tl.constexpr,
):
    """Per-token (loss ℓ, dℓ/dlogp, kl, ratio w); every argument is a float32 block."""
    if HAS_OLD:
        w = tl.exp(logp - old)
    else:
        w = tl.exp(logp - logp)  # ratio ≡ 1, derivative w·dlogp keeps the A·∇logp gradient
    if LOSS_KIND == KIND_CISPO:
        cap = tl.minimum(w, epsilon_high)
        loss = -cap * adv * logp
        dloss = -cap * adv
    elif LOSS_KIND == KIND_DPPO:
        k = w
        if HAS_DELTA:
            k = tl.minimum(w, delta)
        p = tl.exp(logp)
        change = p - p  # no old policy: the probability has not moved
        if HAS_OLD:
            change = p - tl.exp(old)
        inside = tl.where(adv > 0, change <= epsilon_high, change >= -epsilon_low)
        k = tl.where(inside, k, 0.0)
        loss = -k * adv * logp
        dloss = -k * adv
    elif LOSS_KIND == KIND_SAPO:
        t = tl.where(adv > 0, sapo_pos, sapo_neg)
        s = tl.sigmoid(t * (w - 1.0))
        loss = -(s * 4.0 / t) * adv
        dloss = -4.0 * adv * s * (1.0 - s) * w
    else:  # clipped surrogate
        lo = 1.0 - epsilon_low
        hi = 1.0 + epsilon_high
        c = tl.minimum(tl.maximum(w, lo), hi)
        dc = tl.where((w >= lo) & (w <= hi), w, 0.0)
        if HAS_DELTA:
            u = tl.minimum(w, delta)
            du = tl.where(w <= delta, w, 0.0)
        else:
            u = w
            du = w
        a = u * adv
        b = c * adv
        loss = -tl.minimum(a, b)
        da = -du * adv
        db = -dc * adv
        dloss = tl.where(a < b, da, tl.where(a > b, db, 0.5 * (da + db)))
    if HAS_ISR:
        loss = loss * isr
        dloss = dloss * isr
    kl = tl.zeros_like(logp)
    if HAS_KL:
        d = ref - logp
        e = tl.exp(d)
        kl = e - d - 1.0
        dkl = 1.0 - e
        if BIAS_CORRECT_KL:
            dkl = (dkl + kl) * w
            kl = kl * w
        loss = loss + beta * kl
        dloss = dloss + beta * dkl
    return loss, dloss, kl, w


@triton.jit
def grpo_token_outputs(
    offs, mask, logp,
    old_ptr, ref_ptr, adv_ptr, isr_ptr, wt_ptr,
    lossw_ptr, glogp_ptr, kl_ptr, ratio_ptr,
    epsilon_low, epsilon_high, delta, beta, sapo_pos, sapo_neg,
    LOSS_KIND: tl.constexpr, HAS_OLD: tl.constexpr, HAS_DELTA: tl.constexpr,
    HAS_KL: tl.constexpr, BIAS_CORRECT_KL: tl.constexpr, HAS_ISR: tl.constexpr,
):
    """Loads a block of per-token GRPO inputs ([N] float32), applies the epilogue, stores
    weight·ℓ, weight·dℓ/dlogp, kl and the ratio."""
    adv = tl.load(adv_ptr + offs, mask=mask, other=0.0)
    wt = tl.load(wt_ptr + offs, mask=mask, other=0.0)
    old = logp
    ref = logp
    isr = wt
    if HAS_OLD:
        old = tl.load(old_ptr + offs, mask=mask, other=0.0)
    if HAS_KL:
        ref = tl.load(ref_ptr + offs, mask=mask, other=0.0)
    if HAS_ISR:
        isr = tl.load(isr_ptr + offs, mask=mask, other=1.0)
    loss, dloss, kl, w = grpo_token_epilogue(
        logp, old, ref, adv, isr, epsilon_low, epsilon_high, delta, beta, sapo_pos, sapo_neg,
        LOSS_KIND, HAS_OLD, HAS_DELTA, HAS_KL, BIAS_CORRECT_KL, HAS_ISR,
    )
    tl.store(lossw_ptr + offs, wt * loss, mask=mask)
    tl.store(glogp_ptr + offs, wt * dloss, mask=mask)
    tl.store(kl_ptr + offs, kl, mask=mask)
    tl.store(ratio_ptr + offs, w, mask=mask)
