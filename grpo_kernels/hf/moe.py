"""Mixture-of-Experts models: the load-balancing auxiliary loss, from the router logits of the
model body, computed as the model's own forward computes it.

    hidden, router_logits = completion_hidden_states(model, ids, mask, T,
                                                     return_router_logits=True)
    aux = load_balancing_loss(model)(router_logits, mask)

transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, ...) compute it in their
forward as `load_balancing_loss_func(outputs.router_logits, self.num_experts,
self.num_experts_per_tok, attention_mask)`, with the function of their own modeling module;
`load_balancing_loss` binds the same function and numbers. A model whose module has no such
function, or one with another signature (Doge's takes the number of keys too), raises
NotImplementedError.

A config saved with `output_router_logits: true` makes the model's own forward add that loss
with the attention mask it is given, which fails on a shared-prefix row's 4-D mask; the
helpers' full-model forwards pass `router_logits_off(model)`, which turns it off there.
"""

from __future__ import annotations

import functools
import inspect
import sys

from torch import nn

from .unwrap import text_config, unwrap_model

__all__ = ["load_balancing_loss", "router_logits_off"]

# load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask), as Mixtral's
_SIGNATURE = ["gate_logits", "num_experts", "top_k", "attention_mask"]


def load_balancing_loss(model: nn.Module):
    """fn(router_logits, attention_mask) -> the auxiliary loss of `model`'s forward (0-dim),
    without the coefficient: its modeling module's `load_balancing_loss_func` with the number
    of experts and of experts per token its forward passes (the model's attributes
    num_experts / num_experts_per_tok, else its text config's). `router_logits` is the body
    output's (one tensor per MoE layer), attention_mask the [B, L] mask given to the model."""
    inner = unwrap_model(model)
    name = type(inner).__name__
    func = getattr(sys.modules.get(type(inner).__module__), "load_balancing_loss_func", None)
    if func is None:
        raise NotImplementedError(f"{name}'s modeling module has no load_balancing_loss_func: "
                                  "its auxiliary loss is not known")
    params = list(inspect.signature(func).parameters)
    if params[:len(_SIGNATURE)] != _SIGNATURE:
        raise NotImplementedError(f"{name}'s load_balancing_loss_func takes {params}, not "
                                  f"Mixtral's {_SIGNATURE}: its arguments are not known")
    config = text_config(inner.config)
    num_experts = getattr(inner, "num_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(inner, "num_experts_per_tok", None) or getattr(
        config, "num_experts_per_tok", None)
    if not isinstance(num_experts, int) or not isinstance(top_k, int):
        raise NotImplementedError(f"{name} does not say its number of experts "
                                  f"(num_experts={num_experts}, num_experts_per_tok={top_k})")
    return functools.partial(_aux_loss, func, num_experts, top_k, name)


def _aux_loss(func, num_experts, top_k, name, router_logits, attention_mask):
    if not isinstance(router_logits, tuple) or not router_logits:
        # the function returns the int 0 then, which would silently drop the loss
        raise ValueError(f"{name}'s body returned no router logits ({type(router_logits)}); "
                         "call it with output_router_logits=True")
    return func(router_logits, num_experts, top_k, attention_mask)


def router_logits_off(model: nn.Module) -> dict:
    """Keywords for a full forward of `model` that returns logits only: {"output_router_logits":
    False} where its config (or text config) asks for router logits, whose forward would then
    add the auxiliary loss over the attention mask it is given (Mixtral's reads a 2-D mask and
    fails on a 4-D one); {} otherwise, so that other models get no keyword they do not take."""
    config = getattr(unwrap_model(model), "config", None)
    text = text_config(config)
    asks = any(getattr(c, "output_router_logits", False) for c in (config, text))
    return {"output_router_logits": False} if asks else {}
