"""The `PreTrainedModel` inside the wrappers training puts around it."""

from __future__ import annotations

from torch import nn

__all__ = ["unwrap_model"]


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
