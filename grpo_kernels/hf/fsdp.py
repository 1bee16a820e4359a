"""FSDP2 (`fully_shard`): run a function of a sharded model as a forward of its root.

The fused paths read the output head's weight directly (`head_for`), never through a forward of
the head module. FSDP2 keeps that weight as a DTensor shard outside a forward of the module that
owns it, so the fused loss or log-probs of a sharded model must run inside such a forward. A
function of the model run through `run_as_forward` is a registered FSDP forward method of the root
(`register_fsdp_forward_method`): FSDP unshards the root's parameters (embeddings, final norm,
head: a full [V, D] weight) before it and reshards after, the decoder layers unshard in their own
forwards, and the backward through its outputs unshards the head again and reduce-scatters its
gradient like any other parameter's.

A function of the model may run a forward of the root itself, nested in that one: the head's
once-per-model check (`check_output_head`, a short forward of the model) and the hidden states
of a wrapped root (a PEFT model: `completion_hidden_states` calls the wrapper). A root built with
`reshard_after_forward=True` (accelerate's FSDP2 default, and how TRL shards its reference model)
would reshard after that nested forward, and the rest of the function would read DTensor shards:
the body's embedding fails, and the head looks like a vocabulary-parallel one. So the root stays
unsharded until the registered forward ends (`_root_kept_unsharded`) and reshards then.

Used by grpo_kernels.trl's GRPOTrainer (under accelerate's FSDP2) and by grpo_train --fsdp.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

from .unwrap import unwrap_model

__all__ = ["fsdp2_root", "run_as_forward"]

# The name of the method registered on an FSDP2 root (once per root, on its first use).
FORWARD_METHOD = "_grpo_kernels_forward"


def fsdp2_root(model: nn.Module) -> nn.Module | None:
    """The FSDP2 (`fully_shard`) module that owns the output head's parameters: the model or the
    transformers model inside its wrappers; None when the model is not sharded with FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return None
    for candidate in (model, unwrap_model(model)):
        if isinstance(candidate, FSDPModule):
            return candidate
    return None


@contextlib.contextmanager
def _root_kept_unsharded(root: nn.Module):
    """Within the block, a nested forward of `root` leaves its parameters unsharded (see the
    module docstring); the setting is restored after. FSDP2 keeps it per parameter group of the
    root's state (`post_forward_mesh_info`: None keeps them unsharded), which
    `set_reshard_after_forward` sets but cannot read back."""
    state = root._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: one group per state, or none
        groups = [g for g in (getattr(state, "_fsdp_param_group", None),) if g is not None]
    saved = [g.post_forward_mesh_info for g in groups]
    for g in groups:
        g.post_forward_mesh_info = None
    try:
        yield
    finally:
        for g, info in zip(groups, saved):
            g.post_forward_mesh_info = info


def _call_forward(root, call, target):
    """The registered method: call(target) with the root unsharded throughout, views among its
    outputs copied (FSDP2 hooks the outputs for its backward; a view would make that hook
    fragile and FSDP warns about it)."""
    with _root_kept_unsharded(root):
        out = call(target)
    fresh = lambda x: x.clone() if isinstance(x, torch.Tensor) and x._is_view() else x  # noqa: E731
    if not isinstance(out, tuple):
        return fresh(out)
    values = [fresh(x) for x in out]
    # a named tuple (GRPOTerms from the loss route) keeps its type and field names
    return type(out)(*values) if hasattr(out, "_fields") else tuple(values)


def run_as_forward(model: nn.Module, fn):
    """fn(model), run as a forward of the model's FSDP2 root when it is sharded (see the module
    docstring); without FSDP2 this is fn(model). A tensor output, or the tensors of a tuple
    output, that are views come back as copies."""
    root = fsdp2_root(model)
    if root is None:
        return fn(model)
    if not hasattr(root, FORWARD_METHOD):
        from torch.distributed.fsdp import register_fsdp_forward_method

        setattr(root, FORWARD_METHOD, types.MethodType(_call_forward, root))
        register_fsdp_forward_method(root, FORWARD_METHOD)
    return getattr(root, FORWARD_METHOD)(fn, model)
