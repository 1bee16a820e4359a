"""Hugging Face causal LMs: GRPO loss and log-probs of any `AutoModelForCausalLM`, from hidden
states, without projecting prompt positions (or anything) to full-vocabulary logits.

    loss, metrics = causal_lm_grpo_loss(model, input_ids, attention_mask, logits_to_keep=T,
                                        advantages=adv, loss_fn=FusedLinearGRPOLoss(beta=0.04),
                                        ref_logps=ref)

`input_ids` is prompt + completion, [B, L]; the last T columns are the completion. The hidden state
at position L-T-1+t predicts completion token t, so the loss uses hidden[:, -T-1:-1].
Works with tied embeddings (the output embedding is found with `get_output_embeddings()`, whatever
it is called, e.g. BioGPT's `output_projection`), lm_head biases, PEFT-wrapped models,
torch.compile and DDP/accelerate wrappers. Models the hidden-state path would get wrong raise
instead (checked once per model, `check_output_head`): logit soft-capping or scaling in the config,
or a head that transforms the body's output before its output embedding (BERT-style heads).

Old/reference scoring: `causal_lm_logprobs` (no grad); `completion_logprobs` is the same with grad.

Packed (padding-free) rows: sequences end to end in rows [R, W], `attention_mask=None` and
`position_ids` [R, W] restarting at 0 for every sequence (transformers then attends within each
sequence only). `logits_to_keep` is then a LongTensor [N] of positions in the flattened rows
(for one row, transformers' own convention): those whose hidden state predicts a completion
token (the token after it), and the loss takes `cu_seqlens` [S + 1] over those N tokens.
`grpo_kernels.hf.pack_sequences` builds all of it from a padded batch.

Precision of the lm_head projection ("head dtype"): under autocast it runs in the autocast dtype,
as the model's own `lm_head` would; otherwise in the dtype of the head's weight. `head_dtype=`
overrides both. Hidden states are cast to the head dtype, except 16-bit ones with a float32 head
(TRL's `cast_lm_head_to_fp32`), which the kernels take as they are (mixed head precision: float32
logits of the float32 head, tensor cores kept). The kernels accumulate in float32 always.

PEFT adapters on the output embedding: a LoRA adapter is folded into the fused call (extra hidden
and weight columns, `head_adapters`), so the logits are the wrapped model's and the adapter
trains; `modules_to_save` heads use the copy in use; other adapter types raise.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..functional import selective_logprobs
from ..modules import FusedLinearGRPOLoss
from .head_adapters import ResolvedHead, fold_lora, resolve_head
from .packed_rows import check_packed_positions, completion_targets, keep_positions
from .zero3 import gathered_head

__all__ = ["causal_lm_grpo_loss", "causal_lm_logprobs", "check_output_head",
           "completion_hidden_states", "completion_logprobs", "head_for", "hidden_logprobs",
           "output_head", "resolved_head", "unwrap_model"]

# Config attributes that change logits after lm_head; a plain linear head would ignore them.
_UNSUPPORTED_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                                 "output_multiplier", "lm_head_multiplier")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP/FSDP-style `.module` wrappers, torch.compile's `_orig_mod` and PEFT wrappers:
    the `PreTrainedModel` inside."""
    while True:
        if hasattr(model, "get_base_model"):  # peft.PeftModel
            model = model.get_base_model()
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return model


