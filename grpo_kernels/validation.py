"""Input validation: every public function checks its inputs here and fails with an error that
names the argument and what was expected. Kernels never see an out-of-range index. Checks of
values (token ids in range, finite advantages, a positive normalizer) are `value_checks.py`'s;
the checks of the scalar options (flags, temperature, softcap, grad_filter) `option_checks.py`'s."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import value_checks
from .option_checks import (  # noqa: F401  (the scalar options' checks, imported from here too)
    check_flags,
    check_grad_filter,
    check_logit_transform,
    check_temperature,
)
from .value_checks import check_finite_advantages, check_token_id_values  # noqa: F401

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_id_dtype(dtype: torch.dtype) -> bool:
    """An integer dtype that can hold token ids (not float, complex or bool)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _tensor(name: str, x, *, ndim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:  # a sparse tensor failed inside (no reshape for sparse)
        raise TypeError(f"{name} must be a dense tensor (torch.strided), got {x.layout}; "
                        "convert it with .to_dense()")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if x.dim() not in allowed:
            raise ValueError(
                f"{name} must have {' or '.join(map(str, allowed))} dimensions, "
                f"got shape {tuple(x.shape)}"
            )
    return x


def _same_device(name: str, x: torch.Tensor, device: torch.device, ref_name: str) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {device}; "
                         "move them to the same device")


def _float(name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor "
                        f"(float16/bfloat16/float32/float64), got {x.dtype}")


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int, shape, device,
                    vocab_from: str = "weight.shape[0]", check_values: bool = True,
                    source: str = "hidden") -> torch.Tensor:
    """Integer ids of `shape` (`source`'s leading dimensions) in [0, vocab_size), on `source`'s
    device (hidden, or logits); returns them as contiguous int64. check_values=False leaves the
    range check to the caller (the custom ops run it in their eager implementation, so that
    torch.compile never reads a tensor's value)."""
    _tensor(name, ids)
    if not is_id_dtype(ids.dtype):
        raise TypeError(f"{name} must be an integer tensor (token ids, of any integer dtype), "
                        f"got {ids.dtype}")
    if tuple(ids.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} ({source}.shape[:-1]), got "
                         f"{tuple(ids.shape)}")
    _same_device(name, ids, device, source)
    if check_values:
        check_token_id_values(name, ids, vocab_size, vocab_from)
    return ids.to(torch.int64).contiguous()


def _mixed_head(hidden_dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
    """16-bit hidden states with a float32 lm_head (the "fp32 head" recipe): the kernels keep
    the 16-bit tensor cores by splitting the weight (precision.split_dot)."""
    return hidden_dtype in (torch.float16, torch.bfloat16) and weight_dtype == torch.float32


def check_linear_head(hidden, weight, bias, hidden_name: str = "hidden"):
    """hidden [..., D], weight [V, D], bias [V] | None on one device; hidden and weight of one
    dtype, or 16-bit hidden with a float32 weight; bias in weight's dtype."""
    _tensor(hidden_name, hidden)
    if hasattr(weight, "ds_id") and weight.dim() != 2:  # DeepSpeed's mark (hf/zero3.py)
        raise ValueError(
            f"weight is a parameter partitioned by DeepSpeed ZeRO-3 (here {tuple(weight.shape)}, "
            f"whole {tuple(getattr(weight, 'ds_shape', ()))}): gather it first "
            "(deepspeed.zero.GatheredParameters), or pass the model to grpo_kernels.hf "
            "(causal_lm_grpo_loss, head_for), which gathers it")
    _tensor("weight", weight, ndim=2)
    _float(hidden_name, hidden)
    _float("weight", weight)
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{hidden_name} must end in the hidden size D = weight.shape[1] = {weight.shape[1]}, "
            f"got shape {tuple(hidden.shape)} (weight is [V, D] = {tuple(weight.shape)})"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one vocabulary row, got shape "
                         f"{tuple(weight.shape)}")
    if weight.shape[1] == 0:  # [N, 0] hidden cannot be flattened to [-1, D] for the kernels
        raise ValueError(f"weight must have a hidden size D >= 1, got shape {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype and not _mixed_head(hidden.dtype, weight.dtype):
        raise TypeError(
            f"{hidden_name} ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype, "
            "or be 16-bit (float16/bfloat16) with a float32 weight (mixed head precision); "
            "cast one of them (e.g. weight.to(hidden.dtype))")
    _same_device("weight", weight, hidden.device, hidden_name)
    if bias is not None:
        _tensor("bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape [V] = [{weight.shape[0]}], "
                             f"got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias ({bias.dtype}) must have weight's dtype ({weight.dtype})")
        _same_device("bias", bias, hidden.device, hidden_name)


def check_logits(logits, ndim: int | None = None) -> None:
    """Floating-point logits [..., V] (exactly `ndim` dimensions if given), V >= 1."""
    _tensor("logits", logits, ndim=ndim)
    _float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must end in a vocabulary dimension V >= 1, "
                         f"got shape {tuple(logits.shape)}")


