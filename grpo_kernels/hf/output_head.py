"""The output head of a Hugging Face causal LM as the fused kernels see it: the wrapped model's
inner `PreTrainedModel` (`unwrap_model`), its output embedding's weight, bias and PEFT LoRA terms
(`resolved_head`, `head_for`), the logit transform its forward applies to the head's output
(`logit_transform`: final-logit soft-capping, a logit scale), and the once-per-model check that
the body's output, projected and transformed so, gives the model's own logits
(`check_output_head`)."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..reference import transform_logits
from .head_adapters import ResolvedHead, fold_lora, resolve_head
from .unwrap import unwrap_model
from .zero3 import gathered_head

__all__ = ["check_output_head", "head_for", "logit_transform", "output_head", "resolved_head",
           "unwrap_model"]


def resolved_head(model: nn.Module) -> ResolvedHead:
    """What the model's output embedding computes: base weight [V, D], bias [V] | None and any
    active PEFT LoRA terms (`head_adapters`). Raises for heads the fused path cannot reproduce:
    none at all, a sharded (empty) weight, or an adapter other than plain LoRA (the error names
    the module). What the model does to the head's output is `logit_transform`'s."""
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
    return resolved


def logit_transform(model: nn.Module) -> dict:
    """{"softcap": c | None, "logit_scale": s | None}: what `model`'s forward does to its output
    embedding's output y before returning logits, z = c·tanh(s·y / c), in the keywords of the
    fused functions. From the (text) config: final_logit_softcapping (Gemma 2 and 3),
    logits_soft_cap (RecurrentGemma) or output_logit_soft_cap (xLSTM); a scale logit_scale
    (Cohere), output_multiplier, lm_head_multiplier (Falcon-H1), or a divisor logits_scaling
    (Granite divides the logits by it, MiniCPM3 the head's input; HyperCLOVA X multiplies) or
    logits_mup_width_multiplier (Inkling divides the head's input). A scale on the head's input
    is one on its output for a head without bias (`_check_head_input` refuses one with a bias).
    `check_output_head` checks the result against the model's own logits once per model."""
    config = getattr(unwrap_model(model), "config", None)
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = _first_set(cfg, ("final_logit_softcapping", "logits_soft_cap",
                                "output_logit_soft_cap"))
    scale = _first_set(cfg, ("logit_scale", "output_multiplier", "lm_head_multiplier"))
    divisor = _first_set(cfg, ("logits_scaling", "logits_mup_width_multiplier"))
    if scale is None and divisor is not None:
        scale = divisor if getattr(cfg, "model_type", None) == "hyperclovax" else 1.0 / divisor
    return {"softcap": float(softcap) if softcap else None,
            "logit_scale": None if scale is None or scale == 1 else float(scale)}


def _first_set(cfg, names: tuple[str, ...]):
    """The first of the config attributes `names` that is set (not None), else None."""
    return next((v for v in (getattr(cfg, n, None) for n in names) if v is not None), None)


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
    """model.base_model; where that is the model itself (its base_model_prefix names no
    attribute: Llama4ForCausalLM's says "language_model" and it holds `model`), its one
    PreTrainedModel child. `_check_head_input` then checks that the head reads its output."""
    from transformers import PreTrainedModel

    body = getattr(inner, "base_model", None)
    if body is None or body is inner:
        children = [c for c in inner.children() if isinstance(c, PreTrainedModel)]
        body = children[0] if len(children) == 1 else None
    if body is None:
        raise ValueError(f"cannot find the transformer body of {type(inner).__name__}: "
                         "model.base_model is the model itself, and it has not exactly one "
                         "PreTrainedModel child")
    return body


def _bodies(inner: nn.Module) -> list[nn.Module]:
    """The modules whose output may feed the head, in order of preference: base_model, then its
    sub-models (OPTForCausalLM runs base_model.decoder itself, never base_model)."""
    from transformers import PreTrainedModel

    body = _body(inner)
    return [body, *(c for c in body.children() if isinstance(c, PreTrainedModel))]


def _last_hidden(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.last_hidden_state


# Models whose output embedding was seen to take the body's output unchanged (checked once
# each), with that body: the module the hidden-state path runs.
_HEAD_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_head_input(inner: nn.Module, input_ids, attention_mask) -> nn.Module:
    """Once per model: run its own forward on one sequence and check that the output embedding
    is applied to the body's output as is, and that the model's logits are `logit_transform`'s
    z of the head's output. BERT-style heads (a dense+norm transform first, e.g.
    RobertaForCausalLM), a rescaled hidden state or an unknown logit transform would otherwise
    give silently wrong losses. Returns the body (`_bodies`: the first one the forward ran)."""
    if inner in _HEAD_CHECKED:
        return _HEAD_CHECKED[inner]
    bodies = _bodies(inner)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        return bodies[0]  # output_head() raises the error
    seen = {}
    hooks = [b.register_forward_hook(lambda _m, _a, out, i=i: seen.setdefault(i, out))
             for i, b in enumerate(bodies)]
    hooks += [head.register_forward_pre_hook(lambda _m, args: seen.setdefault("head", args[0])),
              head.register_forward_hook(lambda _m, _a, out: seen.setdefault("head_out", out))]
    devices = [input_ids.device] if input_ids.is_cuda else []
    try:  # no grad, and no RNG draws visible outside (dropout)
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            am = None if attention_mask is None else attention_mask[:1]
            out = inner(input_ids=input_ids[:1], attention_mask=am, logits_to_keep=1,
                        use_cache=False)
            # a tuple (config.return_dict=False) holds the logits first (no labels, no loss)
            seen["logits"] = out[0] if isinstance(out, tuple) else getattr(out, "logits", None)
    except Exception:
        # the head itself may fail on its own (e.g. a float32 head on a bf16 body, which we cast
        # and the model does not); its input was captured before it ran, which is all we need
        if "head" not in seen:
            raise
    finally:
        for h in hooks:
            h.remove()
    ran = next((i for i in range(len(bodies)) if i in seen), 0)
    body = bodies[ran]
    body_out = _last_hidden(seen[ran])[:, -1:] if ran in seen else None
    head_in = seen.get("head")
    if isinstance(head_in, torch.Tensor) and head_in.dim() == 3:
        # the last position: a forward without logits_to_keep (xLSTM) runs the head on all
        head_in = head_in[:, -1:]
    input_scale = _head_input_scale(inner, head_in, body_out)
    if input_scale is None:
        raise NotImplementedError(
            f"{type(inner).__name__} does not apply its output embedding "
            f"({type(head).__name__}) directly to the output of its body "
            f"({type(body).__name__}); a head with its own transform is not supported")
    _check_logit_transform(inner, seen.get("head_out"), seen.get("logits"), input_scale)
    _HEAD_CHECKED[inner] = body
    return body


def _head_input_scale(inner: nn.Module, head_in, body_out) -> float | None:
    """1.0 where the head takes the body's output [1, 1, D] as is; s, the config's logit scale
    (`logit_transform`), where it takes s·(body output) (MiniCPM3 divides the hidden states by
    logits_scaling before its head), to a few roundings of the head input's dtype; else None.
    A scaled input gives the logits of a scaled output only for a head without bias."""
    if body_out is None or head_in is None or head_in.shape != body_out.shape:
        return None
    body_out = body_out.to(head_in.device)
    if torch.equal(head_in, body_out):
        return 1.0
    scale = logit_transform(inner)["logit_scale"]
    if scale is None or not head_in.is_floating_point():
        return None
    eps = torch.finfo(head_in.dtype).eps
    if not torch.allclose(head_in.float(), body_out.float() * scale, rtol=4 * eps, atol=1e-30):
        return None
    resolved = resolved_head(inner)
    if resolved.bias is not None or any(t.up.bias is not None for t in resolved.lora):
        raise NotImplementedError(
            f"{type(inner).__name__} scales the hidden states by {scale:.4g} before an output "
            "embedding with a bias: its logits are not a scale of the head's output, which the "
            "fused path applies")
    return scale


def _check_logit_transform(inner: nn.Module, head_out, logits, input_scale: float = 1.0
                           ) -> None:
    """The model's logits [1, 1, V] against `logit_transform`'s z of its head's output, to a
    few roundings of the logits' dtype (skipped where either was not seen). input_scale: the
    scale the head's input already carried (`_head_input_scale`), taken out of its output
    first (the head is linear there) so that the transform applies it once."""
    if not isinstance(head_out, torch.Tensor) or not isinstance(logits, torch.Tensor):
        return
    transform = logit_transform(inner)
    want = transform_logits(head_out[:, -1:].float() / input_scale, **transform)  # float32
    got = logits[:, -1:].float().to(want.device)
    eps = torch.finfo(logits.dtype).eps if logits.is_floating_point() else 1e-6
    tol = 8 * eps * max(1.0, want.abs().max().item())
    if got.shape != want.shape or not bool(((got - want).abs() <= tol).all()):
        err = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
        raise NotImplementedError(
            f"{type(inner).__name__}'s logits are not those of its output embedding under the "
            f"logit transform read from its config ({transform}): they differ by {err:.3g}; "
            "a model that transforms its logits otherwise is not supported")


def check_output_head(model: nn.Module, input_ids: torch.Tensor | None = None) -> None:
    """Raise (ValueError / NotImplementedError) unless the hidden-state path reproduces `model`'s
    own logits: an output embedding exists, the head takes the body's output as is, and the
    model's logits are the head's output under `logit_transform` (checked with one short forward of
    `input_ids` [B, L], default tokens 1 and 2). Cached per model; `completion_hidden_states`
    runs the same check."""
    inner = unwrap_model(model)
    resolved_head(inner)
    _check_head_input(inner, _probe_ids(inner) if input_ids is None else input_ids, None)


def _probe_ids(inner: nn.Module) -> torch.Tensor:
    """[1, 2] the check's default text: two ordinary tokens, 1 and 2. Not id 0, which is often
    the padding token: its embedding is zero, and so is a Llama-style body's output on it, the
    head's output and the logits, which the check would then find equal whatever the head."""
    device = next(inner.parameters()).device
    config = getattr(inner, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or 4
    return (torch.arange(1, 3, device=device) % max(vocab, 1)).unsqueeze(0)


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
    if resolved.lora and type(weight).__name__ == "DTensor":  # tensor parallelism's head
        raise NotImplementedError(
            f"the output embedding of {type(unwrap_model(model)).__name__} is sharded along the "
            "vocabulary (a DTensor: tensor parallelism) and carries a LoRA adapter; the fused "
            "head folds LoRA into whole heads only")
    return fold_lora(resolved, hidden, kernel_hidden, head_dtype)
