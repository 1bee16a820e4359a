"""Output heads with PEFT adapters, folded into one fused linear call.

A LoRA adapter on the output embedding changes the logits (PEFT's `lora.Linear.forward`):

    z = h·Wᵀ + b + Σ_a s_a·(drop_a(h)·A_aᵀ)·B_aᵀ  (+ s_a·b_a with lora_bias)

with A_a [r_a, D], B_a [V, r_a], scaling s_a and the adapter's own dropout. Each adapter becomes
r_a extra hidden columns and r_a extra weight columns, so the kernels still see one linear head:

    hidden' = [h, s_1·drop_1(h)·A_1ᵀ, ...]     [..., D + Σ r_a]
    weight' = [W, B_1, ...]                    [V, D + Σ r_a]      hidden'·weight'ᵀ = z

No merged W + s·B·A ([V, D]) is formed and no logits exist; autograd through the two
concatenations trains A (through hidden') and B (through weight'). Dropout: the adapter's own
`lora_dropout` module is applied to h exactly where PEFT applies it (identity in eval mode or at
p = 0; in training mode a fresh mask from the same distribution as the model's own forward).

PEFT `modules_to_save` heads resolve to the copy the wrapper would run (the trained one, or the
original when adapters are disabled). Anything else PEFT can put on a head (DoRA or another LoRA
variant, LoHa/LoKr/IA3/..., trainable token indices, a quantized base layer) raises a
`NotImplementedError` naming the module: never a silently untrained adapter.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from .head_probe import probe_map

_LOG = logging.getLogger(__name__)


@dataclass
class LoraTerm:
    """One active LoRA adapter of the head: z += scaling·up(down(dropout(h)))."""

    adapter: str
    down: nn.Linear  # lora_A: D -> r
    up: nn.Linear  # lora_B: r -> V (weight [V, r], bias [V] with lora_bias)
    dropout: nn.Module
    scaling: float


@dataclass
class ResolvedHead:
    """The linear map an output embedding applies: base weight [V, D], bias [V] | None, and the
    active LoRA terms on top (empty for a plain head). rows: V where the model's logits are only
    the first V of the head's rows (a head padded beyond the vocabulary; weight and bias are
    then those rows, and the LoRA terms' up-projections are cut to them in `fold_lora`)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    lora: list[LoraTerm] = field(default_factory=list)
    rows: int | None = None


def _peft():
    """The peft package if it is already imported (a PEFT-wrapped model implies it is)."""
    return sys.modules.get("peft")


def _base_linear(layer: nn.Module, where: str) -> nn.Module:
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
    weight = getattr(base, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise NotImplementedError(
            f"the output embedding {where} has a base layer {type(base).__name__} without a "
            "floating-point weight (quantized?); the fused head needs a plain [V, D] weight")
    _check_linear_map(base, where)
    return base


def not_a_linear_map(layer: nn.Module) -> str | None:
    """Why an nn.Linear subclass does not compute its linear map x·Wᵀ + b (a phrase), or None.
    Two signs: parameters of its own besides weight and bias (DoryLMHead's learned per-token
    logit scale, which can equal 1 when the model is built and the check runs), or a forward
    of its own whose output on a fixed [2, in_features] input is not that map [2,
    out_features] (Llama 4's and PhiMoE's routers return tuples, DeepSeek V4's grouped
    projection reshapes). Other layer types: None (an output embedding of another type is
    probed by `_not_a_linear_head`)."""
    if not isinstance(layer, nn.Linear):
        return None
    extra = sorted(n for n, _ in layer.named_parameters(recurse=False)
                   if n not in ("weight", "bias"))
    if extra:
        return f"has parameters of its own besides weight and bias ({', '.join(extra)})"
    if type(layer).forward is nn.Linear.forward:
        return None
    what, error = probe_map(layer, layer.weight, layer.bias, (2, layer.in_features))
    if error is not None:  # any failure: not a plain linear layer
        return f"has a forward of its own that fails on [2, in_features] ({error})"
    return None if what is None else (
        f"has a forward of its own whose output ({what}) is not x·Wᵀ + b")


def _check_linear_map(head: nn.Module, where: str) -> None:
    why = not_a_linear_map(head) if isinstance(head, nn.Linear) else _not_a_linear_head(head)
    if why is not None:
        raise NotImplementedError(
            f"the output embedding {where} ({type(head).__name__}) {why}: the fused head "
            "computes x·Wᵀ + b only")


def _not_a_linear_head(head: nn.Module) -> str | None:
    """Why an output embedding that is not an nn.Linear does not compute x·Wᵀ + b with its
    weight [V, D] and bias [V] | None on a fixed [1, 2, D] input (a phrase), or None; None too
    where the probe cannot run (a sharded or empty weight, a forward that fails on it: the
    model's own forward check then runs it). The logits check compares the logits with the
    head's output, never the head's output with its weight: a head that scales its product
    passed it."""
    weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.numel() == 0
            or type(weight).__name__ == "DTensor"
            or not (bias is None or isinstance(bias, torch.Tensor))):
        return None
    what, error = probe_map(head, weight, bias, (1, 2, weight.shape[1]))
    if error is not None:  # the model's forward check decides
        return None
    return None if what is None else (
        f"has a forward whose output ({what}) on a [1, 2, D] input is not x·Wᵀ + b")


