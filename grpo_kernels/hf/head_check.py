"""What a Hugging Face causal LM's forward does to its output head's output, and the
once-per-model check that the hidden-state path reproduces the model's logits: the logit
transform (`logit_transform`: final-logit soft-capping, a logit scale), and `check_output_head`,
one short forward of the model's own with hooks on its body and its output embedding, which
checks that the head takes the body's output as is and that the model's logits are the head's
output (`output_head.resolved_head`) under that transform.

The transform is read from the (text) config. Some vision-language wrappers project their text
model's states with their own head and leave the text config's transform unapplied (Aya Vision
and Cohere 2 Vision: Cohere 2's logit_scale; Gemma 3 and LLaVA: a soft cap): the check then takes
the part of it that the model's logits show it applies, and `logit_transform` gives that from
then on (one INFO line on the "grpo_kernels.hf" logger names what is left out). A model whose
own (not a sub-) config names a transform its logits do not show is refused. A head padded
beyond the vocabulary is compared on its logit rows (`output_head.logit_rows`)."""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from ..reference import transform_logits
from .output_head import logit_rows, resolved_head
from .unwrap import text_config, unwrap_model

__all__ = ["check_output_head", "logit_transform"]

_LOG = logging.getLogger("grpo_kernels.hf")


def logit_transform(model: nn.Module) -> dict:
    """{"softcap": c | None, "logit_scale": s | None}: what `model`'s forward does to its output
    embedding's output y before returning logits, z = c·tanh(s·y / c), in the keywords of the
    fused functions. From the (text) config: final_logit_softcapping (Gemma 2 and 3),
    logits_soft_cap (RecurrentGemma) or output_logit_soft_cap (xLSTM); a scale logit_scale
    (Cohere), output_multiplier, lm_head_multiplier (Falcon-H1), or a divisor logits_scaling
    (Granite divides the logits by it, MiniCPM3 the head's input; HyperCLOVA X multiplies) or
    logits_mup_width_multiplier (Inkling divides the head's input). A scale on the head's input
    is one on its output for a head without bias (`check_head_input` refuses one with a bias).
    `check_output_head` checks the result against the model's own logits once per model; where
    those showed that the model leaves part of it unapplied (see the module docstring), the part
    it applies."""
    inner = unwrap_model(model)
    if inner in _APPLIED:
        return dict(_APPLIED[inner])
    return _config_transform(inner)


# Models whose forward was seen to leave part of their config's transform unapplied: the part
# their logits showed they apply (`_check_logit_transform`)
_APPLIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _config_transform(inner: nn.Module) -> dict:
    """The logit transform `inner`'s (text) config names (`logit_transform`)."""
    cfg = text_config(getattr(inner, "config", None))
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


def _body(inner: nn.Module) -> nn.Module:
    """model.base_model; where that is the model itself (its base_model_prefix names no
    attribute: Llama4ForCausalLM's says "language_model" and it holds `model`), its
    PreTrainedModel child that holds the output embedding (or its one PreTrainedModel child):
    a causal LM inside a wrapper (Kosmos 2.5's text_model beside its vision_model) gives its
    own body. `check_head_input` then checks that the head reads its output."""
    from transformers import PreTrainedModel

    body = getattr(inner, "base_model", None)
    if body is None or body is inner:
        children = [c for c in inner.children() if isinstance(c, PreTrainedModel)]
        get = getattr(inner, "get_output_embeddings", None)
        head = get() if get is not None else None
        owners = [c for c in children if any(m is head for m in c.modules())]
        # an owner is a causal LM of its own: the head reads that one's body's output
        body = _body(owners[0]) if len(owners) == 1 else (
            children[0] if len(children) == 1 else None)
    if body is None:
        raise ValueError(f"cannot find the transformer body of {type(inner).__name__}: "
                         "model.base_model is the model itself, and neither one of its "
                         "PreTrainedModel children holds the output embedding nor is it the "
                         "only one")
    return body