def resolved_head(model: nn.Module) -> ResolvedHead:
    """What the model's output embedding computes: base weight [V, D], bias [V] | None and any
    active PEFT LoRA terms (`head_adapters`). Raises for heads the fused path cannot reproduce:
    none at all, a sharded (empty) weight, logit soft-capping/scaling in the config, or an
    adapter other than plain LoRA (the error names the module)."""
    inner = unwrap_model(model)
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no output embedding (get_output_embeddings() "
                         "returned None): it is not a causal language model")
    where = f"{type(inner).__name__}.{_module_name(inner, head)}"
    # DeepSpeed ZeRO-3: full differentiable copies of the sharded weight and bias (zero3.py)
    resolved = gathered_head(resolve_head(head, where), where)
    weight = resolved.weight
    if weight.dim() != 2 or weight.numel() == 0:
        # some FSDP set-ups leave an empty local shard outside the forward (ZeRO-3's is gathered)
        raise ValueError(f"the output embedding of {type(inner).__name__} has weight shape "
                         f"{tuple(weight.shape)}, not a full [V, D] matrix (sharded "
                         "parameters are not supported)")
    config = getattr(inner, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _UNSUPPORTED_LOGIT_TRANSFORMS:
        value = getattr(text_config, name, None)
        if value not in (None, 1, 1.0):
            raise NotImplementedError(
                f"{type(inner).__name__} transforms its logits ({name}={value}); the fused linear "
                "loss computes plain hidden @ lm_head.weight.T and would be wrong for it"
            )
    return resolved


_HEAD_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _module_name(root: nn.Module, module: nn.Module) -> str:
    """Qualified name of `module` inside `root` (for error messages), else its class name;
    cached per module (the walk over named_modules would otherwise run every step)."""
    if module not in _HEAD_NAMES:
        _HEAD_NAMES[module] = next((name for name, m in root.named_modules() if m is module),
                                   type(module).__name__)
    return _HEAD_NAMES[module]


def output_head(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V, D], bias [V] | None) of the model's output embedding (for a PEFT
    `modules_to_save` head, the copy in use). A head with an active LoRA adapter is not one
    weight: this raises then, and `head_for` folds the adapter in."""
    resolved = resolved_head(model)
    if resolved.lora:
        names = ", ".join(t.adapter for t in resolved.lora)
        raise ValueError(f"the output embedding of {type(unwrap_model(model)).__name__} carries "
                         f"active LoRA adapters ({names}): its logits are not hidden @ weight.T; "
                         "use grpo_kernels.hf.head_for(hidden, model), which folds them in")
    return resolved.weight, resolved.bias


def _body(inner: nn.Module) -> nn.Module:
    body = getattr(inner, "base_model", None)
    if body is None or body is inner:
        raise ValueError(f"cannot find the transformer body of {type(inner).__name__} "
                         "(model.base_model)")
    return body


def _check_batch(input_ids, attention_mask, logits_to_keep) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be a [B, L] tensor, got {shape}")
    if isinstance(logits_to_keep, torch.Tensor):
        check_packed_positions(input_ids, attention_mask, logits_to_keep)
        return
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):
        shape = getattr(attention_mask, "shape", type(attention_mask))
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, "
                         f"got {tuple(shape) if isinstance(shape, torch.Size) else shape}")
    L = input_ids.shape[1]
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        raise TypeError(f"logits_to_keep must be an int (the completion length), got "
                        f"{type(logits_to_keep).__name__}")
    if not 0 < logits_to_keep < L:
        raise ValueError(
            f"logits_to_keep must be in [1, L-1] = [1, {L - 1}] (the completion length; at "
            f"least one prompt token must precede it), got {logits_to_keep}"
        )


def _last_hidden(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.last_hidden_state


# Models whose output embedding was seen to take the body's output unchanged (checked once each).
_HEAD_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_head_input(inner: nn.Module, body: nn.Module, input_ids, attention_mask) -> None:
    """Once per model: run its own forward on one sequence and check that the output embedding
    is applied to the body's output as is. BERT-style heads (a dense+norm transform first, e.g.
    RobertaForCausalLM) or a rescaled hidden state would otherwise give silently wrong losses."""
    if inner in _HEAD_CHECKED:
        return
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        return  # output_head() raises the error
    seen = {}
    hooks = [body.register_forward_hook(lambda _m, _a, out: seen.setdefault("body", out)),
             head.register_forward_pre_hook(lambda _m, args: seen.setdefault("head", args[0]))]
    devices = [input_ids.device] if input_ids.is_cuda else []
    try:  # no grad, and no RNG draws visible outside (dropout)
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            am = None if attention_mask is None else attention_mask[:1]
            inner(input_ids=input_ids[:1], attention_mask=am, logits_to_keep=1, use_cache=False)
    except Exception:
        # the head itself may fail on its own (e.g. a float32 head on a bf16 body, which we cast
        # and the model does not); its input was captured before it ran, which is all we need
        if "head" not in seen:
            raise
    finally:
        for h in hooks:
            h.remove()
    body_out = _last_hidden(seen["body"])[:, -1:] if "body" in seen else None
    head_in = seen.get("head")
    if (body_out is None or head_in is None or head_in.shape != body_out.shape
            or not torch.equal(head_in, body_out.to(head_in.device))):
        raise NotImplementedError(
            f"{type(inner).__name__} does not apply its output embedding "
            f"({type(head).__name__}) directly to the output of its body "
            f"({type(body).__name__}); a head with its own transform is not supported")
    _HEAD_CHECKED[inner] = True


def check_output_head(model: nn.Module, input_ids: torch.Tensor | None = None) -> None:
    """Raise (ValueError / NotImplementedError) unless the hidden-state path reproduces `model`'s
    own logits: an output embedding exists, no logit soft-capping/scaling, and the head takes the
    body's output as is (checked with one short forward of `input_ids` [B, L], default a
    2-token dummy). Cached per model; `completion_hidden_states` runs the same check."""
    inner = unwrap_model(model)
    resolved_head(inner)
    if input_ids is None:
        device = next(inner.parameters()).device
        input_ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    _check_head_input(inner, _body(inner), input_ids, None)


def completion_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_to_keep: int | torch.Tensor,
    *,
    return_router_logits: bool = False,
    **model_kwargs,
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Final hidden states that predict the last `logits_to_keep` tokens: [B, T, D]; for a
    packed rows (`logits_to_keep` = positions [N]), those positions' states [1, N, D].

    An unwrapped model runs its body (no lm_head at all). A wrapped model (DDP, accelerate,
    torch.compile, PEFT) must be called through its wrapper (gradient synchronization, adapters),
    so it is called with logits_to_keep=1 (a [B, 1, V] projection, discarded) while a hook
    captures the body's output.

    `model_kwargs` go to the body as they are, e.g. a vision-language model's pixel_values and
    image_grid_thw (the body merges the image features into the sequence and computes its own
    positions). return_router_logits=True (Mixture-of-Experts models) runs the body with
    output_router_logits=True and returns (hidden, the body output's router_logits), from which
    `load_balancing_loss` computes the auxiliary loss.
    """
    _check_batch(input_ids, attention_mask, logits_to_keep)
    inner = unwrap_model(model)
    body = _body(inner)
    if model_kwargs:  # extra inputs (images, positions) need not slice to one row: text dummy
        _check_head_input(inner, body, input_ids.new_zeros(1, 2), None)
    else:
        _check_head_input(inner, body, input_ids, attention_mask)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                  **model_kwargs)
    if return_router_logits:
        kwargs["output_router_logits"] = True
    if inner is model:
        out = body(**kwargs)
    else:
        captured = []
        handle = body.register_forward_hook(lambda _m, _a, body_out: captured.append(body_out))
        try:
            model(logits_to_keep=1, **kwargs)
        finally:
            handle.remove()
        if not captured:
            raise RuntimeError(f"calling {type(model).__name__} never ran its body "
                               f"{type(body).__name__}; cannot capture the hidden states")
        out = captured[-1]
    hidden = keep_positions(_last_hidden(out), logits_to_keep)
    if not return_router_logits:
        return hidden
    router_logits = getattr(out, "router_logits", None)
    if router_logits is None:
        raise ValueError(f"{type(body).__name__} returned no router_logits: "
                         f"{type(inner).__name__} is not a Mixture-of-Experts model")
    return hidden, router_logits


