"""Sharded data parallelism for `grpo_train --fsdp`: PyTorch FSDP2 (`fully_shard`).

Layout: every decoder layer (the model's `_no_split_modules` classes) is its own FSDP unit; the
root unit (the CausalLM itself) holds the rest: embeddings, final norm and lm_head, so a tied
head and its embedding stay one parameter. Each process keeps 1/world of every parameter, of its
gradient and of the AdamW state; a unit is all-gathered for its forward and again for its
backward, and its gradient is reduce-scattered (averaged over processes, as DDP averages).

The fused loss runs the body and then reads `lm_head.weight`, which outside a forward is only a
shard. So the loss (and the no-grad log-probs) run as a registered FSDP forward method of the
root (`grpo_kernels.hf.run_as_forward`, registered on first use): FSDP unshards the root's
parameters before the method, the layers unshard in their own forwards, the head weight the loss
sees is the full [V, D] matrix, and the backward through the loss unshards it again and
reduce-scatters its gradient like any other. The trainer calls them through
`hf.run_as_forward`, which is a plain call for a model that is not sharded.

Generation runs `model.generate` with every unit all-gathered once for the call
(`full_parameters`): one all-gather per unit instead of one per unit per token, and no collective
inside the decoding loop, so processes may stop generating at different lengths.

Checkpoints hold full (unsharded) tensors in the same format as a DDP run's: the model's
state_dict and the optimizer's state_dict keyed by parameter index, gathered onto the main
process; every process loads the full file and keeps its shard. A checkpoint written with
--fsdp resumes without it and the other way round.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist
from torch import nn

from grpo_kernels import hf

from . import tensor_parallel

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # torch 2.4-2.5
    from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
        FSDPModule,
        fully_shard,
    )


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def require_process_group() -> None:
    """--fsdp's launch check (before anything heavy is loaded)."""
    if not dist.is_available() or not dist.is_initialized():
        from .flags import UsageError  # a ValueError: one-line message from the CLI

        raise UsageError("--fsdp needs several processes: launch with `accelerate launch "
                         "--num_processes N -m grpo_train ...` or `torchrun --nproc_per_node N "
                         "-m grpo_train ...` (one process: leave out --fsdp)")


def shard_model(model: nn.Module, device: torch.device, frozen: bool = False) -> nn.Module:
    """Shards `model` (a transformers CausalLM, unwrapped) in place over all processes of the
    default process group and returns it. Call before building the optimizer (the parameters
    become DTensor shards). Every process must call it with the same architecture; the main
    process' values are broadcast first, as DDP does. `frozen` (a reference model, never
    differentiated): the root is resharded after every forward too, as nothing follows."""
    if is_sharded(model):
        raise ValueError(f"{type(model).__name__} is already sharded")
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names and m is not model]
    _check_unit_dtypes(model, blocks)
    require_process_group()
    # the hidden-state path checks the head once with a nested forward of the model; do it
    # before sharding (cached per model), never inside FSDP's forward hooks
    hf.check_output_head(model)
    _broadcast_from_main(model)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    # the policy's root is needed again at once by the backward: FSDP's default keeps it
    model._grpo_root_reshard = frozen
    fully_shard(model, mesh=mesh, reshard_after_forward=frozen)
    # DDP's gradient-accumulation interface, so the trainer treats both wrappers alike
    model.no_sync = types.MethodType(_no_sync, model)
    return model


def _check_unit_dtypes(model: nn.Module, blocks: list[nn.Module]) -> None:
    """FSDP2 all-gathers a unit's parameters as one buffer, so a unit holds one dtype (torch
    otherwise fails at the first forward, inside FSDP). The root unit holds what the blocks do
    not: a float32 head beside 16-bit embeddings (--fp32_lm_head) mixes two."""
    from .flags import UsageError

    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = [(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks]
    for unit, params in [(type(b).__name__, list(b.named_parameters())) for b in blocks] + [
            (type(model).__name__, root)]:
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for _, p in params})
        if len(dtypes) > 1:
            first = {}
            for n, p in params:
                first.setdefault(str(p.dtype).removeprefix("torch."), n)
            raise UsageError(
                f"--fsdp shards the parameters of {unit} as one unit, which needs one dtype, "
                f"but they mix {', '.join(f'{d} ({first[d]})' for d in dtypes)}; "
                "--fp32_lm_head on a 16-bit model does this: use --model_dtype float32 with "
                "--bf16 instead (a float32 head under bf16 autocast)")


def _broadcast_from_main(model: nn.Module) -> None:
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=0)


