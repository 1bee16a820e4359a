"""nn.Module wrappers: they hold the hyperparameters (a GRPOParams) and call the functional API.

    loss_fn = FusedLinearGRPOLoss(beta=0.04, loss_type="dapo")
    loss, metrics = loss_fn(hidden, lm_head.weight, completion_ids, advantages, mask, old, ref)
"""

from __future__ import annotations

import torch
from torch import nn

from .functional import fused_linear_grpo_loss, grpo_loss
from .parallel import check_vocab_group
from .params import FIELD_NAMES, GRPOParams, signature_with_params
from .validation import check_flags, check_grad_filter, check_logit_transform


class _GRPOModule(nn.Module):
    """Holds `params` (from params= or the hyperparameter keywords) and kernel options.

    Each setting reads as an attribute (`loss_fn.beta`, `loss_fn.softcap`); assigning one is
    refused, since forward reads `params` and `options` only (an attribute set beside them would
    change nothing). A new GRPOParams goes in whole: `loss_fn.params = replace(loss_fn.params,
    beta=0.0)`, checked by GRPOParams itself."""

    def __init__(self, params: GRPOParams | None, hyperparameters: dict, **options):
        super().__init__()
        self.params = GRPOParams.resolve(params, hyperparameters)
        self.options = options  # kernel options, not GRPO hyperparameters

    def __getattr__(self, name: str):
        state = self.__dict__  # unpickling calls this before params and options exist
        if name in FIELD_NAMES and "params" in state:
            return getattr(state["params"], name)
        if name in state.get("options", ()):
            return state["options"][name]
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        if name in FIELD_NAMES or name in self.__dict__.get("options", ()):
            kind = "hyperparameters" if name in FIELD_NAMES else "kernel options"
            raise AttributeError(
                f"cannot set {type(self).__name__}.{name}: the {kind} are fixed at construction "
                f"and forward reads them from .params / .options; build a new "
                f"{type(self).__name__}(..., {name}=...) or, for a hyperparameter, set "
                f"params = dataclasses.replace(loss_fn.params, {name}=...)")
        if name == "params" and not isinstance(value, GRPOParams):
            raise TypeError(f"params must be a GRPOParams, got {type(value).__name__}")
        super().__setattr__(name, value)

    def extra_repr(self) -> str:
        # options at their defaults (None, False) are left out; grad_filter=0.0 is shown
        shown = {k: v for k, v in self.options.items() if v is not None and v is not False}
        items = {**vars(self.params), **shown}
        return ", ".join(f"{k}={v!r}" for k, v in items.items())


class FusedLinearGRPOLoss(_GRPOModule):
    """GRPO loss from hidden states and the lm_head weight; see `fused_linear_grpo_loss`.
    Keywords: the GRPOParams fields (or params=), grad_filter, the model's logit transform
    softcap / logit_scale, and vocab_group (a process group: the weight passed to forward is
    this rank's vocabulary shard; a DTensor weight needs none)."""

    @signature_with_params
    def __init__(self, *, grad_filter: float | str | None = None, softcap: float | None = None,
                 logit_scale: float | None = None, vocab_group=None,
                 params: GRPOParams | None = None, **hyperparameters):
        check_grad_filter(grad_filter, torch.bfloat16)  # fail here, not at the first step
        check_vocab_group(vocab_group)
        softcap, logit_scale = check_logit_transform(softcap, logit_scale)
        super().__init__(params, hyperparameters, grad_filter=grad_filter, softcap=softcap,
                         logit_scale=logit_scale, vocab_group=vocab_group)

    @property
    def grad_filter(self) -> float | str | None:
        return self.options["grad_filter"]

    def forward(self, hidden, weight, completion_ids, advantages, completion_mask=None,
                old_logps=None, ref_logps=None, bias=None, num_items_in_batch=None,
                importance_sampling_ratio=None, cu_seqlens=None, sampling_logps=None):
        return fused_linear_grpo_loss(
            hidden, weight, completion_ids, advantages, completion_mask, old_logps, ref_logps,
            bias, num_items_in_batch=num_items_in_batch,
            importance_sampling_ratio=importance_sampling_ratio, cu_seqlens=cu_seqlens,
            sampling_logps=sampling_logps, grad_filter=self.grad_filter,
            softcap=self.options["softcap"], logit_scale=self.options["logit_scale"],
            vocab_group=self.options["vocab_group"], params=self.params)


class GRPOLoss(_GRPOModule):
    """GRPO loss from logits; see `grpo_loss`. Keywords: the GRPOParams fields (or params=),
    inplace, and softcap / logit_scale (for raw logits)."""

    @signature_with_params
    def __init__(self, *, inplace: bool = False, softcap: float | None = None,
                 logit_scale: float | None = None, params: GRPOParams | None = None,
                 **hyperparameters):
        check_flags(inplace=inplace)  # "False" would read as true: logits overwritten
        softcap, logit_scale = check_logit_transform(softcap, logit_scale)
        super().__init__(params, hyperparameters, inplace=inplace, softcap=softcap,
                         logit_scale=logit_scale)

    @property
    def inplace(self) -> bool:
        return self.options["inplace"]

    def forward(self, logits, completion_ids, advantages, completion_mask=None, old_logps=None,
                ref_logps=None, num_items_in_batch=None, importance_sampling_ratio=None,
                cu_seqlens=None, sampling_logps=None):
        return grpo_loss(logits, completion_ids, advantages, completion_mask, old_logps,
                         ref_logps, num_items_in_batch=num_items_in_batch,
                         importance_sampling_ratio=importance_sampling_ratio,
                         cu_seqlens=cu_seqlens, sampling_logps=sampling_logps,
                         inplace=self.inplace, softcap=self.options["softcap"],
                         logit_scale=self.options["logit_scale"], params=self.params)
