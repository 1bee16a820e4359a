"""The `PreTrainedModel` inside the wrappers training puts around it."""

from __future__ import annotations

from torch import nn

__all__ = ["config_size", "prompt_learning_adapter", "text_config", "text_vocab_size",
           "unwrap_model"]


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


def text_config(config):
    """The text part of a model's config: a multimodal (vision-language) config's text
    sub-config, else the config itself (also where it is None or no transformers config)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def text_vocab_size(config) -> int:
    """The vocabulary size of a model's config: a multimodal config's is its text config's (the
    top level has none); 2 where neither says. The layout checks draw their tokens from it."""
    text = text_config(config)
    return getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or 2


def config_size(text, name: str):
    """A size of a (text) config, None where it has none; one that varies by layer
    (transformers' heterogeneous configs, Gemma 4's head_dim: reading it from the whole config
    raises) is the mean over the layers that have it."""
    try:
        return getattr(text, name, None)
    except RuntimeError:
        sizes = [v for layer in getattr(text, "per_layer_config", None) or ()
                 if isinstance(v := getattr(layer, name, None), int)]
        return round(sum(sizes) / len(sizes)) if sizes else None


def prompt_learning_adapter(model: nn.Module) -> str | None:
    """The name of the active PEFT adapter's config type (PromptTuningConfig,
    PrefixTuningConfig, ...) where it is a prompt-learning one, else None. Such an adapter puts
    virtual tokens (or per-layer key/value prefixes) before every row of the batch in the PEFT
    model's forward, so a row must hold one sequence: packed or shared rows would give them to
    the row's first sequence only. Looks through DDP/DeepSpeed `.module` wrappers."""
    while not hasattr(model, "active_peft_config") and isinstance(
            getattr(model, "module", None), nn.Module):
        model = model.module
    config = getattr(model, "active_peft_config", None)  # peft.PeftModel's
    if config is None or not getattr(config, "is_prompt_learning", False):
        return None
    return type(config).__name__
