"""The vocabulary shard of a tensor-parallel output head, and the checks its ranks agree on.

A vocabulary-parallel head is split along the vocabulary: rank r of a process group holds rows
[start_r, start_r + V_r) of the [V, D] weight (and of the bias), contiguous ranges in the
group's rank order whose sizes may differ. A caller passes one in either of two forms:

    a DTensor weight (and bias) with Shard(0) on a 1-D mesh, or with Shard(0) on one dimension
        of a 2-D mesh and Replicate() on the other, as transformers' tp_plan and torch's
        parallelize_module make them: the group is that mesh dimension's;
    the local shard [V_r, D] as a plain tensor and `vocab_group=`, a torch.distributed
        process group (Megatron-style trainers keep their own).

`local_head` turns either into (VocabShard, local weight, local bias), checking what every rank
sees alike (the DTensor's placements). `agree` is the one collective check before any other
collective of a call: every rank's local validation result, shard size, hidden size, token
count, gradient needs, dtypes, options (hyperparameters and the like) and route settings, and a
checksum of each per-token input and of where its values lie (the hidden states, the targets,
the GRPO tensors), in one all-gather of a few int64 per rank. Whatever disagrees raises the
same error on every rank, so a bad input on one rank never leaves the others waiting in a later
collective.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import torch
import torch.distributed as dist

# Dtypes by code in the agreement vector (a dtype that differs across ranks is refused); the
# "dtype" field holds the hidden states' and the weight's, `_dtype_code`.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The route's settings read from the environment (ops/route.py's ENV and CHUNK_ENV): ranks that
# read different values would take different routes, with different collectives.
_ROUTE_ENV = ("GRPO_KERNELS_THREE_PASS", "GRPO_KERNELS_CHUNK_MIB")
N_CHECKSUMS = 10  # per-token inputs checksummed per call (unused slots are 0)
_FIELDS = ("status", "rows", "hidden_size", "tokens", "grads", "dtype", "settings")
_ENV_TEXT = "the environment's GRPO_KERNELS_THREE_PASS / GRPO_KERNELS_CHUNK_MIB"
_OPTIONS = ("the call's options (GRPO hyperparameters, temperature, softcap, logit_scale, "
            "grad_filter, backend, return_terms / return_token_values)")


class VocabParallelError(ValueError):
    """Inputs of a vocabulary-parallel call that disagree across the ranks of its group (or a
    rank's own bad input), raised on every rank of the group."""


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """One rank's view of a vocabulary-parallel head. `sizes` (every rank's V_r, in rank
    order) is filled by `agree`; before that it is empty."""

    group: object  # torch.distributed ProcessGroup
    rank: int  # this process' rank in `group` (= its shard's index)
    world: int  # ranks in `group`
    form: str  # how the caller passed it (for messages and the route's log line)
    global_rows: int | None = None  # the DTensor's global V, None for a local shard
    sizes: tuple[int, ...] = ()

    @property
    def start(self) -> int:
        """The first global vocabulary id of this rank's rows."""
        return sum(self.sizes[:self.rank])

    @property
    def vocab_size(self) -> int:
        return sum(self.sizes)

    @property
    def max_rows(self) -> int:
        """The largest shard: the route and the chunk sizes use it, so that every rank decides
        alike."""
        return max(self.sizes)


def is_vocab_parallel(weight, vocab_group) -> bool:
    """Whether a call gets a vocabulary-parallel head (a DTensor weight, or vocab_group=)."""
    return vocab_group is not None or _is_dtensor(weight)


def _is_dtensor(t) -> bool:
    if t is None or not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def check_vocab_group(vocab_group) -> None:
    """vocab_group: None or a torch.distributed ProcessGroup (TypeError naming it otherwise)."""
    if vocab_group is None:
        return
    group_type = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    if group_type is None or not isinstance(vocab_group, group_type):
        raise TypeError("vocab_group must be None or a torch.distributed ProcessGroup (the "
                        f"ranks that share the vocabulary), got {type(vocab_group).__name__}")


def local_head(weight, bias, vocab_group=None, hidden=None):
    """(VocabShard, local weight [V_r, D], local bias [V_r] | None, hidden) of a
    vocabulary-parallel head, the tensors differentiable into the caller's (a DTensor's
    gradient comes back as a DTensor with its placements). A replicated DTensor `hidden` is
    taken as its local tensor. Raises for a DTensor sharded otherwise than Shard(0) on one mesh
    dimension, and for a `vocab_group` that is not that dimension's group."""
    check_vocab_group(vocab_group)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("a vocabulary-parallel head needs torch.distributed to be initialized "
                           "(torch.distributed.init_process_group)")
    if _is_dtensor(weight):
        group, form, rows = _dtensor_group(weight, "weight")
        if vocab_group is not None and vocab_group is not group:
            raise ValueError("vocab_group= is not the process group of the weight's sharded mesh "
                             "dimension: pass a DTensor weight without vocab_group=, or the "
                             "local shard with it")
        if bias is not None:
            if not _is_dtensor(bias) or _dtensor_group(bias, "bias")[0] is not group:
                raise ValueError("bias must be a DTensor sharded like the weight (Shard(0) on the "
                                 "same mesh dimension) when the weight is a DTensor")
            bias = bias.to_local()
        weight = weight.to_local()
    else:
        if _is_dtensor(bias):
            raise ValueError("bias is a DTensor but the weight is not: pass both as DTensors, or "
                             "both as local shards with vocab_group=")
        group, form, rows = vocab_group, "a local shard with vocab_group=", None
    if _is_dtensor(hidden):
        from torch.distributed.tensor import Replicate

        if any(p != Replicate() for p in hidden.placements):
            raise ValueError(f"hidden is a DTensor with placements {hidden.placements}: the "
                             "hidden states must be the same on every rank (Replicate())")
        hidden = hidden.to_local()
    shard = VocabShard(group, dist.get_rank(group), dist.get_world_size(group), form, rows)
    return shard, weight, bias, hidden


def _dtensor_group(t, name: str):
    """(process group, form, global rows) of a DTensor sharded Shard(0) on one mesh dimension
    and replicated on the others; ValueError otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    placements, mesh = tuple(t.placements), t.device_mesh
    sharded = [d for d, p in enumerate(placements) if p == Shard(0)]
    others_ok = all(p == Replicate() for d, p in enumerate(placements) if d not in sharded)
    if len(sharded) != 1 or not others_ok or mesh.ndim > 2:
        raise ValueError(
            f"{name} is a DTensor with placements {placements} on a {mesh.ndim}-D mesh: a "
            "vocabulary-parallel head is sharded along the vocabulary, Shard(0) on one mesh "
            "dimension (Replicate() on the other of a 2-D mesh); a head sharded along the "
            "hidden size (Shard(1)) or held as partial sums is not one")
    dim = sharded[0]
    form = ("DTensor Shard(0) on a 1-D mesh" if mesh.ndim == 1 else
            f"DTensor Shard(0) on dimension {dim} of a 2-D mesh")
    return mesh.get_group(dim), form, t.shape[0]


# ---- the agreement: one all-gather of a few int64 per rank -----------------------------------


def all_gather(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """out [world·n, ...] = every rank's x [n, ...] in rank order (all_gather_single where this
    torch has it: all_gather_into_tensor is deprecated there)."""
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_single(out, x, group=group)


_PRIME = 2**31 - 1  # sums and position weights are kept below it: no int64 product overflows


def checksum(t) -> torch.Tensor | int:
    """A checksum of a tensor's bits and of where they lie (0-dim int64; 0 for None), the same
    whatever the reduction order (integer sums), so ranks with different thread counts agree.
    The tensor is read as [R, C] (C its last dimension): its row sums weighted by the row's
    index and its column sums weighted by the column's, so that the same values in other
    places (sequences in another order, a mask padded on the other side, shifted targets)
    differ too; differing tensors almost surely differ."""
    if t is None:
        return 0
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.numel() == 0:
        return 0
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    x = t.view(bits).reshape(-1, t.shape[-1] if t.dim() else 1)  # [R, C]
    rows = _by_position(x.sum(1, dtype=torch.int64))
    cols = _by_position(x.sum(0, dtype=torch.int64))
    return rows + cols * _PRIME + t.numel()


def _by_position(sums: torch.Tensor) -> torch.Tensor:
    """Σ_i (i + 1)·sums_i mod _PRIME (0-dim int64) of sums [n] int64: each term below 2^62."""
    at = torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=sums.device)
    return (sums.remainder(_PRIME) * at.remainder(_PRIME)).remainder(_PRIME).sum().remainder(
        _PRIME)


def agree(shard: VocabShard, error: Exception | None, *, rows: int, hidden_size: int,
          tokens: int, grads: int, dtypes: tuple, checked: dict, device,
          options: tuple = ()) -> VocabShard:
    """The shard with every rank's size, once every rank agrees; otherwise the same error on
    every rank. error: this rank's own validation error (None if its inputs passed). checked:
    {name: tensor | None} of per-token inputs that must be equal on every rank (at most
    N_CHECKSUMS). grads: a bit mask of the gradients wanted (and grad mode). dtypes: the
    hidden states' and the weight's (a mixed head on some ranks only would all-reduce d hidden
    in float32 there and in the 16-bit dtype elsewhere). options: the call's scalar options
    (`agreement.CallInputs`), compared with the route's environment in one int64."""
    if len(checked) > N_CHECKSUMS:
        raise ValueError(f"at most {N_CHECKSUMS} checked inputs, got {len(checked)}")
    names = list(checked)
    sums = [torch.zeros((), dtype=torch.int64, device=device)] * N_CHECKSUMS
    if error is None:
        sums[:len(names)] = [torch.as_tensor(checksum(checked[n]), device=device)
                             for n in names]
    route_env = "\0".join(os.environ.get(k, "") for k in _ROUTE_ENV)
    settings = _crc31(route_env) << 31 | _crc31(repr(options))  # < 2^62
    head = [1 if error is not None else 0, rows, hidden_size, tokens, grads,
            _dtype_code(*dtypes), settings]
    mine = torch.cat([torch.tensor(head, dtype=torch.int64, device=device), torch.stack(sums)])
    table = torch.empty(shard.world * mine.numel(), dtype=torch.int64, device=device)
    all_gather(table, mine, group=shard.group)
    table = table.view(shard.world, -1).tolist()  # one host read
    _raise_disagreement(shard, error, table, names)
    sizes = tuple(int(r[1]) for r in table)
    if shard.global_rows is not None and sum(sizes) != shard.global_rows:
        raise VocabParallelError(
            f"the shards' rows {list(sizes)} add up to {sum(sizes)}, not the DTensor's "
            f"vocabulary size {shard.global_rows}: the local shards disagree with the weight")
    return dataclasses.replace(shard, sizes=sizes)


