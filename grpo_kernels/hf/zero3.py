"""DeepSpeed ZeRO-3: the output head's full weight for the fused paths, its gradient to the shards.

ZeRO-3 keeps every parameter as a flat shard per process; a parameter is whole only while a
module that owns it runs its forward or backward (DeepSpeed's module hooks gather and release
it) or inside `deepspeed.zero.GatheredParameters`. The fused paths read the head's weight
directly (`head_for`), outside any forward of the head module, and their backward needs the full
[V, D] weight again. So `gathered_head` (called by `causal_lm.resolved_head` for a head whose
weight is a ZeRO-3 parameter) all-gathers the head's weight and bias (those sharded at the time,
with the parameters' own `all_gather`, as GatheredParameters does), returns full copies made by
an autograd function (`_FullCopy`) and shards the parameters again right away.

Backward: `_FullCopy` passes the full-weight gradient that the fused loss computed to the
parameter itself. Autograd's accumulation into `param.grad` needs the parameter whole at that
moment (a gradient must match its parameter's layout), as it is in DeepSpeed's own module
backward, so `_FullCopy.backward` gathers the parameters again; the accumulation runs next,
DeepSpeed's own post-accumulate-grad hook (the one every ZeRO-3 gradient takes) averages the
gradient across processes and keeps this process's shard, and a hook of ours shards the
parameter again. Tied embeddings: the head's weight is the input embedding's parameter, autograd
sums both gradients before accumulating once, and the embedding's DeepSpeed backward fetch finds
the parameter whole and releases it after.

Memory: the full copy lives from the fused forward to its backward, which follows right away (the
loss is the last op of the forward), so the peak is that of DeepSpeed's own lm_head, which gathers
the head for its backward too. Without grad (old/reference scoring) the copy is freed after the
call. Every process must take this path at the same points (the gathers are collectives), as the
trainer's loss and scoring calls do.

A head parameter that DeepSpeed is prefetching (INFLIGHT) when the fused head needs it raises a
RuntimeError (not seen in the tests, which run DeepSpeed's default prefetch). Not covered: a PEFT
adapter on a ZeRO-3 head (its factors are sharded too) raises NotImplementedError; a head bias
is gathered like the weight, but no tested model has one.

Used by grpo_kernels.trl's GRPOTrainer under accelerate's DeepSpeed ZeRO-3, tested against TRL's
own trainer with two CPU processes (tests/trl/test_trl_zero3.py, DeepSpeed 0.19.8). DeepSpeed is
imported only once a ZeRO-3 parameter is seen.
"""

from __future__ import annotations

import torch

from .head_adapters import ResolvedHead
from .unwrap import unwrap_model

__all__ = ["gathered_head", "is_zero3_param", "zero3_head"]


def is_zero3_param(tensor) -> bool:
    """Whether `tensor` is a parameter partitioned by DeepSpeed ZeRO-3 (deepspeed.zero.Init or
    the ZeRO-3 engine), as DeepSpeed itself tells (`is_zero_param`: it carries a ds_id)."""
    return isinstance(tensor, torch.Tensor) and hasattr(tensor, "ds_id")


def zero3_head(model: torch.nn.Module) -> bool:
    """Whether the output embedding of `model` (inside its wrappers) has ZeRO-3 parameters."""

    inner = unwrap_model(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    return head is not None and any(is_zero3_param(p) for p in head.parameters())


def _status(name: str):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return getattr(ZeroParamStatus, name)


def _gather(params) -> list:
    """All-gather those of `params` that are sharded now (a collective: every process calls it
    at the same point); returns them, for `_release`. Parameters already whole (held by a
    module's forward or backward, or persistent) are left to whoever holds them."""
    todo = [p for p in params if p.ds_status == _status("NOT_AVAILABLE")]
    inflight = [p for p in params if p.ds_status == _status("INFLIGHT")]
    if inflight:  # a prefetch by DeepSpeed's coordinator; it cannot be waited on from here
        raise RuntimeError(f"ZeRO-3 parameter(s) {[p.ds_id for p in inflight]} of the output "
                           "head are being prefetched by DeepSpeed while the fused head needs them")
    if todo:
        todo[0].all_gather(param_list=todo)
    return todo


def _release(params) -> None:
    """Shard again what `_gather` gathered (unless a module's forward or backward holds it)."""
    params = [p for p in params
              if p.ds_status == _status("AVAILABLE") and not p.ds_active_sub_modules]
    if params:
        params[0].partition(param_list=params)


def _release_after_accumulate(param) -> None:
    """Post-accumulate-grad hook (registered once per parameter, after DeepSpeed's own, which
    has read the full `param.grad` by then): shard the parameter again if `_FullCopy.backward`
    gathered it."""
    if getattr(param, "_grpo_kernels_regathered", False):
        param._grpo_kernels_regathered = False
        _release([param])


class _FullCopy(torch.autograd.Function):
    """Copies of gathered ZeRO-3 parameters; their gradients go back to the parameters whole.

    Backward: autograd's accumulation into `param.grad` ([V, D]) needs the parameter whole at
    that moment (a gradient must match its parameter's layout), as it is in DeepSpeed's own
    module backward; so the parameters are gathered again here, the accumulation runs next
    (autograd runs gradient accumulation before any other ready node), DeepSpeed's hook
    reduce-scatters the gradient and `_release_after_accumulate` shards the parameter again.
    A tied head's weight is also the input embedding's: its accumulation waits for the
    embedding's backward, whose own DeepSpeed fetch then finds it whole and releases it after."""

    @staticmethod
    def forward(*params):
        return tuple(p.detach().clone() for p in params)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.params = inputs

    @staticmethod
    def backward(ctx, *grads):
        need = [p for p, g in zip(ctx.params, grads) if g is not None and p.requires_grad]
        for p in _gather(need):
            p._grpo_kernels_regathered = True
            if not hasattr(p, "_grpo_kernels_release_hook"):
                p._grpo_kernels_release_hook = p.register_post_accumulate_grad_hook(
                    _release_after_accumulate)
        return grads


def gathered_head(resolved: ResolvedHead, where: str) -> ResolvedHead:
    """`resolved` with the full weight and bias of a ZeRO-3 head: differentiable copies (see the
    module docstring); a head without ZeRO-3 parameters comes back as it is."""
    params = [p for p in (resolved.weight, resolved.bias) if p is not None]
    if not any(is_zero3_param(p) for p in params):
        return resolved
    if resolved.lora:
        raise NotImplementedError(
            f"the output embedding {where} carries a LoRA adapter and is sharded by DeepSpeed "
            "ZeRO-3; the fused head gathers plain weight and bias only")
    gathered = _gather(params)
    try:
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            copies = _FullCopy.apply(*params)
        else:
            copies = tuple(p.detach().clone() for p in params)
    finally:
        _release(gathered)
    weight = copies[0]
    bias = copies[1] if resolved.bias is not None else None
    return ResolvedHead(weight, bias, [])