@contextlib.contextmanager
def _no_sync(self):
    """Accumulate unsharded gradients locally; the next synchronized backward reduce-scatters.
    FSDP2 reads the setting while the backward runs, so the backward goes inside the block."""
    self.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        self.set_requires_gradient_sync(True)


def _units(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def full_parameters(model: nn.Module):
    """Every unit of a sharded model all-gathered for the whole block (generation), then
    resharded; re-entrant; a no-op for an unsharded model. Every process must enter it."""
    if not is_sharded(model) or getattr(model, "_grpo_full_parameters", False):
        yield
        return
    units = _units(model)
    model.set_reshard_after_forward(False)  # recursive: forwards keep the gathered weights
    for unit in units:  # explicitly, in one order on every process: no lazy all-gathers later
        unit.unshard()
    model._grpo_full_parameters = True
    try:
        yield
    finally:
        model._grpo_full_parameters = False
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(model._grpo_root_reshard, recurse=False)  # as built
        for unit in units:
            unit.reshard()


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_, as a float; with sharded gradients the norm is the
    global one (DTensor reduces the shards' partial sums; tensor parallelism:
    `tensor_parallel.clip_grad_norm`)."""
    if tensor_parallel.is_tensor_parallel(model):
        return tensor_parallel.clip_grad_norm(model, max_norm)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.item()


# ---- checkpoints: full tensors, DDP's format ---------------------------------------------------


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state_dict, optimizer state_dict) with full tensors. Unsharded: the modules' own.
    Sharded: gathered onto the main process (on CPU), the optimizer's re-keyed by parameter
    index as torch.optim writes it; the other processes get ({}, {}). Every process must call it.
    Tensor parallelism: `tensor_parallel.state_dicts`.
    """
    if tensor_parallel.is_tensor_parallel(model):
        return tensor_parallel.state_dicts(model, optimizer)
    if not is_sharded(model):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = _full_model_state(model)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    if dist.get_rank() != 0:
        return {}, {}
    return model_sd, _optimizer_by_index(optim_sd, _param_names(model))


def load_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict,
                     optim_sd: dict) -> None:
    """Loads full state dicts (as `state_dicts` or a DDP run writes them) into the model and the
    optimizer; a sharded model keeps this process' shard of each tensor."""
    if tensor_parallel.is_tensor_parallel(model):
        tensor_parallel.load_state_dicts(model, optimizer, model_sd, optim_sd)
        return
    if not is_sharded(model):
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, optimizer, _optimizer_by_name(optim_sd, _param_names(model)),
                             options=options)


def _param_names(model: nn.Module) -> list[str]:
    """Parameter names in model.parameters() order (the optimizer's indices), tied ones once."""
    return [name for name, _ in model.named_parameters()]


def _optimizer_by_index(sd: dict, names: list[str]) -> dict:
    index = {name: i for i, name in enumerate(names)}
    missing = [k for k in sd["state"] if k not in index]
    if missing:
        raise RuntimeError(f"optimizer state for parameters not in the model: {missing[:3]}")
    groups = [dict(g, params=[index[n] for n in g["params"]]) for g in sd["param_groups"]]
    return {"state": {index[k]: v for k, v in sd["state"].items()}, "param_groups": groups}


def _optimizer_by_name(sd: dict, names: list[str]) -> dict:
    if any(not isinstance(k, int) for k in sd["state"]) or any(
            not isinstance(p, int) for g in sd["param_groups"] for p in g["params"]):
        raise ValueError("the checkpoint's optimizer state is not keyed by parameter index")
    n = sum(len(g["params"]) for g in sd["param_groups"])
    if n != len(names):
        raise ValueError(f"the checkpoint's optimizer covers {n} parameters, the model has "
                         f"{len(names)}: not the same model")
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]]
    return {"state": {names[i]: v for i, v in sd["state"].items()}, "param_groups": groups}


def export_model(model: nn.Module) -> nn.Module:
    """A plain (unsharded) copy of a sharded model on the main process, for save_pretrained and
    train()'s return value; the sharded model itself elsewhere. Every process must call it."""
    if tensor_parallel.is_tensor_parallel(model):
        return tensor_parallel.export_model(model)
    if not is_sharded(model):
        return model
    full = _full_model_state(model)
    if dist.get_rank() != 0:
        return model
    plain_cls = next(c for c in type(model).__mro__[1:] if not issubclass(c, FSDPModule))
    return tensor_parallel.plain_model(plain_cls, model.config, full, model)


def _full_model_state(model: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
