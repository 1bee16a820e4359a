"""Hugging Face causal LMs: GRPO loss and log-probs of any `AutoModelForCausalLM`, from hidden
states, without projecting prompt positions (or anything) to full-vocabulary logits.

    loss, metrics = causal_lm_grpo_loss(model, input_ids, attention_mask, logits_to_keep=T,
                                        advantages=adv, loss_fn=FusedLinearGRPOLoss(beta=0.04),
                                        ref_logps=ref)

`input_ids` is prompt + completion, [B, L]; the last T columns are the completion. The hidden state
at position L-T-1+t predicts completion token t, so the loss uses hidden[:, -T-1:-1].
Works with tied embeddings (the output embedding is found with `get_output_embeddings()`, whatever
it is called, e.g. BioGPT's `output_projection`), lm_head biases, PEFT-wrapped models,
torch.compile and DDP/accelerate wrappers. A model's final-logit soft-capping or logit scale
(`logit_transform`) goes into the fused calls. Models the hidden-state path would get wrong raise
instead (checked once per model, `check_output_head` in head_check.py): logits that are not the
head's output under the transform its config names, or a head that transforms the body's output
before its output embedding (BERT-style heads).

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

Tensor parallelism (a model loaded with transformers' `tp_plan="auto"`): the head's weight is a
DTensor sharded Shard(0) along the vocabulary, and the fused calls take it as it is
(`grpo_kernels.parallel`): each rank computes its shard's statistics, the ranks combine them, and
no rank holds [B, T, V] logits; the model's own head, which gathers them, runs only in the
once-per-model check (one position).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import value_checks
from ..functional import selective_logprobs
from ..modules import FusedLinearGRPOLoss
from ..params import FIELD_NAMES
from ..validation import FLOAT_DTYPES, is_id_dtype
from .head_check import (
    check_head_input,
    check_output_head,
    last_hidden,
    logit_transform,
    probe_ids,
)
from .moe import router_logits_off
from .output_head import head_for, output_head, resolved_head, unwrap_model
from .packed_rows import check_packed_positions, completion_targets, keep_positions

__all__ = ["causal_lm_grpo_loss", "causal_lm_logprobs", "check_output_head",
           "completion_hidden_states", "completion_logprobs", "head_for", "hidden_logprobs",
           "logit_transform", "output_head", "resolved_head", "unwrap_model"]


def _check_batch(input_ids, attention_mask, logits_to_keep, prompt_end: bool = True):
    """Shapes and types of a batch; with `prompt_end`, also the prompts' padding side
    (`_check_prompt_end`). Returns None or, on CUDA, that check's device flag (for `poison`)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be a [B, L] tensor, got {shape}")
    if not is_id_dtype(input_ids.dtype):  # the embedding would fail inside the model
        raise TypeError(f"input_ids must be an integer tensor of token ids, got {input_ids.dtype}")
    if isinstance(logits_to_keep, torch.Tensor):
        check_packed_positions(input_ids, attention_mask, logits_to_keep)
        return None
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
    if attention_mask is None or not prompt_end:
        return None
    return _check_prompt_end(attention_mask, logits_to_keep)


_RIGHT_PADDED = ("attention_mask: {rows}padding in the prompt's last column (L - T - 1) before a "
                 "real completion token, which is predicted from there; pad prompts on the left "
                 "(tokenizer.padding_side = 'left')")


def _check_prompt_end(attention_mask: torch.Tensor, T: int) -> torch.Tensor | None:
    """The hidden state at column L - T - 1 predicts the first completion token (column L - T):
    where that token is real, it must be too. A right-padded prompt puts a padding position
    there, whose hidden state predicts nothing (and the log-prob would be silently wrong).

    On the CPU the rows are read and named now. On CUDA a host read would wait for the queue
    (one sync per call): a device check instead (`value_checks.defer`), whose flag is returned
    to make the call's hidden states NaN; under torch.compile an in-graph assertion."""
    L = attention_mask.shape[1]
    bad = (attention_mask[:, L - T - 1] == 0) & (attention_mask[:, L - T] != 0)  # [B]
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), _RIGHT_PADDED.format(rows="a row has "))
        return None
    if bad.device.type == "cuda":
        failed = bad.any()
        value_checks.defer(failed, _RIGHT_PADDED.format(rows="a row has "))
        return failed
    if bool(bad.any()):
        rows = bad.nonzero().squeeze(1)[:8].tolist()
        raise ValueError(_RIGHT_PADDED.format(rows=f"rows {rows} have "))
    return None


