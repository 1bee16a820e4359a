"""A vocabulary-parallel call's checks, in the order that keeps every rank in step.

1. Each rank validates its own arguments (shapes, dtypes, devices: the checks of the whole-head
   call), catching the error instead of raising it.
2. One all-gather (`shard.agree`) tells every rank which ranks failed, each rank's shard size,
   the hidden size, the token count, the gradients wanted, the hidden states' and the weight's
   dtypes, the call's options, the route's settings, and a checksum of every per-token input
   and of where its values lie. Any disagreement raises the same error on every rank; a rank
   whose own check failed raises its own error.
3. The token ids against the global vocabulary (the sum of the shards' rows): the same ids on
   every rank (their checksums agreed), so every rank raises alike.

Only then do the statistics' collectives run, on inputs every rank holds alike: a bad input on
one rank raises on every rank instead of leaving the others waiting in a collective. The
checksums read every per-token input twice (hidden [N, D] included), which is cheap beside the
[N, V_r, D] products; comparing the hidden states' values themselves would need them on one
rank. The table's read is one host synchronization per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..value_checks import check_token_id_values
from .shard import VocabShard, agree


class CallInputs(NamedTuple):
    """What `agreed` reads of a checked call: the local head [N, D], [V_r, D], [V_r] | None, the
    global ids [N], the per-token inputs every rank must hold alike, and the call's scalar
    options (the GRPO hyperparameters, temperature, logit transform, grad_filter, backend,
    outputs asked for), compared by their repr: ranks with other options would compute other
    values, or take another route with other collectives."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    ids: torch.Tensor
    checked: dict
    options: tuple = ()


def grad_bits(*tensors) -> int:
    """Grad mode and which tensors require grad, as one int (ranks must agree: the backward's
    all-reduce runs where hidden requires grad)."""
    bits = int(torch.is_grad_enabled())
    for i, t in enumerate(tensors):
        bits |= int(t is not None and t.requires_grad) << (i + 1)
    return bits


@torch.compiler.disable  # a collective and a host read
def agreed(shard: VocabShard, check: Callable, inputs_of: Callable[[object], CallInputs],
           ids_name: str) -> tuple[VocabShard, object]:
    """(the shard with every rank's size, check()'s result) once every rank agrees (see the
    module docstring); check() validates this rank's arguments (ValueError / TypeError) and
    returns the checked call, inputs_of(call) what the ranks compare."""
    error, call, meta = None, None, dict(rows=0, hidden_size=0, tokens=0, grads=0,
                                         dtypes=(None, None), checked={}, options=())
    try:
        call = check()
        got = inputs_of(call)
        if got.weight.shape[0] == 0:
            raise ValueError("a vocabulary shard must hold at least one row of the weight")
        meta = dict(rows=got.weight.shape[0], hidden_size=got.weight.shape[1],
                    tokens=got.ids.numel(), grads=grad_bits(got.hidden, got.weight, got.bias),
                    dtypes=(got.hidden.dtype, got.weight.dtype),
                    checked={"hidden states": got.hidden, ids_name: got.ids, **got.checked},
                    options=got.options)
        device = got.hidden.device
    except (ValueError, TypeError) as exc:
        error = exc
        device = _device_of(shard)
    shard = agree(shard, error, device=device, **meta)
    check_token_id_values(ids_name, got.ids, shard.vocab_size,
                          f"the sum of the {shard.world} shards' rows {list(shard.sizes)}")
    return shard, call


def _device_of(shard: VocabShard) -> torch.device:
    """Where the group's collectives run when this rank's own inputs could not say (gloo: the
    CPU; nccl: this process' CUDA device)."""
    import torch.distributed as dist

    backend = dist.get_backend(shard.group)
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
