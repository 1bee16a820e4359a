"""Tensor parallelism for `grpo_train --tp_size N`: transformers' plan (the model's
`base_model_tp_plan`, loaded with `DistributedConfig(tp_size=N)`), launched with
`torchrun --nproc_per_node N -m grpo_train --tp_size N`.

Every process of the run is one rank of one tensor-parallel group: --tp_size must equal the
number of processes. Data parallelism across a second mesh dimension is refused here (the loss
itself takes a 2-D data x tensor mesh: `grpo_kernels.parallel`).

What a tensor-parallel run does differently:
- models: loaded with the plan (the embedded model is built, warmed up and saved to
  OUTPUT_DIR/initial_model first, then loaded so); each rank holds 1/N of every sharded weight,
  the output head split along the vocabulary (a DTensor with Shard(0)). The reference model is
  loaded again: a deep copy would share the policy's tensor-parallel forwards, which transformers
  installs as closures over the policy's modules;
- data: every rank is data-parallel rank 0 of 1: the same prompts and the same seed, so the
  ranks sample the same completions (transformers' head gathers the logits for sampling) and
  compute the same rewards; what the processes gather is counted once per group (`data_rows`);
- loss and scoring: the fused loss and log-probs take the DTensor head (no [N, V] logits,
  `grpo_kernels.parallel`), and check that the hidden states agree across the group;
- optimizer: the gradients are DTensor shards (no data-parallel all-reduce: one group); the
  clipping norm adds the sharded gradients' squares over the group (`clip_grad_norm`);
- checkpoints: full tensors gathered onto the main process, in DDP's format; on load each rank
  keeps its shard. The final model is a plain full copy on the main process.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .flags import UsageError


def require(tp_size: int, world: int) -> None:
    """--tp_size's launch check (before any model is loaded)."""
    if tp_size == 1:
        return
    if not dist.is_available() or not dist.is_initialized() or world != tp_size:
        raise UsageError(
            f"--tp_size {tp_size} needs {tp_size} processes, one per rank of the tensor-parallel "
            f"group (this run has {world}): launch with `torchrun --nproc_per_node {tp_size} -m "
            f"grpo_train --tp_size {tp_size} ...`; data parallelism across a second mesh "
            "dimension is not supported by grpo_train")


def load_kwargs(cfg) -> dict:
    """from_pretrained's keywords for the run's tensor parallelism ({} without it)."""
    if getattr(cfg, "tp_size", 1) == 1:
        return {}
    from transformers.distributed.configuration_utils import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_size=cfg.tp_size)}


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether `model`'s parameters are tensor-parallel shards (DTensors, not FSDP2's: an
    FSDPModule's parameters are DTensors too)."""
    from torch.distributed.fsdp import FSDPModule

    return not isinstance(model, FSDPModule) and any(_is_dtensor(p) for p in model.parameters())


def data_rows(rows: torch.Tensor, tp: int, world: int) -> torch.Tensor:
    """Every process' rows [world·B, ...], gathered in rank order, counted once per
    tensor-parallel group: the rows of each group's first rank, [world / tp · B, ...] (the ranks
    of a group hold the same batch; process p is rank p % tp of group p // tp)."""
    if tp == 1:
        return rows
    per_process = rows.shape[0] // world
    return rows.view(world // tp, tp, per_process, *rows.shape[1:])[:, 0].reshape(
        -1, *rows.shape[1:])


# ---- gradients ------------------------------------------------------------------------------


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ for a tensor-parallel model (whose gradients mix DTensor
    shards and plain replicated tensors, which torch's refuses): the global 2-norm, each
    sharded gradient's squares summed over its group and each replicated one counted once;
    gradients scaled by min(1, max_norm / norm). Returns the norm before clipping."""
    from torch.distributed.tensor import Replicate

    sharded, replicated, groups = [], [], {}
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if _is_dtensor(g) and any(pl != Replicate() for pl in g.placements):
            sharded.append(g.to_local())
            groups[id(g.device_mesh)] = g.device_mesh.get_group()
        else:
            replicated.append(g.to_local() if _is_dtensor(g) else g)
    if len(groups) > 1:
        raise NotImplementedError("gradients sharded over several meshes")
    sq = lambda ts: sum((t.detach().float().pow(2).sum() for t in ts),  # noqa: E731
                        torch.zeros((), device=next(model.parameters()).device))
    total = sq(sharded)
    if groups:
        dist.all_reduce(total, group=next(iter(groups.values())))
    norm = (total + sq(replicated)).sqrt().item()
    if math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)  # torch's clip_grad_norm_ coefficient
        for t in sharded + replicated:
            t.mul_(scale)
    return norm


# ---- checkpoints and the final model: full tensors, DDP's format ------------------------------


def _full(t):
    return t.full_tensor() if _is_dtensor(t) else t


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state_dict, optimizer state_dict) with full tensors on the main process (CPU),
    ({}, {}) elsewhere. Every process must call it (each DTensor is gathered)."""
    model_sd = {k: _full(v).detach().cpu() for k, v in model.state_dict().items()}
    optim_sd = optimizer.state_dict()
    state = {i: {k: _full(v).cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in optim_sd["state"].items()}
    if dist.get_rank() != 0:
        return {}, {}
    return model_sd, dict(optim_sd, state=state)


def _shard_like(full: torch.Tensor, like):
    """`full` as `like` holds it: a DTensor with like's mesh and placements, or as it is."""
    if not _is_dtensor(like):
        return full.to(like.device, like.dtype)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements,
                             src_data_rank=None)


def load_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict,
                     optim_sd: dict) -> None:
    """Full state dicts (as `state_dicts` or a one-process run writes them) into a
    tensor-parallel model and its optimizer: each rank keeps its shard."""
    current = model.state_dict()
    with torch.no_grad():
        for name, full in model_sd.items():
            if name not in current:
                raise ValueError(f"the checkpoint's {name!r} is not a parameter of the model")
            target = current[name]
            (target.to_local() if _is_dtensor(target) else target).copy_(
                _shard_like(full, target).to_local() if _is_dtensor(target) else full)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, s in optim_sd["state"].items():
        p = params[int(i)]
        state[i] = {k: _shard_like(v, p) if isinstance(v, torch.Tensor) and v.shape == p.shape
                    else v for k, v in s.items()}
    optimizer.load_state_dict(dict(optim_sd, state=state))


def export_model(model: nn.Module) -> nn.Module:
    """A plain full copy of a tensor-parallel model on the main process (for save_pretrained and
    train()'s result), the model itself elsewhere. Every process must call it."""
    full = {k: _full(v).detach().cpu() for k, v in model.state_dict().items()}
    if dist.get_rank() != 0:
        return model
    import copy

    config = copy.deepcopy(model.config)
    if hasattr(config, "distributed_config"):  # a plain model: no plan to apply on load
        config.distributed_config = None
    return plain_model(type(model), config, full, model)


def plain_model(cls, config, full: dict, model: nn.Module) -> nn.Module:
    """`cls(config)` holding the full state dict `full` (assigned, no second random
    initialization) and `model`'s buffers (replicated, not in the state dict: rotary tables),
    with its generation config and training mode: the plain copy of a sharded model that
    `export_model` here and in sharding.py return."""
    with torch.device("meta"):
        plain = cls(config)
    plain.load_state_dict(full, assign=True)
    for name, buf in model.named_buffers():
        owner, _, attr = name.rpartition(".")
        plain.get_submodule(owner)._buffers[attr] = buf.detach().clone()
    if hasattr(plain, "tie_weights"):
        plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain.train(model.training)
