"""Pure-PyTorch reference: the same functions as the package, by materializing the logits.

This is what the kernels are tested against (run in float64 it is the "truth") and what the
benchmarks compare with. It holds [N, V] logits in float32, so it is only for moderate N·V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .grpo_math import grpo_loss_from_logps
from .params import GRPOParams, signature_with_params
from .validation import (
    check_grad_filter,
    check_linear_head,
    check_linear_loss_inputs,
    check_logit_transform,
    check_logits,
    check_logits_loss_inputs,
    check_temperature,
    check_token_ids,
)


def transform_logits(logits, softcap=None, logit_scale=None):
    """The model's logits from raw ones: z = softcap·tanh(logit_scale·y / softcap), the scale
    first, then the cap (each left out when None), in float32 (float64 for float64 input)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def logprobs_from_logits(logits, targets, *, temperature=1.0, softcap=None, logit_scale=None,
                         return_entropy=False):
    """logits [..., V] -> logp [...] (and entropy [...]), float32 (float64 for float64 input),
    of softmax(cap(s·logits) / temperature) (`transform_logits`; the temperature comes last).
    Checked as `grpo_kernels.logprobs_from_logits` checks them (a gather would take targets of
    another shape, or fail inside on an id outside [0, V))."""
    temperature = check_temperature(temperature)
    softcap, logit_scale = check_logit_transform(softcap, logit_scale, temperature)
    check_logits(logits)
    targets = check_token_ids("targets", targets, logits.shape[-1], logits.shape[:-1],
                              logits.device, "logits.shape[-1]", source="logits")
    z = transform_logits(logits, softcap, logit_scale) / temperature
    log_p = F.log_softmax(z, dim=-1)
    logp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logp
    return logp, -(log_p.exp() * log_p).sum(-1)


def _head_logits(hidden, weight, bias):
    # [..., V] in weight's dtype, as an eager model computes them: hidden's own dtype, or float32
    # for 16-bit hidden with a float32 head (mixed head precision; the cast is exact)
    logits = hidden.to(weight.dtype) @ weight.T
    return logits if bias is None else logits + bias


def selective_logprobs(hidden, weight, targets, bias=None, *, temperature=1.0, softcap=None,
                       logit_scale=None, return_entropy=False, grad_filter=None):
    """Reference for `grpo_kernels.selective_logprobs` (materializes [..., V] logits).
    Always exact: grad_filter is validated for signature parity and has no effect."""
    check_linear_head(hidden, weight, bias)
    check_grad_filter(grad_filter, hidden.dtype)
    temperature = check_temperature(temperature)
    check_logit_transform(softcap, logit_scale, temperature)
    ids = check_token_ids("targets", targets, weight.shape[0], hidden.shape[:-1], hidden.device)
    return logprobs_from_logits(_head_logits(hidden, weight, bias), ids,
                                temperature=temperature, softcap=softcap,
                                logit_scale=logit_scale, return_entropy=return_entropy)


@signature_with_params
def grpo_loss(logits, completion_ids, advantages, completion_mask=None, old_logps=None,
              ref_logps=None, *, num_items_in_batch=None, importance_sampling_ratio=None,
              cu_seqlens=None, softcap=None, logit_scale=None, sampling_logps=None, params=None,
              **hyperparameters):
    """Reference for `grpo_kernels.grpo_loss`: logits [B, T, V] (packed: [N, V] and
    cu_seqlens) -> (loss, metrics)."""
    params = GRPOParams.resolve(params, hyperparameters)
    transform = check_logit_transform(softcap, logit_scale, params.temperature)
    ids, inputs = check_logits_loss_inputs(logits, completion_ids, params, completion_mask,
                                           advantages, old_logps, ref_logps,
                                           importance_sampling_ratio, num_items_in_batch,
                                           cu_seqlens=cu_seqlens, sampling_logps=sampling_logps)
    return _loss_from_logits(logits, ids, inputs, params, *transform)


def _loss_from_logits(logits, ids, inputs, params, softcap=None, logit_scale=None):
    """logits [B, T, V], validated ids [B, T] and LossInputs -> (loss, metrics); packed:
    logits [N, V] and ids [N]. The rows of padded positions are read as zeros: whatever they
    hold (NaN, ±inf) adds nothing to the loss or any gradient, as on the kernels' routes."""
    logits = torch.where((inputs.mask != 0)[..., None], logits, 0.0)
    logp, ent = logprobs_from_logits(logits, ids, temperature=params.temperature,
                                     softcap=softcap, logit_scale=logit_scale,
                                     return_entropy=True)
    return grpo_loss_from_logps(logp, ent, inputs, params)


@signature_with_params
def fused_linear_grpo_loss(hidden, weight, completion_ids, advantages, completion_mask=None,
                           old_logps=None, ref_logps=None, bias=None, *, num_items_in_batch=None,
                           importance_sampling_ratio=None, cu_seqlens=None, grad_filter=None,
                           softcap=None, logit_scale=None, sampling_logps=None, params=None,
                           **hyperparameters):
    """Reference for `grpo_kernels.fused_linear_grpo_loss` (materializes [B, T, V] logits).
    Always exact: grad_filter is validated for signature parity and has no effect."""
    params = GRPOParams.resolve(params, hyperparameters)
    transform = check_logit_transform(softcap, logit_scale, params.temperature)
    # validate before materializing [B, T, V] logits, with the same errors as the kernel path
    ids, inputs = check_linear_loss_inputs(hidden, weight, bias, completion_ids, params,
                                           completion_mask, advantages, old_logps, ref_logps,
                                           importance_sampling_ratio, num_items_in_batch,
                                           cu_seqlens=cu_seqlens, sampling_logps=sampling_logps)
    check_grad_filter(grad_filter, hidden.dtype)
    # padded positions' hidden states read as zeros (see _loss_from_logits)
    hidden = torch.where((inputs.mask != 0)[..., None], hidden, 0.0)
    return _loss_from_logits(_head_logits(hidden, weight, bias), ids, inputs, params, *transform)