def _bodies(inner: nn.Module) -> list[nn.Module]:
    """The modules whose output may feed the head, in order of preference: base_model, then its
    sub-models (OPTForCausalLM runs base_model.decoder itself, never base_model)."""
    from transformers import PreTrainedModel

    body = _body(inner)
    return [body, *(c for c in body.children() if isinstance(c, PreTrainedModel))]


def last_hidden(out) -> torch.Tensor:
    """[B, L, D] last hidden states of a body's output: a tuple's first element, else its
    last_hidden_state."""
    return out[0] if isinstance(out, tuple) else out.last_hidden_state


# model -> (the body its head reads, which the path runs; head; config transform), as checked
_HEAD_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_head_input(inner: nn.Module, input_ids, attention_mask) -> nn.Module:
    """Once per model: run its own forward on one sequence (the first row of input_ids [B, L]
    and of attention_mask [B, L] or None) and check that the output embedding is applied to the
    body's output as is, and that the model's logits are `logit_transform`'s z of the head's
    output. BERT-style heads (a dense+norm transform first, e.g.
    RobertaForCausalLM), a rescaled hidden state or an unknown logit transform would otherwise
    give silently wrong losses. Returns the body (`_bodies`: the first one the forward ran)."""
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        resolved_head(inner)  # raises: no output embedding
    bodies = _bodies(inner)
    seen_as, cached = (head, _config_transform(inner)), _HEAD_CHECKED.get(inner)
    if cached and cached[1:] == seen_as and any(cached[0] is b for b in bodies):
        return cached[0]  # else unchecked, or its body, head or transform was replaced since
    # copies of the last position, taken when each module ran: a forward may change the
    # tensors in place afterwards (Chameleon masks its image tokens' logits in the head's output)
    seen = {}

    def keep(key, x) -> None:  # a hook's None leaves the module's input and output alone
        if key not in seen:
            seen[key] = _last_position(x)

    hooks = [b.register_forward_hook(lambda _m, _a, out, i=i: keep(i, last_hidden(out)))
             for i, b in enumerate(bodies)]
    hooks += [head.register_forward_pre_hook(lambda _m, args: keep("head", args[0])),
              head.register_forward_hook(lambda _m, _a, out: keep("head_out", out))]
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
    body_out = seen.get(ran)
    head_in = seen.get("head")
    input_scale = _head_input_scale(inner, head_in, body_out)
    if input_scale is None:
        raise NotImplementedError(
            f"{type(inner).__name__} does not apply its output embedding "
            f"({type(head).__name__}) directly to the output of its body "
            f"({type(body).__name__}); a head with its own transform is not supported")
    _check_logit_transform(inner, seen.get("head_out"), seen.get("logits"), input_scale)
    _HEAD_CHECKED[inner] = (body, *seen_as)
    return body


