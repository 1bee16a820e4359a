"""The GRPO per-token epilogue as a Triton function, shared by the linear-head and logits kernels.

It is the Triton twin of `grpo_math.per_token_loss` for token-level importance sampling, and the
tests cross-check the two. Besides the loss it returns its derivative w.r.t. logp, so the forward
kernel can hand backward a single per-token coefficient (backward never recomputes this math).

Gradient algebra (token level: w = exp(logp - old), dw/dlogp = w; old and ref are constants):
  clipped  ℓ = -min(u·A, c·A),  u = min(w, δ), c = clamp(w, 1-ε_lo, 1+ε_hi)
           dℓ = w·(-A)·(g_u·[w <= δ] + g_c·[1-ε_lo <= w <= 1+ε_hi])   (torch.clamp passes ties)
           g_u = g, g_c = 0 if u·A < c·A; the reverse if greater; g/2 each on a tie
           (torch.minimum), where g = isr (1 without rollout correction)
           written in autograd's order, so non-finite values give what TRL's autograd gives:
           the clamps' zeros are selections (a non-finite isr at a clipped token gives 0), the
           factor w comes last (w = inf gives 0·inf = NaN, as torch.exp's backward)
  cispo    ℓ = -min(w, ε_hi)·A·logp (the cap is detached)   dℓ = -min(w, ε_hi)·A
  sapo     s = σ(t·(w-1)), ℓ = -(4/t)·s·A                    dℓ = -4·A·s·(1-s)·w
  dppo     k = min(w, δ)·[p - p_old <= ε_hi if A > 0 else p - p_old >= -ε_lo], p = e^logp,
           ℓ = -k·A·logp (k detached: the ratio truncated at δ, times the trust-region mask)
           dℓ = -k·A
  then ℓ *= isr (rollout correction; dℓ too, but for clipped, whose dℓ has it), then with
  β != 0 and d = ref - logp:
  kl = e^d - d - 1, dkl = 1 - e^d; bias-corrected: kl·w, (dkl + kl)·w;  ℓ += β·kl, dℓ += β·dkl.

Its arguments travel as one bundle (`EpilogueArgs`, built by `epilogue_args` from the per-token
loss's values): the kernels pass it through without naming its parts, so a new scalar or option
touches the loss's values (`params.TokenLossArgs`), its PyTorch formula (`objectives.py`) and
this file. In a kernel's signature it is three parameters: `epi_tensors` (a tuple of the nine
[N] float32 tensors), `epi_scalars` (a tuple of the float32 scalars) and the constexpr
`EPI_FLAGS`, the option bits below with the loss kind above them (from bit KIND_SHIFT on). A
bit is tested with the constant first (`HAS_OLD & EPI_FLAGS`): Triton's interpreter holds
EPI_FLAGS as a plain int, and only the constexpr on the left has the operator. Tuples are
flattened into the same kernel parameters as separate arguments would be, and constexpr bits are
resolved at compile time, so the compiled code is what separate arguments gave.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import loss_specs

# The LOSS_KIND codes of the kernels, from the loss-type registry (loss_specs.py), as constexprs
# the jitted code compares by name.
KIND_CLIPPED = tl.constexpr(loss_specs.CLIPPED.kernel_code)  # grpo, bnpo, dr_grpo, dapo, luspo
KIND_CISPO = tl.constexpr(loss_specs.CISPO.kernel_code)
KIND_SAPO = tl.constexpr(loss_specs.SAPO.kernel_code)
KIND_DPPO = tl.constexpr(loss_specs.DPPO.kernel_code)

# EPI_FLAGS: the epilogue's options, one bit each, and the loss kind from bit KIND_SHIFT on.
# Bit 0 says whether there is an epilogue at all (log-probs only without it).
EPILOGUE = tl.constexpr(1)
HAS_OLD = tl.constexpr(2)  # old log-probs given (else on-policy: the ratio is 1)
HAS_DELTA = tl.constexpr(4)  # the delta cap of two-sided clipping
HAS_KL = tl.constexpr(8)  # beta != 0
BIAS_CORRECT_KL = tl.constexpr(16)  # the k3 KL times the ratio
HAS_ISR = tl.constexpr(32)  # rollout importance-sampling ratios given
KIND_SHIFT = tl.constexpr(8)
# min / max that return NaN when either operand is NaN (a constexpr: a kernel reads no other global)
NAN_ALL = tl.constexpr(tl.PropagateNan.ALL)


class EpilogueArgs(NamedTuple):
    """The epilogue's arguments as a launcher passes them (see the module docstring)."""

    tensors: tuple  # [N] float32: old, ref, adv, isr, weight in; weight·ℓ, weight·dℓ, kl, ratio
    scalars: tuple  # epsilon_low, epsilon_high, delta, beta, sapo_pos, sapo_neg
    flags: int  # EPI_FLAGS

    @property
    def outputs(self) -> tuple:
        """(weight·ℓ, weight·dℓ/dlogp, kl, ratio), each [N] float32, filled by the kernel."""
        return self.tensors[5:]


