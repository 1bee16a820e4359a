"""Hugging Face integration: GRPO loss and log-probs of any `AutoModelForCausalLM`, from hidden
states, without projecting prompt positions (or anything) to full-vocabulary logits.

    loss, metrics = causal_lm_grpo_loss(model, input_ids, attention_mask, logits_to_keep=T,
                                        advantages=adv, loss_fn=FusedLinearGRPOLoss(beta=0.04),
                                        ref_logps=ref)

`input_ids` is prompt + completion, [B, L]; the last T columns are the completion. The hidden state
at position L-T-1+t predicts completion token t, so the loss uses hidden[:, -T-1:-1].
Works with tied embeddings (the output embedding is found with `get_output_embeddings()`, whatever
it is called), lm_head biases, PEFT-wrapped models, and DDP/accelerate wrappers.
"""

from __future__ import annotations

import torch
from torch import nn

from .fused_linear_grpo import fused_linear_grpo_loss_with_params
from .modules import FusedLinearGRPOLoss
from .selective_logprobs import selective_logprobs

# Config attributes that change logits after lm_head; a plain linear head would ignore them.
_UNSUPPORTED_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP/FSDP-style `.module` wrappers and PEFT wrappers: the `PreTrainedModel` inside."""
    while True:
        if hasattr(model, "get_base_model"):  # peft.PeftModel
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return model


def output_head(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V, D], bias [V] | None) of the model's output embedding."""
    inner = unwrap_model(model)
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"{type(inner).__name__} has no output embedding (get_output_embeddings() "
                         "returned None): it is not a causal language model")
    config = getattr(inner, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _UNSUPPORTED_LOGIT_TRANSFORMS:
        value = getattr(text_config, name, None)
        if value not in (None, 1, 1.0):
            raise NotImplementedError(
                f"{type(inner).__name__} transforms its logits ({name}={value}); the fused linear "
                "loss computes plain hidden @ lm_head.weight.T and would be wrong for it"
            )
    return head.weight, getattr(head, "bias", None)


def _body(inner: nn.Module) -> nn.Module:
    body = getattr(inner, "base_model", None)
    if body is None or body is inner:
        raise ValueError(f"cannot find the transformer body of {type(inner).__name__} "
                         "(model.base_model)")
    return body


def completion_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_to_keep: int,
    **model_kwargs,
) -> torch.Tensor:
    """Final hidden states that predict the last `logits_to_keep` tokens: [B, T, D].

    An unwrapped model runs its body (no lm_head at all). A wrapped model (DDP, accelerate) must be
    called through its wrapper for gradient synchronization, so it is called with
    logits_to_keep=1 (a [B, 1, V] projection, discarded) while a hook captures the body's output.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
    L = input_ids.shape[1]
    if not 0 < logits_to_keep < L:
        raise ValueError(
            f"logits_to_keep must be in [1, L-1] = [1, {L - 1}] (the completion length; at "
            f"least one prompt token must precede it), got {logits_to_keep}"
        )
    inner = unwrap_model(model)
    body = _body(inner)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                  **model_kwargs)
    if inner is model:
        out = body(**kwargs)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    else:
        captured = []

        def grab(_module, _args, out):
            captured.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)

        handle = body.register_forward_hook(grab)
        try:
            model(logits_to_keep=1, **kwargs)
        finally:
            handle.remove()
        hidden = captured[-1]
    return hidden[:, -logits_to_keep - 1:-1, :]


def _head_for(hidden: torch.Tensor, model: nn.Module):
    weight, bias = output_head(model)
    if weight.dtype != hidden.dtype:  # e.g. autocast: bf16 activations, fp32 master weights
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    return weight, bias


def causal_lm_grpo_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_to_keep: int,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    *,
    loss_fn: FusedLinearGRPOLoss | None = None,
    num_items_in_batch=None,
    importance_sampling_ratio: torch.Tensor | None = None,
    **model_kwargs,
):
    """GRPO loss of a causal LM on prompt+completion `input_ids` [B, L]; the completion is the
    last `logits_to_keep` tokens. `loss_fn` holds the hyperparameters (default: TRL's)."""
    loss_fn = loss_fn if loss_fn is not None else FusedLinearGRPOLoss()
    hidden = completion_hidden_states(model, input_ids, attention_mask, logits_to_keep,
                                      **model_kwargs)
    weight, bias = _head_for(hidden, model)
    completion_ids = input_ids[:, -logits_to_keep:]
    return fused_linear_grpo_loss_with_params(
        hidden, weight, completion_ids, advantages, completion_mask, old_logps, ref_logps, bias,
        loss_fn.params, num_items_in_batch, importance_sampling_ratio,
    )


@torch.no_grad()
def causal_lm_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    batch_size: int | None = None,
    **model_kwargs,
) -> torch.Tensor:
    """No-grad log-probs [B, T] float32 of the last `logits_to_keep` tokens (old or reference
    policy scoring), in micro-batches of `batch_size` sequences, without logits."""
    B = input_ids.shape[0]
    step = batch_size or B
    if step <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    out = []
    for i in range(0, B, step):
        am = None if attention_mask is None else attention_mask[i:i + step]
        hidden = completion_hidden_states(model, input_ids[i:i + step], am, logits_to_keep,
                                          **model_kwargs)
        weight, bias = _head_for(hidden, model)
        out.append(selective_logprobs(hidden, weight, input_ids[i:i + step, -logits_to_keep:],
                                      bias, temperature=temperature))
    return torch.cat(out, dim=0)