@dataclass
class LossInputs:
    """Validated per-token GRPO inputs, float32 on the device of hidden (or logits). A packed
    batch (cu_seqlens given) has per-token tensors [N] and per-sequence ones [S, 1]."""

    mask: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B, 1] or [B, T]
    old_logps: torch.Tensor | None  # [B, T]
    ref_logps: torch.Tensor | None  # [B, T]
    importance_sampling_ratio: torch.Tensor | None  # [B, 1] or [B, T]
    num_items_in_batch: torch.Tensor | None  # 0-dim float32, > 0 and finite
    cu_seqlens: torch.Tensor | None = None  # [S + 1] int64, packed batches only
    sampling_logps: torch.Tensor | None = None  # [B, T], the sampler's (off-policy mask only)


@dataclass(frozen=True)
class _Shapes:
    """The shapes a batch's per-token inputs may take: per token, and per sequence. The texts
    are built only for an error: formatting a size under torch.compile fixes it to its value
    (a guard), so a compiled step would recompile at every new B or T."""

    tokens: tuple[int, ...]  # (B, T), or (N,) packed
    seqs: int  # B, or S packed

    @classmethod
    def padded(cls, B: int, T: int) -> _Shapes:
        return cls((B, T), B)

    @classmethod
    def packed(cls, N: int, S: int) -> _Shapes:
        return cls((N,), S)

    @property
    def token_text(self) -> str:  # "[B, T] = [2, 5]", or "[N] = [10] (packed tokens)"
        if len(self.tokens) == 2:
            return f"[B, T] = [{self.tokens[0]}, {self.tokens[1]}]"
        return f"[N] = [{self.tokens[0]}] (packed tokens)"

    @property
    def seq_text(self) -> str:  # "[B] = [2] or [B, 1]", or the packed batch's [S]
        S = self.seqs
        if len(self.tokens) == 2:
            return f"[B] = [{S}] or [B, 1]"
        return f"[S] = [{S}] or [S, 1] (S + 1 = {S + 1} entries of cu_seqlens)"


def _per_token(name, x, shapes: _Shapes, device, allow_seq: bool,
               ref_name: str = "hidden") -> torch.Tensor:
    _tensor(name, x)
    _float(name, x)
    _same_device(name, x, device, ref_name)
    shape, S = tuple(x.shape), shapes.seqs
    # per sequence first: a packed batch with S = N reads a 1-D tensor as one value per sequence.
    # Two == tests, not `shape in (...)`: under torch.compile(dynamic=True) Dynamo reads a tuple
    # of symbolic sizes as absent from a tuple of tuples (torch 2.13) though == holds.
    if allow_seq and (shape == (S,) or shape == (S, 1)):
        return x.float().reshape(S, 1)
    if shape == shapes.tokens:
        return x.float()
    want = shapes.token_text + (f", {shapes.seq_text}" if allow_seq else "")
    raise ValueError(f"{name} must have shape {want}, got {shape}")