def epilogue_flags(loss_kind: int, *, old: bool = False, delta: bool = False, kl: bool = False,
                   bias_correct_kl: bool = False, isr: bool = False) -> int:
    """EPI_FLAGS of an epilogue of this loss kind with these options on."""
    bits = zip((HAS_OLD, HAS_DELTA, HAS_KL, BIAS_CORRECT_KL, HAS_ISR),
               (old, delta, kl, bias_correct_kl, isr))
    return EPILOGUE.value | sum(b.value for b, on in bits if on) | loss_kind << KIND_SHIFT.value


def epilogue_args(rule, weights, advantages, old_logps, ref_logps,
                  importance_sampling_ratio) -> EpilogueArgs:
    """The bundle for a per-token loss (`rule`: a params.TokenLossArgs): the [N] float32 inputs,
    four fresh [N] outputs the kernel fills, the scalars and the flags. An absent input is given
    as `advantages`, a pointer the kernel never reads (its flag is off)."""
    N = advantages.shape[0]
    outs = [torch.empty(N, device=advantages.device, dtype=torch.float32) for _ in range(4)]
    given = lambda x: advantages if x is None else x  # noqa: E731
    tensors = (given(old_logps), given(ref_logps), advantages, given(importance_sampling_ratio),
               weights, *outs)
    scalars = (float(rule.epsilon_low), float(rule.epsilon_high),
               float(rule.delta) if rule.delta is not None else 0.0, float(rule.beta),
               float(rule.sapo_temperature_pos), float(rule.sapo_temperature_neg))
    flags = epilogue_flags(rule.spec.kernel_code, old=old_logps is not None,
                           delta=rule.delta is not None, kl=rule.beta != 0.0,
                           bias_correct_kl=rule.use_bias_correction_kl,
                           isr=importance_sampling_ratio is not None)
    return EpilogueArgs(tensors, scalars, flags)


def no_epilogue(dummy: torch.Tensor) -> EpilogueArgs:
    """Log-probs only: `dummy` ([N] float32) in every tensor's place, never read or written."""
    return EpilogueArgs((dummy,) * 9, (0.0,) * 6, 0)


@triton.jit
def grpo_token_epilogue(logp, old, ref, adv, isr, epi_scalars, EPI_FLAGS: tl.constexpr):
    """Per-token (loss ℓ, dℓ/dlogp, kl, ratio w); every tensor argument is a float32 block."""
    epsilon_low, epsilon_high, delta, beta, sapo_pos, sapo_neg = epi_scalars
    LOSS_KIND: tl.constexpr = tl.constexpr(EPI_FLAGS) >> KIND_SHIFT
    if HAS_OLD & EPI_FLAGS:
        w = tl.exp(logp - old)
    else:
        w = tl.exp(logp - logp)  # ratio ≡ 1, derivative w·dlogp keeps the A·∇logp gradient
    # A NaN ratio (a NaN log-prob, old log-prob or hidden state) must give a NaN loss, as
    # torch.minimum / torch.clamp give in grpo_math: tl.minimum / tl.maximum drop NaN by
    # default (min.f32 returns the other operand), which would turn a broken token into a
    # finite, wrong loss. Hence NAN_ALL on every min / max of w, and the derivative masks
    # below written so that a NaN w passes through (w > δ is False for NaN).
    if LOSS_KIND == KIND_CISPO:
        cap = tl.minimum(w, epsilon_high, propagate_nan=NAN_ALL)
        loss = -cap * adv * logp
        dloss = -cap * adv
    elif LOSS_KIND == KIND_DPPO:
        k = w
        if HAS_DELTA & EPI_FLAGS:
            k = tl.minimum(w, delta, propagate_nan=NAN_ALL)
        p = tl.exp(logp)
        change = p - p  # no old policy: the probability has not moved
        if HAS_OLD & EPI_FLAGS:
            change = p - tl.exp(old)
        inside = tl.where(adv > 0, change <= epsilon_high, change >= -epsilon_low)
        k = k * inside.to(tl.float32)  # a product, as in torch: NaN·0 and inf·0 are NaN
        loss = -k * adv * logp
        dloss = -k * adv
    elif LOSS_KIND == KIND_SAPO:
        t = tl.where(adv > 0, sapo_pos, sapo_neg)
        s = tl.sigmoid(t * (w - 1.0))
        loss = -(s * 4.0 / t) * adv
        dloss = -4.0 * adv * s * (1.0 - s) * w
    else:  # clipped surrogate
        tl.static_assert(LOSS_KIND == KIND_CLIPPED, "grpo_token_epilogue: unknown LOSS_KIND")
        lo = 1.0 - epsilon_low
        hi = 1.0 + epsilon_high
        c = tl.minimum(tl.maximum(w, lo, propagate_nan=NAN_ALL), hi, propagate_nan=NAN_ALL)
        u = w
        if HAS_DELTA & EPI_FLAGS:
            u = tl.minimum(w, delta, propagate_nan=NAN_ALL)
        a = u * adv
        b = c * adv
        loss = -tl.minimum(a, b, propagate_nan=NAN_ALL)
        # autograd's order (see the module docstring): the rollout ratio g, then the branch
        # minimum picks, then the clamps' zeros, then w last
        g = tl.zeros_like(w) + 1.0
        if HAS_ISR & EPI_FLAGS:
            g = isr
        half = tl.where(a == b, 0.5 * g, g)
        ga = tl.where(a > b, 0.0, half)
        gb = tl.where(b > a, 0.0, half)
        gw = tl.where((w >= lo) & (w <= hi), -gb * adv, 0.0)
        if HAS_DELTA & EPI_FLAGS:
            gw += tl.where(w <= delta, -ga * adv, 0.0)
        else:
            gw += -ga * adv
        dloss = gw * w
    if HAS_ISR & EPI_FLAGS:
        loss = loss * isr
        if LOSS_KIND != KIND_CLIPPED:
            dloss = dloss * isr
    kl = tl.zeros_like(logp)
    if HAS_KL & EPI_FLAGS:
        d = ref - logp
        e = tl.exp(d)
        kl = e - d - 1.0
        dkl = 1.0 - e
        if BIAS_CORRECT_KL & EPI_FLAGS:
            dkl = (dkl + kl) * w
            kl = kl * w
        loss = loss + beta * kl
        dloss = dloss + beta * dkl
    return loss, dloss, kl, w