# A DTensor weight sharded Shard(0) is read as a vocabulary-parallel head, and FSDP2's
# fully_shard shards a parameter the same way, on a data-parallel group whose ranks hold other
# batches: the likely cause of inputs that differ across the group.
_FSDP_HINT = ("; if the weight is a parameter of a model sharded by FSDP2 (fully_shard), it is "
              "not a vocabulary-parallel head: compute the loss inside the model's forward, "
              "where FSDP2 unshards it (grpo_kernels.hf.causal_lm_grpo_loss, run_as_forward)")


def _raise_disagreement(shard: VocabShard, error, table: list, names: list) -> None:
    """The checks on the gathered table, identical on every rank (each reads the same table)."""
    failed = [r for r, row in enumerate(table) if row[0]]
    if error is not None:  # this rank's own message, on this rank
        raise error
    if failed:
        raise VocabParallelError(
            f"rank {failed[0]} of the vocabulary group rejected its inputs (its own error says "
            "why); every rank of the group raises, so that none waits in a collective")
    columns = {name: [row[i] for row in table] for i, name in enumerate(_FIELDS)}
    hint = _FSDP_HINT if shard.form.startswith("DTensor") else ""  # for inputs that differ
    for field, text in (("hidden_size", "the hidden size D (weight.shape[1])"),
                        ("tokens", "the number of tokens N"),
                        ("grads", "which tensors require grad (and grad mode)")):
        if len(set(columns[field])) > 1:
            raise VocabParallelError(
                f"{text} differs across the ranks of the vocabulary group: {columns[field]} "
                f"(ranks 0..{shard.world - 1}); every rank must hold the same inputs{hint}")
    _raise_dtypes(shard, columns["dtype"])
    settings, base = columns["settings"], len(_FIELDS)
    same_call = "every rank of the group must make the same call, each on its own shard"
    compared = [(_ENV_TEXT, [c >> 31 for c in settings], same_call),
                (_OPTIONS, [c & (2**31 - 1) for c in settings], same_call),
                *((name, [row[base + i] for row in table],
                   f"a vocabulary-parallel head needs the same {name} on every rank of its "
                   "group (each rank holds part of the vocabulary, not part of the batch)")
                  for i, name in enumerate(names))]
    for name, values, why in compared:
        if len(set(values)) > 1:
            other = next(r for r, v in enumerate(values) if v != values[0])
            raise VocabParallelError(
                f"{name} differ between ranks 0 and {other} of the vocabulary group: {why}{hint}")


def _crc31(text: str) -> int:
    """31 bits of a string's CRC-32 (two of them fit one int64)."""
    return zlib.crc32(text.encode()) & (2**31 - 1)


def _dtype_code(hidden_dtype, weight_dtype) -> int:
    """One int64 for the (hidden, weight) dtypes: 5·i + j of their indices in _DTYPES (4: any
    other, or None where this rank's own check failed)."""
    index = [_DTYPES.index(d) if d in _DTYPES else len(_DTYPES)
             for d in (hidden_dtype, weight_dtype)]
    return index[0] * (len(_DTYPES) + 1) + index[1]


def _raise_dtypes(shard: VocabShard, codes: list) -> None:
    """The same error on every rank where the ranks' hidden or weight dtypes differ."""
    n = len(_DTYPES) + 1
    names = [*map(str, _DTYPES), "another dtype"]
    for text, part in (("the hidden states' dtype", lambda c: c // n),
                       ("the weight's dtype", lambda c: c % n)):
        got = [names[part(c)] for c in codes]
        if len(set(got)) > 1:
            raise VocabParallelError(
                f"{text} differs across the ranks of the vocabulary group: {got} (ranks "
                f"0..{shard.world - 1}); every rank's shard must have the same dtype")
