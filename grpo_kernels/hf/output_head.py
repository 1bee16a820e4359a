"""The output head of a Hugging Face causal LM as the fused kernels see it: the wrapped model's
inner `PreTrainedModel` (`unwrap_model`), its output embedding's weight, bias and PEFT LoRA terms
(`resolved_head`, `output_head`, `head_for`). A head padded beyond the vocabulary (Inkling's
unpadded_vocab_size: the logits are its first rows' outputs) is taken as those rows
(`logit_rows`). What the model's forward does to the head's output (`logit_transform`) and the
once-per-model check that the hidden-state path gives the model's own logits
(`check_output_head`) are in `head_check.py`."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .head_adapters import ResolvedHead, fold_lora, resolve_head
from .unwrap import text_config, unwrap_model
from .zero3 import gathered_head

__all__ = ["head_for", "output_head", "resolved_head", "unwrap_model"]


def resolved_head(model: nn.Module) -> ResolvedHead:
    """What the model's output embedding computes: base weight [V, D], bias [V] | None and any
    active PEFT LoRA terms (`head_adapters`). Raises for heads the fused path cannot reproduce:
    none at all, a sharded (empty) weight, or an adapter other than plain LoRA (the error names
    the module). What the model does to the head's output is `head_check.logit_transform`'s."""
    inner = unwrap_model(model)
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no output embedding (get_output_embeddings() "
                         "returned None): the fused path projects with the output embedding the "
                         "model names, and this model names none")
    where = f"{type(inner).__name__}.{_module_name(inner, head)}"
    # DeepSpeed ZeRO-3: full differentiable copies of the sharded weight and bias (zero3.py)
    resolved = gathered_head(resolve_head(head, where), where)
    weight = resolved.weight
    if weight.dim() != 2 or weight.numel() == 0:
        # some FSDP set-ups leave an empty local shard outside the forward (ZeRO-3's is gathered)
        raise ValueError(f"the output embedding of {type(inner).__name__} has weight shape "
                         f"{tuple(weight.shape)}, not a full [V, D] matrix (sharded "
                         "parameters are not supported)")
    rows = logit_rows(inner, weight.shape[0])
    if rows is None:
        return resolved
    if type(weight).__name__ == "DTensor":
        raise NotImplementedError(
            f"the output embedding of {type(inner).__name__} is sharded along the vocabulary (a "
            f"DTensor) and padded beyond it: its logits are its first {rows} rows' outputs "
            "(unpadded_vocab_size), which the fused head takes from whole heads only")
    bias = None if resolved.bias is None else resolved.bias[:rows]
    return ResolvedHead(weight[:rows], bias, resolved.lora, rows=rows)


def logit_rows(inner: nn.Module, head_rows: int) -> int | None:
    """U where the model returns the outputs of its head's first U < head_rows rows only (the
    (text) config's unpadded_vocab_size: Inkling pads its head beyond the vocabulary), else
    None."""
    rows = getattr(text_config(getattr(inner, "config", None)), "unpadded_vocab_size", None)
    return rows if isinstance(rows, int) and 0 < rows < head_rows else None


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