# Keywords of the loss (GRPO hyperparameters, kernel options, per-token inputs): never inputs of
# a model body, whose **kwargs would take and ignore them
_LOSS_KEYWORDS = frozenset(FIELD_NAMES) | {
    "params", "grad_filter", "softcap", "logit_scale", "vocab_group", "advantages",
    "completion_mask", "old_logps", "ref_logps", "sampling_logps", "return_terms",
    "return_token_values", "return_entropy"}


def _check_input_ids(inner: nn.Module, input_ids: torch.Tensor, model_kwargs: dict) -> None:
    """Every id inside the model's input embedding: one outside fails deep in the embedding (an
    IndexError). Checked on the CPU, where the read is free; on CUDA a host read would wait for
    the queue, and the embedding's own device assert stops the call. Not checked with extra
    model inputs (a vision-language model may place image ids past the text vocabulary)."""
    if model_kwargs or input_ids.device.type != "cpu" or torch.compiler.is_compiling():
        return
    try:
        size = getattr(inner.get_input_embeddings(), "num_embeddings", None)
    except (AttributeError, NotImplementedError):  # no (standard) input embedding to read
        return
    if isinstance(size, int):
        value_checks.check_token_id_values("input_ids", input_ids, size,
                                           "get_input_embeddings().num_embeddings")


def _check_head_dtype(head_dtype) -> None:
    if head_dtype is not None and head_dtype not in FLOAT_DTYPES:
        raise TypeError("head_dtype must be None or one of torch.float16, torch.bfloat16, "
                        f"torch.float32, torch.float64, got {head_dtype!r}")


def _check_model_kwargs(model_kwargs: dict) -> None:
    """Refuse loss keywords among the keywords that go to the model's body."""
    misplaced = sorted(set(model_kwargs) & _LOSS_KEYWORDS)
    if misplaced:
        raise TypeError(
            f"{', '.join(misplaced)}: not a keyword here, and the model's body (which takes "
            "the other keywords) would ignore it; GRPO hyperparameters and kernel options are "
            "set on loss_fn=FusedLinearGRPOLoss(...), temperature also by completion_logprobs("
            "temperature=...)")


def _check_mask_form(inner: nn.Module, attention_mask) -> None:
    """A 4-D mask in the form the model's attention reads: eager attention adds the mask to its
    scores, so a boolean one (True: attend), sdpa's form, would shift them instead of masking."""
    impl = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    if (impl == "eager" and isinstance(attention_mask, torch.Tensor)
            and attention_mask.dim() == 4 and attention_mask.dtype == torch.bool):
        raise ValueError(
            f"attention_mask is a boolean 4-D mask, but {type(inner).__name__} runs eager "
            "attention, which adds its mask to the scores (0 or the dtype's minimum): build "
            "shared rows with share_prompts(..., model_config=model.config)")