def check_cu_seqlens(cu_seqlens, num_tokens: int, device, ref_name: str = "hidden"
                     ) -> torch.Tensor:
    """cu_seqlens [S + 1] (S >= 1) of an integer dtype on `device`, 0 = cu_seqlens[0] <= ...
    <= cu_seqlens[S] = N; returns it as contiguous int64. The value checks read S + 1 integers
    to the host (a CPU tensor), are a device check (a CUDA tensor, `value_checks.defer`) or an
    in-graph assertion under torch.compile."""
    _tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 \
            or cu_seqlens.shape[0] < 2:
        raise ValueError(
            "cu_seqlens must be a 1-D int32 or int64 tensor [S + 1] of sequence starts "
            "(sequence s holds tokens cu_seqlens[s]:cu_seqlens[s+1]), at least [0, N]; got "
            f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
    _same_device("cu_seqlens", cu_seqlens, device, ref_name)
    cu = cu_seqlens.to(torch.int64).contiguous()
    compiling = torch.compiler.is_compiling()
    if compiling or cu.device.type == "cuda":  # no host read (see value_checks.py)
        ok = (cu[0] == 0) & (cu[-1] == num_tokens) & (cu[1:] >= cu[:-1]).all()
        message = "cu_seqlens must start at 0, never decrease and end at N"
        if compiling:  # no N in the text: formatting a traced N would fix it (a recompile per N)
            torch._assert_async(ok, message)
        else:
            value_checks.defer(~ok, f"{message} = {num_tokens}")
        return cu
    values = cu.tolist()  # S + 1 integers: one small host read
    problem = None
    if values[0] != 0:
        problem = f"must start at 0, got cu_seqlens[0] = {values[0]}"
    elif values[-1] != num_tokens:
        problem = (f"must end at the number of tokens N = {num_tokens} ({ref_name}.shape[0]), "
                   f"got cu_seqlens[-1] = {values[-1]}")
    else:
        for s, (a, b) in enumerate(zip(values, values[1:])):
            if b < a:
                problem = (f"must not decrease (sequence lengths are >= 0), got "
                           f"cu_seqlens[{s + 1}] = {b} < cu_seqlens[{s}] = {a}")
                break
    if problem is not None:
        raise ValueError(f"cu_seqlens {problem}; sequence s holds tokens "
                         "cu_seqlens[s]:cu_seqlens[s+1] (the flash-attention convention)")
    return cu


def check_loss_inputs(
    B: int, T: int, device, params, completion_mask, advantages, old_logps, ref_logps,
    importance_sampling_ratio, num_items_in_batch, ref_name: str = "hidden",
    check_values: bool = True, cu_seqlens: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
) -> LossInputs:
    """Validates the per-token loss inputs against [B, T] and the device of `ref_name` (the
    tensor the loss is computed from: hidden or logits). check_values=False skips the finite
    check of the advantages (the custom ops run it; see check_token_ids).

    A packed batch passes cu_seqlens [S + 1] and (B, T) = (1, N): per-token inputs are then
    [N], per-sequence ones [S] or [S, 1], and the mask may be omitted."""
    shapes = _Shapes.padded(B, T)
    if cu_seqlens is not None:
        cu_seqlens = check_cu_seqlens(cu_seqlens, B * T, device, ref_name)
        shapes = _Shapes.packed(B * T, cu_seqlens.shape[0] - 1)

    def per_token(name, x, allow_seq):
        return _per_token(name, x, shapes, device, allow_seq, ref_name)

    if completion_mask is None:
        mask = torch.ones(shapes.tokens, device=device, dtype=torch.float32)
    else:
        _tensor("completion_mask", completion_mask)
        if tuple(completion_mask.shape) != shapes.tokens:
            raise ValueError(f"completion_mask must have shape {shapes.token_text}, "
                             f"got {tuple(completion_mask.shape)}")
        _same_device("completion_mask", completion_mask, device, ref_name)
        if completion_mask.dtype.is_complex:  # .float() would drop the imaginary part
            raise TypeError("completion_mask must be a real tensor (bool, integer or floating "
                            f"point), got {completion_mask.dtype}")
        mask = completion_mask.float()
        if completion_mask.is_floating_point():  # bool and integer masks are finite
            mask = value_checks.check_finite_mask(mask)
    adv = per_token("advantages", advantages, allow_seq=True)
    if check_values:
        check_finite_advantages(adv)
    old = None if old_logps is None else per_token("old_logps", old_logps, False)
    ref = None
    if params.beta != 0.0:
        if ref_logps is None:
            raise ValueError(f"ref_logps is required when beta != 0 (beta = {params.beta})")
        ref = per_token("ref_logps", ref_logps, False)
    isr = None
    if importance_sampling_ratio is not None:
        isr = per_token("importance_sampling_ratio", importance_sampling_ratio, True)
    num_items_in_batch = value_checks.check_normalizer("num_items_in_batch", num_items_in_batch,
                                                       device)
    sampling = None
    if sampling_logps is not None:  # NaN allowed: a token the sampler could not score
        sampling = per_token("sampling_logps", sampling_logps, False)
    return LossInputs(mask, adv, old, ref, isr, num_items_in_batch, cu_seqlens, sampling)


def check_logits_loss_inputs(
    logits, completion_ids, params, completion_mask, advantages, old_logps, ref_logps,
    importance_sampling_ratio, num_items_in_batch, check_values: bool = True, cu_seqlens=None,
    sampling_logps=None,
) -> tuple[torch.Tensor, LossInputs]:
    """Validates the inputs of a GRPO loss from logits [B, T, V] (packed: [N, V] and
    cu_seqlens); returns (completion_ids [B, T] (or [N]) int64, LossInputs). Shared by
    `grpo_loss` and its reference so both fail the same way."""
    packed = cu_seqlens is not None
    if not packed and isinstance(logits, torch.Tensor) and logits.dim() == 2:
        raise ValueError(f"logits must have 3 dimensions [B, T, V], got shape "
                         f"{tuple(logits.shape)}; a packed batch's logits [N, V] need cu_seqlens")
    check_logits(logits, ndim=None if packed else 3)
    if not packed:
        _check_shifted(logits, completion_ids)
    if packed and logits.dim() != 2:
        raise ValueError(f"logits must be [N, V] with cu_seqlens (a packed batch), got shape "
                         f"{tuple(logits.shape)}")
    *lead, V = logits.shape
    ids = check_token_ids("completion_ids", completion_ids, V, lead, logits.device,
                          "logits.shape[-1]", check_values, source="logits")
    B, T = (1, lead[0]) if packed else lead
    inputs = check_loss_inputs(B, T, logits.device, params, completion_mask, advantages,
                               old_logps, ref_logps, importance_sampling_ratio,
                               num_items_in_batch, ref_name="logits", check_values=check_values,
                               cu_seqlens=cu_seqlens, sampling_logps=sampling_logps)
    return ids, inputs


def _check_shifted(logits, completion_ids) -> None:
    """A model's whole output [B, T + 1, V] (the last position predicts nothing in the
    completion) given for logits [B, T, V]: a ValueError naming logits, not completion_ids."""
    ids_shape = getattr(completion_ids, "shape", None)
    if (ids_shape is not None and len(ids_shape) == 2 and ids_shape[0] == logits.shape[0]
            and logits.shape[1] == ids_shape[1] + 1):
        raise ValueError(
            f"logits has {logits.shape[1]} positions for completion_ids' {ids_shape[1]}: "
            "logits[b, t] must predict completion_ids[b, t]; pass logits[:, :-1] (a view, read "
            "in place) if the last position predicts the token after the completion")


def check_linear_loss_inputs(
    hidden, weight, bias, completion_ids, params, completion_mask, advantages, old_logps,
    ref_logps, importance_sampling_ratio, num_items_in_batch, check_values: bool = True,
    cu_seqlens=None, sampling_logps=None,
) -> tuple[torch.Tensor, LossInputs]:
    """Validates the inputs of a GRPO loss from hidden [B, T, D] (packed: [N, D] and
    cu_seqlens) and a head weight [V, D] (and bias [V]); returns (completion_ids [B, T] (or
    [N]) int64, LossInputs). Shared by `fused_linear_grpo_loss` and its reference."""
    check_linear_head(hidden, weight, bias)
    packed = cu_seqlens is not None
    if hidden.dim() != (2 if packed else 3):
        want = "[N, D] with cu_seqlens (a packed batch)" if packed else "[B, T, D]"
        hint = "; a packed batch's hidden [N, D] needs cu_seqlens" if hidden.dim() == 2 else ""
        raise ValueError(f"hidden must be {want}, got shape {tuple(hidden.shape)}{hint}")
    lead = hidden.shape[:-1]
    ids = check_token_ids("completion_ids", completion_ids, weight.shape[0], lead, hidden.device,
                          check_values=check_values)
    B, T = (1, lead[0]) if packed else lead
    inputs = check_loss_inputs(B, T, hidden.device, params, completion_mask, advantages,
                               old_logps, ref_logps, importance_sampling_ratio,
                               num_items_in_batch, check_values=check_values,
                               cu_seqlens=cu_seqlens, sampling_logps=sampling_logps)
    return ids, inputs