def _lora_terms(layer: nn.Module, where: str) -> list[LoraTerm]:
    """The active LoRA adapters of a peft lora.Linear, checked to be reproducible."""
    if layer.disable_adapters or layer.merged:
        return []  # PEFT runs the base layer only (a merged adapter is inside its weight)
    terms = []
    variants = getattr(layer, "lora_variant", {})  # peft >= 0.15: DoRA, aLoRA, ...
    use_dora = getattr(layer, "use_dora", {})  # older peft
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue  # PEFT skips an active adapter this layer does not have
        if name in variants or use_dora.get(name, False):
            kind = type(variants[name]).__name__ if name in variants else "DoRA"
            raise NotImplementedError(
                f"the output embedding {where} carries a LoRA variant ({kind}, adapter "
                f"{name!r}); the fused head reproduces plain LoRA only. Leave the head out of "
                "target_modules or use plain LoRA on it")
        down, up = layer.lora_A[name], layer.lora_B[name]
        if type(down) is not nn.Linear or type(up) is not nn.Linear:
            raise NotImplementedError(
                f"the output embedding {where} has LoRA factors of types "
                f"{type(down).__name__}/{type(up).__name__} (adapter {name!r}); only nn.Linear "
                "factors are supported")
        terms.append(LoraTerm(name, down, up, layer.lora_dropout[name],
                              float(layer.scaling[name])))
    return terms


def has_tuner_adapter(head: nn.Module | None) -> bool:
    """Whether a PEFT tuner layer (LoRA, DoRA, IA3, ...) sits on this module."""
    peft = _peft()
    if peft is None or head is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(head, BaseTunerLayer)


def resolve_head(head: nn.Module, where: str) -> ResolvedHead:
    """What `head` (a model's output embedding) computes, as base weight, bias and LoRA terms.

    `where` names the module in error messages (e.g. "Qwen2ForCausalLM.lm_head").
    Raises NotImplementedError for adapters the fused head cannot reproduce, and for a head
    (or LoRA base layer) that does not compute x·Wᵀ + b. That check is free for a plain
    nn.Linear; any other head is probed with a small forward and a host read, whose verdict
    is kept between calls until something it depends on changes (`head_probe`: with a
    trained head, once per optimizer step).
    """
    peft = _peft()
    if peft is not None:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper

        if isinstance(head, ModulesToSaveWrapper):
            active = getattr(head, "active_adapters", None)
            if active is None:  # older peft: one active adapter name
                active = [head.active_adapter]
            if head.disable_adapters or not active or any(a not in head.modules_to_save
                                                          for a in active):
                return resolve_head(head.original_module, f"{where}.original_module")
            return resolve_head(head.modules_to_save[active[0]],
                                f"{where}.modules_to_save.{active[0]}")
        wrapper_base = getattr(getattr(peft.utils, "other", None), "AuxiliaryTrainingWrapper",
                               ())
        if wrapper_base and isinstance(head, wrapper_base):
            raise NotImplementedError(
                f"the output embedding {where} is wrapped by PEFT's {type(head).__name__} "
                "(e.g. trainable_token_indices); the fused head does not reproduce it")
        if isinstance(head, BaseTunerLayer):
            from peft.tuners.lora.layer import Linear as LoraLinear

            if type(head) is not LoraLinear:
                raise NotImplementedError(
                    f"the output embedding {where} carries a PEFT {type(head).__module__}."
                    f"{type(head).__name__} adapter; the fused head reproduces plain LoRA on a "
                    "linear layer only")
            base = _base_linear(head, where)
            return ResolvedHead(base.weight, getattr(base, "bias", None),
                                _lora_terms(head, where))
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"the output embedding {where} ({type(head).__name__}) has no weight")
    _check_linear_map(head, where)
    return ResolvedHead(weight, getattr(head, "bias", None))