def _last_position(x):
    """A copy of x[:, -1:] for a [B, L, ...] tensor (a forward without logits_to_keep, xLSTM's,
    runs the head on every position), else x as it is."""
    if isinstance(x, torch.Tensor) and x.dim() == 3:
        return x[:, -1:].clone()
    return x


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
    scale = _config_transform(inner)["logit_scale"]
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
    """The model's logits [1, 1, V] against the z of its head's output under the transform its
    config names, to a few roundings of the logits' dtype (skipped where either was not seen);
    failing that, under a part of it (`_transform_parts`), which is then recorded for
    `logit_transform`. input_scale: the scale the head's input already carried
    (`_head_input_scale`), taken out of its output first (the head is linear there) so that the
    transform applies it once. A padded head's output is cut to its logit rows first."""
    if not isinstance(head_out, torch.Tensor) or not isinstance(logits, torch.Tensor):
        return
    rows = logit_rows(inner, head_out.shape[-1])
    y = head_out[:, -1:, :rows].float() / input_scale  # [1, 1, V] float32
    got = logits[:, -1:].float().to(y.device)
    eps = torch.finfo(logits.dtype).eps if logits.is_floating_point() else 1e-6
    named = _config_transform(inner)
    # a wrapper may leave its text config's transform unapplied; a model whose own config names
    # one it does not apply is refused (a transform it applies some other way would pass here)
    config = getattr(inner, "config", None)
    wrapped = text_config(config) is not config
    errors = []
    for transform in _transform_parts(named, input_scale) if wrapped else [named]:
        want = transform_logits(y, **transform)
        tol = 8 * eps * max(1.0, want.abs().max().item())
        if got.shape == want.shape and bool(((got - want).abs() <= tol).all()):
            _record_applied(inner, named, transform)
            return
        errors.append((got - want).abs().max().item() if got.shape == want.shape
                      else float("nan"))
    shape = "" if got.shape == y.shape else (
        f" (its logits have shape {tuple(got.shape)}, its output embedding's output "
        f"{tuple(y.shape)})")
    part = " or a part of it" if wrapped else ""
    raise NotImplementedError(
        f"{type(inner).__name__}'s logits are not those of its output embedding under the "
        f"logit transform read from its config ({named}){part}: they differ by "
        f"{errors[0]:.3g}{shape}{_masked(logits)}; a model that transforms its logits otherwise "
        "is not supported")


def _masked(logits: torch.Tensor) -> str:
    """For the check's error: how many of the last position's logits [1, 1, V] are the dtype's
    minimum (vocabulary entries the forward masks out), if any."""
    if not logits.is_floating_point():
        return ""
    last = logits[:, -1:]
    n = int((last == torch.finfo(logits.dtype).min).sum())
    return f" ({n} of its {last.shape[-1]} logits are masked: the dtype's minimum)" if n else ""


def _transform_parts(named: dict, input_scale: float) -> list[dict]:
    """The transforms a model's logits may show: `named` first, then it without its soft cap,
    without its scale, without either (a scale the head's input carried stays)."""
    parts = [named]
    for cut in (("softcap",), ("logit_scale",), ("softcap", "logit_scale")):
        if input_scale != 1.0 and "logit_scale" in cut:
            continue
        part = {**named, **dict.fromkeys(cut)}
        if part not in parts:
            parts.append(part)
    return parts


def _record_applied(inner: nn.Module, named: dict, applied: dict) -> None:
    """Remember (and log once) the part of its config's transform that `inner` applies."""
    if applied == named:
        _APPLIED.pop(inner, None)
        return
    _APPLIED[inner] = applied
    left = {k: v for k, v in named.items() if applied[k] != v}
    _LOG.info("grpo_kernels: %s does not apply %s from its config to its logits (they are its "
              "output embedding's output under %s); the fused loss leaves it out too",
              type(inner).__name__, left, applied)


def check_output_head(model: nn.Module, input_ids: torch.Tensor | None = None) -> None:
    """Raise (ValueError / NotImplementedError) unless the hidden-state path reproduces `model`'s
    own logits: an output embedding exists, the head takes the body's output as is, and the
    model's logits are the head's output under `logit_transform` (checked with one short forward of
    `input_ids` [B, L], default tokens 1 and 2). Cached per model until its body, head or config
    transform is replaced; `completion_hidden_states` runs the same check."""
    inner = unwrap_model(model)
    resolved_head(inner)
    check_head_input(inner, probe_ids(inner) if input_ids is None else input_ids, None)


def probe_ids(inner: nn.Module) -> torch.Tensor:
    """[1, 2] the check's default text: two ordinary tokens, 1 and 2. Not id 0, which is often
    the padding token: its embedding is zero, and so is a Llama-style body's output on it, the
    head's output and the logits, which the check would then find equal whatever the head."""
    device = next(inner.parameters()).device
    vocab = getattr(text_config(getattr(inner, "config", None)), "vocab_size", None) or 4
    return (torch.arange(1, 3, device=device) % max(vocab, 1)).unsqueeze(0)