def head_for(hidden: torch.Tensor, model: nn.Module, head_dtype: torch.dtype | None = None):
    """(hidden', weight, bias) for one fused linear call that reproduces `model`'s output
    embedding on `hidden` [B, T, D] (the body's output).

    weight [V, D'] and bias [V] | None are in the head dtype (see the module docstring). hidden'
    [B, T, D'] is cast to the head dtype too, except 16-bit hidden states with a float32 head
    (e.g. TRL's `cast_lm_head_to_fp32`), which stay as they are: the kernels take that pair
    (mixed head precision) and keep the matmul on tensor cores. A PEFT LoRA adapter on the head
    adds its rank as extra columns (D' = D + r, `head_adapters.fold_lora`)."""
    resolved = resolved_head(model)
    weight = resolved.weight
    if head_dtype is None:
        device = hidden.device.type
        if torch.is_autocast_enabled(device):  # the model's own lm_head would run in this dtype
            head_dtype = torch.get_autocast_dtype(device)
        else:
            head_dtype = weight.dtype
    if weight.device != hidden.device:  # device_map: the body may end on another device
        hidden = hidden.to(weight.device)
    mixed = head_dtype == torch.float32 and hidden.dtype in (torch.bfloat16, torch.float16)
    kernel_hidden = hidden if mixed or hidden.dtype == head_dtype else hidden.to(head_dtype)
    return fold_lora(resolved, hidden, kernel_hidden, head_dtype)


def _no_autocast(x: torch.Tensor):
    """Autocast off for the head: `head_for` already chose its dtype, and autocast would recast
    the PyTorch path's matmuls (e.g. undo an explicit float32 head)."""
    return torch.autocast(x.device.type, enabled=False)