def fold_lora(resolved: ResolvedHead, body_out: torch.Tensor, hidden: torch.Tensor,
              head_dtype: torch.dtype):
    """(hidden', weight', bias') for one fused linear call that reproduces the head.

    body_out: the head's input as the model gives it ([..., D], what the LoRA branch sees);
    hidden: the same states as the kernel takes them (possibly cast); head_dtype: the dtype of
    weight' and bias'. Without LoRA terms this is (hidden, weight, bias) in head_dtype, no copy
    beyond the cast. With them: hidden' [..., D + R] in hidden's dtype, weight' [V, D + R].
    """
    cast = lambda x: x if x is None or x.dtype == head_dtype else x.to(head_dtype)  # noqa: E731
    weight, bias = cast(resolved.weight), cast(resolved.bias)
    if not resolved.lora:
        return hidden, weight, bias
    columns, ups = [hidden], [weight]
    rows = resolved.rows  # None: all of them
    for term in resolved.lora:
        x = body_out.to(term.down.weight.dtype)  # PEFT casts the input to lora_A's dtype
        columns.append((term.down(term.dropout(x)) * term.scaling).to(hidden.dtype))
        ups.append(cast(term.up.weight[:rows]))
        if term.up.bias is not None:  # lora_bias: s·b_B adds to the logits
            extra = cast(term.up.bias[:rows]) * term.scaling
            bias = extra if bias is None else bias + extra
    return torch.cat(columns, dim=-1), torch.cat(ups, dim=1), bias


def _conv1d() -> tuple[type, ...]:
    """transformers' Conv1D (a linear layer with a transposed weight), if transformers is there."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return ()
    return (Conv1D,)


def _lora_targets(model: nn.Module, out: nn.Module | None, target_modules, head: bool):
    """PEFT's target_modules for add_lora: a list of names, or a str regex that PEFT fullmatches
    against each module's qualified name; with head=True the output embedding joins either."""
    targets = target_modules
    if isinstance(targets, str) and targets != "all-linear" and re.fullmatch(r"[\w.]+", targets):
        targets = [targets]  # one module name, as a list names it (as a regex it matches nothing)
    if targets == "all-linear":  # PEFT's shorthand leaves the head out: name every linear
        # layer, as PEFT counts them (GPT-2's are transformers' Conv1D, a transposed linear),
        # except those whose output is not their linear map: LoRA adds its update to that
        # output, which fails on Llama 4's router (a tuple) in the model's own forward
        linear = (nn.Linear, *_conv1d())
        layers = [(n, m) for n, m in model.named_modules() if isinstance(m, linear)
                  and m is not out]
        odd = {n: why for n, m in layers if (why := not_a_linear_map(m)) is not None}
        if odd:  # one phrase per kind of layer, e.g. "48 Llama4Router layers (...)"
            kinds: dict[tuple[str, str], int] = {}
            for n, m in layers:
                if n in odd:
                    key = (type(m).__name__, odd[n])
                    kinds[key] = kinds.get(key, 0) + 1
            _LOG.warning("add_lora: all-linear leaves out %s", "; ".join(
                f"{count} {kind} layers ({why})" for (kind, why), count in sorted(kinds.items())))
        targets = _matching_names(model, [n for n, _ in layers if n not in odd])
    if not head:
        return targets
    head_name = next((n for n, m in model.named_modules() if m is out), "output embedding")
    if isinstance(targets, str):  # a regex: the head as one more alternative
        return f"(?:{targets})|{re.escape(head_name)}"
    return [*targets, head_name]