def _is_4d(attention_mask) -> bool:
    return len(getattr(attention_mask, "shape", ())) == 4


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
    right_padded = _check_batch(input_ids, attention_mask, logits_to_keep)
    _check_model_kwargs(model_kwargs)
    inner = unwrap_model(model)
    _check_input_ids(inner, input_ids, model_kwargs)
    _check_mask_form(inner, attention_mask)
    if model_kwargs or _is_4d(attention_mask):  # extra inputs (images, positions) and 4-D
        # masks need not slice to one row (a BlockMask cannot): ordinary text for the check
        body = check_head_input(inner, probe_ids(inner).to(input_ids.device), None)
    else:
        body = check_head_input(inner, input_ids, attention_mask)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                  **model_kwargs)
    if return_router_logits:
        kwargs["output_router_logits"] = True
    elif inner is not model:  # the wrapper runs the whole model, whose forward would add an
        # MoE config's aux loss over this mask (a shared row's 4-D mask fails there)
        kwargs = {**router_logits_off(inner), **kwargs}
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
    hidden = value_checks.poison(keep_positions(last_hidden(out), logits_to_keep), right_padded)
    if not return_router_logits:
        return hidden
    router_logits = getattr(out, "router_logits", None)
    if router_logits is None:
        raise ValueError(f"{type(body).__name__} returned no router_logits: "
                         f"{type(inner).__name__} is not a Mixture-of-Experts model")
    return hidden, router_logits


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
    sampling_logps: torch.Tensor | None = None,
    **model_kwargs,
):
    """GRPO loss of a causal LM on prompt+completion `input_ids` [B, L]; the completion is the
    last `logits_to_keep` tokens. `loss_fn` holds the hyperparameters (default: TRL's).
    `completion_mask`, `old_logps`, `ref_logps`: [B, T]; `advantages`: [B], [B, 1] or [B, T].
    `sampling_logps` [B, T]: the rollout engine's log-probs, for the off-policy mask
    (`off_policy_mask_threshold`; without them it reads old_logps). Other keywords go to the
    model's body (`completion_hidden_states`).

    Packed rows (see the module docstring; `pack_sequences` builds them): input_ids [R, W],
    attention_mask None, `position_ids=` [R, W], logits_to_keep = positions [N], `cu_seqlens`
    [S + 1] over the N completion tokens; then old/ref/sampling log-probs are [N], advantages
    [S] or [N], and there is no completion mask (every kept token counts).
    Returns (loss: 0-dim float32, metrics: dict of detached 0-dim tensors)."""
    loss_fn = loss_fn if loss_fn is not None else FusedLinearGRPOLoss()
    if not isinstance(loss_fn, FusedLinearGRPOLoss):
        raise TypeError(f"loss_fn must be a grpo_kernels.FusedLinearGRPOLoss, got "
                        f"{type(loss_fn).__name__}")
    _check_head_dtype(head_dtype)
    packed = isinstance(logits_to_keep, torch.Tensor)
    if packed and (cu_seqlens is None or completion_mask is not None):
        raise ValueError("packed rows (logits_to_keep = positions) need cu_seqlens [S + 1] "
                         "and no completion_mask (every kept position is a loss token)")
    if not packed and cu_seqlens is not None:
        raise ValueError("cu_seqlens is for packed rows: pass logits_to_keep as the positions "
                         "[N] (see pack_sequences), not an int")
    hidden = completion_hidden_states(model, input_ids, attention_mask, logits_to_keep,
                                      **model_kwargs)
    # after the forward that checks the model: the transform its logits showed it applies
    loss_fn = _with_model_transform(loss_fn, model)
    hidden, weight, bias = head_for(hidden, model, head_dtype)
    completion_ids = completion_targets(input_ids, logits_to_keep).to(hidden.device)
    if packed:  # [1, N, D] -> [N, D], [1, N] -> [N]: the losses' packed form
        hidden, completion_ids = hidden[0], completion_ids[0]
    with _no_autocast(hidden):  # inputs are already in the head dtype; keep it
        return loss_fn(hidden, weight, completion_ids, advantages, completion_mask, old_logps,
                       ref_logps, bias, num_items_in_batch, importance_sampling_ratio,
                       cu_seqlens=cu_seqlens, sampling_logps=sampling_logps)


def _with_model_transform(loss_fn: FusedLinearGRPOLoss, model: nn.Module):
    """`loss_fn`, or a copy of it taking `model`'s logit transform (`logit_transform`) where it
    was built without one; a loss built with another transform is refused."""
    transform = logit_transform(model)
    mine = {k: loss_fn.options[k] for k in transform}
    if mine == transform:
        return loss_fn
    if any(v is not None for v in mine.values()):
        raise ValueError(f"loss_fn was built with {mine}, but {type(unwrap_model(model)).__name__}"
                         f" transforms its logits with {transform}: build it without softcap "
                         "and logit_scale (the model's are used) or with the model's")
    return FusedLinearGRPOLoss(grad_filter=loss_fn.grad_filter, params=loss_fn.params,
                               vocab_group=loss_fn.options.get("vocab_group"), **transform)


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
    _check_batch(input_ids, attention_mask, logits_to_keep, prompt_end=False)  # per chunk below
    _check_head_dtype(head_dtype)
    B = input_ids.shape[0]
    packed = isinstance(logits_to_keep, torch.Tensor)  # positions span all rows: one chunk
    step = max(B, 1) if batch_size is None or packed else batch_size
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    logps, ents = [], []
    for i in range(0, max(B, 1), step):  # one (empty) chunk for B = 0
        # packed / shared rows are one chunk; a BlockMask must not be sliced at all
        am = attention_mask if packed or attention_mask is None else attention_mask[i:i + step]
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
    _check_head_dtype(head_dtype)
    hidden, weight, bias = head_for(hidden, model, head_dtype)
    with _no_autocast(hidden):
        return selective_logprobs(hidden, weight, completion_ids.to(hidden.device), bias,
                                  temperature=temperature, return_entropy=return_entropy,
                                  **logit_transform(model))


def causal_lm_logprobs(model: nn.Module, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor | None,
                       logits_to_keep: int | torch.Tensor, **kwargs):
    """No-grad log-probs [B, T] float32 of the last `logits_to_keep` tokens (old or reference
    policy scoring), without logits; the keywords of `completion_logprobs`."""
    with torch.no_grad():
        return completion_logprobs(model, input_ids, attention_mask, logits_to_keep, **kwargs)