def causal_lm_grpo_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_to_keep: int | torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    *,
    loss_fn: FusedLinearGRPOLoss | None = None,
    num_items_in_batch=None,
    importance_sampling_ratio: torch.Tensor | None = None,
    head_dtype: torch.dtype | None = None,
    cu_seqlens: torch.Tensor | None = None,
    **model_kwargs,
):
    """GRPO loss of a causal LM on prompt+completion `input_ids` [B, L]; the completion is the
    last `logits_to_keep` tokens. `loss_fn` holds the hyperparameters (default: TRL's).
    `completion_mask`, `old_logps`, `ref_logps`: [B, T]; `advantages`: [B], [B, 1] or [B, T].

    Packed rows (see the module docstring; `pack_sequences` builds them): input_ids [R, W],
    attention_mask None, `position_ids=` [R, W], logits_to_keep = positions [N], `cu_seqlens`
    [S + 1] over the N completion tokens; then old/ref log-probs are [N], advantages [S] or [N],
    and there is no completion mask (every kept token counts).
    Returns (loss: 0-dim float32, metrics: dict of detached 0-dim tensors)."""
    loss_fn = loss_fn if loss_fn is not None else FusedLinearGRPOLoss()
    if not isinstance(loss_fn, FusedLinearGRPOLoss):
        raise TypeError(f"loss_fn must be a grpo_kernels.FusedLinearGRPOLoss, got "
                        f"{type(loss_fn).__name__}")
    packed = isinstance(logits_to_keep, torch.Tensor)
    if packed and (cu_seqlens is None or completion_mask is not None):
        raise ValueError("packed rows (logits_to_keep = positions) need cu_seqlens [S + 1] "
                         "and no completion_mask (every kept position is a loss token)")
    if not packed and cu_seqlens is not None:
        raise ValueError("cu_seqlens is for packed rows: pass logits_to_keep as the positions "
                         "[N] (see pack_sequences), not an int")
    hidden = completion_hidden_states(model, input_ids, attention_mask, logits_to_keep,
                                      **model_kwargs)
    hidden, weight, bias = head_for(hidden, model, head_dtype)
    completion_ids = completion_targets(input_ids, logits_to_keep).to(hidden.device)
    if packed:  # [1, N, D] -> [N, D], [1, N] -> [N]: the losses' packed form
        hidden, completion_ids = hidden[0], completion_ids[0]
    with _no_autocast(hidden):  # inputs are already in the head dtype; keep it
        return loss_fn(hidden, weight, completion_ids, advantages, completion_mask, old_logps,
                       ref_logps, bias, num_items_in_batch, importance_sampling_ratio,
                       cu_seqlens=cu_seqlens)


def completion_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_to_keep: int | torch.Tensor,
    *,
    temperature: float = 1.0,
    batch_size: int | None = None,
    return_entropy: bool = False,
    head_dtype: torch.dtype | None = None,
    **model_kwargs,
):
    """Log-probs [B, T] float32 of the last `logits_to_keep` tokens (and entropies [B, T] if
    `return_entropy`), in micro-batches of `batch_size` sequences, without logits. Packed rows
    (logits_to_keep = positions [N], see `causal_lm_grpo_loss`) give [N], in one chunk.
    Differentiable; see `causal_lm_logprobs` for the no-grad scoring entry point."""
    _check_batch(input_ids, attention_mask, logits_to_keep)
    B = input_ids.shape[0]
    packed = isinstance(logits_to_keep, torch.Tensor)  # positions span all rows: one chunk
    step = max(B, 1) if batch_size is None or packed else batch_size
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    logps, ents = [], []
    for i in range(0, max(B, 1), step):  # one (empty) chunk for B = 0
        am = None if attention_mask is None else attention_mask[i:i + step]
        # per-sequence model inputs (e.g. position_ids [B, L]) follow the chunk; others as given
        kwargs = {k: v[i:i + step] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == B
                  else v for k, v in model_kwargs.items()}
        hidden = completion_hidden_states(model, input_ids[i:i + step], am, logits_to_keep,
                                          **kwargs)
        ids = completion_targets(input_ids[i:i + step], logits_to_keep)
        out = hidden_logprobs(hidden, model, ids, temperature=temperature,
                              return_entropy=return_entropy, head_dtype=head_dtype)
        logps.append(out[0] if return_entropy else out)
        if return_entropy:
            ents.append(out[1])
    logp = torch.cat(logps, dim=0)
    ent = torch.cat(ents, dim=0) if return_entropy else None
    if packed:  # [1, N] -> [N]
        logp, ent = logp[0], None if ent is None else ent[0]
    return (logp, ent) if return_entropy else logp


def hidden_logprobs(hidden: torch.Tensor, model: nn.Module, completion_ids: torch.Tensor, *,
                    temperature: float = 1.0, return_entropy: bool = False,
                    head_dtype: torch.dtype | None = None):
    """Log-probs [B, T] float32 of `completion_ids` [B, T] (and entropies [B, T] if
    `return_entropy`) under `model`'s output embedding on the body's hidden states [B, T, D]
    (`completion_hidden_states`), without logits."""
    hidden, weight, bias = head_for(hidden, model, head_dtype)
    with _no_autocast(hidden):
        return selective_logprobs(hidden, weight, completion_ids.to(hidden.device), bias,
                                  temperature=temperature, return_entropy=return_entropy)


def causal_lm_logprobs(model: nn.Module, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor | None,
                       logits_to_keep: int | torch.Tensor, **kwargs):
    """No-grad log-probs [B, T] float32 of the last `logits_to_keep` tokens (old or reference
    policy scoring), without logits; the keywords of `completion_logprobs`."""
    with torch.no_grad():
        return completion_logprobs(model, input_ids, attention_mask, logits_to_keep, **kwargs)