def _matching_names(model: nn.Module, chosen: list[str]) -> list[str]:
    """Names for PEFT's target_modules list (a name matches every module whose qualified name
    is it or ends with "." + it) that match exactly the modules `chosen` (qualified names):
    for each, its shortest dotted suffix that no other module's name ends with. A leaf name
    alone can match more: a linear layer in a ModuleList is "0", as is a decoder layer (Gemma
    3n's altup_projections.0 and layers.0), and a router left out can share its leaf name."""
    keep = set(chosen)
    pure: dict[str, bool] = {}  # suffix -> whether every module it matches is chosen
    for name, _ in model.named_modules():
        parts = name.split(".")
        for k in range(len(parts)):
            suffix = ".".join(parts[k:])
            pure[suffix] = pure.get(suffix, True) and name in keep
    names = set()
    for name in chosen:
        parts = name.split(".")
        names.add(next(s for k in range(len(parts), 0, -1)
                       if pure[s := ".".join(parts[k - 1:])]))
    return sorted(names)


def add_lora(model: nn.Module, *, r: int = 16, alpha: float = 32.0, dropout: float = 0.0,
             target_modules: str | list[str] = "all-linear", head: bool = True,
             modules_to_save: list[str] | None = None, **lora_kwargs) -> nn.Module:
    """Wrap a Hugging Face causal LM with a PEFT LoRA adapter the fused loss can train.

    target_modules: PEFT's: a list of module names, a str regex over the modules' qualified
    names, one module name, or "all-linear" (every linear layer except the output embedding);
    head=True adds the output embedding (whatever it is called) to them. Extra keywords go to
    `peft.LoraConfig`. Returns the `PeftModel`; raises ImportError without peft, ValueError
    when target_modules (non-empty) matches no module besides the head, and
    NotImplementedError (naming the module) when the resulting head is not one the fused path
    reproduces, e.g. use_dora=True with head=True.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError("LoRA needs PEFT: pip install grpo-kernels[lora]") from exc
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"r must be a positive int, got {r!r}")
    if (isinstance(dropout, bool) or not isinstance(dropout, (int, float))
            or not 0.0 <= dropout < 1.0):
        raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
    get = getattr(model, "get_output_embeddings", None)
    out = get() if get is not None else None
    if head and out is None:
        raise ValueError(f"{type(model).__name__} has no output embedding to put LoRA on")
    targets = _lora_targets(model, out, target_modules, head)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        modules_to_save=modules_to_save, task_type="CAUSAL_LM", **lora_kwargs)
    with warnings.catch_warnings():
        # PEFT's constructor reads model.is_gradient_checkpointing, which transformers 5
        # deprecates: a notice about PEFT's code that the caller of add_lora cannot act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated",
                                category=FutureWarning)
        wrapped = get_peft_model(model, config)
    inner = wrapped.get_base_model()
    if head and target_modules and not any(has_tuner_adapter(m) for m in inner.modules()
                                           if m is not inner.get_output_embeddings()):
        # PEFT raises when nothing matches; the head always does, so say it here
        raise ValueError(f"target_modules={target_modules!r} matched no module besides the "
                         f"output embedding (a str is a regex over qualified module names, "
                         f"e.g. r'.*\\.(q_proj|v_proj)'; a list names modules)")
    if out is not None:
        out = inner.get_output_embeddings()
        head_name = next((n for n, m in inner.named_modules() if m is out), "output embedding")
        resolve_head(out, f"{type(inner).__name__}.{head_name}")
    return wrapped