@triton.jit
def load_token_weights(offs, mask, epi_tensors):
    """The bundle's per-token weights at `offs` [BLOCK] float32 (0 past the mask)."""
    _, _, _, _, wt_ptr, _, _, _, _ = epi_tensors
    return tl.load(wt_ptr + offs, mask=mask, other=0.0)


@triton.jit
def skipped_token_outputs(offs, mask, lse_ptr, ent_ptr, logp_ptr, epi_tensors):
    """The outputs of tokens a forward did not compute (weight 0): log-prob, entropy, weight·ℓ,
    weight·dℓ/dlogp and kl 0, the ratio 1, and lse NaN (the mark of a row not computed)."""
    _, _, _, _, _, lossw_ptr, glogp_ptr, kl_ptr, ratio_ptr = epi_tensors
    zero = tl.zeros_like(offs).to(tl.float32)
    tl.store(ent_ptr + offs, zero, mask=mask)
    tl.store(logp_ptr + offs, zero, mask=mask)
    tl.store(lse_ptr + offs, zero + float("nan"), mask=mask)
    tl.store(lossw_ptr + offs, zero, mask=mask)
    tl.store(glogp_ptr + offs, zero, mask=mask)
    tl.store(kl_ptr + offs, zero, mask=mask)
    tl.store(ratio_ptr + offs, zero + 1.0, mask=mask)


@triton.jit
def grpo_token_outputs(offs, mask, logp, epi_tensors, epi_scalars, EPI_FLAGS: tl.constexpr):
    """Loads a block of per-token GRPO inputs ([N] float32), applies the epilogue, stores
    weight·ℓ, weight·dℓ/dlogp, kl and the ratio; returns weight·dℓ/dlogp (the block's g_logp)."""
    old_ptr, ref_ptr, adv_ptr, isr_ptr, wt_ptr, lossw_ptr, glogp_ptr, kl_ptr, ratio_ptr = \
        epi_tensors
    adv = tl.load(adv_ptr + offs, mask=mask, other=0.0)
    wt = tl.load(wt_ptr + offs, mask=mask, other=0.0)
    old = logp
    ref = logp
    isr = wt
    if HAS_OLD & EPI_FLAGS:
        old = tl.load(old_ptr + offs, mask=mask, other=0.0)
    if HAS_KL & EPI_FLAGS:
        ref = tl.load(ref_ptr + offs, mask=mask, other=0.0)
    if HAS_ISR & EPI_FLAGS:
        isr = tl.load(isr_ptr + offs, mask=mask, other=1.0)
    loss, dloss, kl, w = grpo_token_epilogue(logp, old, ref, adv, isr, epi_scalars, EPI_FLAGS)
    # a token of weight 0 (padding) gets the outputs of a skipped token (skipped_token_outputs)
    # whatever its inputs hold: 0·NaN would be NaN (grpo_math.real_token_values)
    real = wt != 0
    tl.store(lossw_ptr + offs, tl.where(real, wt * loss, 0.0), mask=mask)
    coef = tl.where(real, wt * dloss, 0.0)
    tl.store(glogp_ptr + offs, coef, mask=mask)
    tl.store(kl_ptr + offs, tl.where(real, kl, 0.0), mask=mask)
    tl.store(ratio_ptr + offs, tl.where(real, w, 1.0), mask=mask)
    return coef
