"""Packed (padding-free) rows for Hugging Face causal LMs.

A padded GRPO batch is [S, L]: prompts left-padded, completions right-padded. Its packed form lays
the real tokens of the S sequences end to end in rows [R, W], with `position_ids` restarting at 0
for every sequence and `attention_mask=None`: transformers (>= 5, sdpa/eager/flash attention)
then reads the sequence boundaries from the restarts and attends within each sequence only, so
every hidden state equals the padded one. A row's unused tail is a filler segment (its own
restart; nothing reads it).

Row width W: `choose_row_width` (`row_width.py`), from the model's config: one row for flash
implementations, a cost rule for sdpa, rows as narrow as the longest sequence otherwise.

    packed = pack_sequences(input_ids, attention_mask, T, completion_mask)
    loss, metrics = causal_lm_grpo_loss(model, packed.input_ids, None, packed.logits_to_keep,
                                        advantages, None, packed.pack(old_logps),
                                        packed.pack(ref_logps), cu_seqlens=packed.cu_seqlens,
                                        position_ids=packed.position_ids, loss_fn=loss_fn)

Kept completion tokens are the completion_mask's ones; the mask must be a prefix of each row (1s
then 0s, as an EOS mask is), because a token left out of the row cannot stay in the context of the
tokens after it. A row whose mask is all 0 keeps its prompt and no loss token (a zero-length
sequence: it adds nothing and counts in S, as the fully masked padded row does).
`check_packed_attention` tells whether a model really attends within the sequences of a row.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..validation import is_id_dtype
from .row_layout import RowLayout
from .row_width import choose_row_width, first_fit, takes_boundaries
from .unwrap import text_vocab_size

__all__ = ["PackedBatch", "check_packed_attention", "pack_sequences"]


@dataclass
class PackedBatch:
    """S sequences (N completion tokens kept in all) packed into rows [R, W].

    input_ids, position_ids: [R, W] int64; logits_to_keep: [N] int64 positions in the flattened
    rows (index r·W + w) whose hidden state predicts a kept completion token (the token after
    it, in the same row); cu_seqlens: [S + 1] int32 over the N tokens, in sequence order;
    token_index: [N] int64 flat index of each kept token in the padded [S, T] completion grid
    (`pack` / `unpack` move per-token values between the two)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logits_to_keep: torch.Tensor
    cu_seqlens: torch.Tensor
    token_index: torch.Tensor
    shape: tuple[int, int]  # (S, T) of the padded completion grid
    real_tokens: int  # positions holding real tokens (the rest of R·W is filler)
    row_lengths: tuple[int, ...] = ()  # real tokens at the head of each row (the rest: filler)
    # shared-prefix rows (shared_prompt.py): the 4-D mask to pass as attention_mask, and the
    # [R, W] segment ids it was built from; None for plain packed rows
    attention_mask: object = None
    segments: tuple | None = None

    @property
    def num_tokens(self) -> int:
        """Positions a forward computes, R·W (real tokens plus the rows' filler)."""
        return self.input_ids.numel()

    @property
    def layout(self) -> RowLayout:
        """The rows' `row_layout.RowLayout`: SHARED (the group's prompt once, a 4-D mask) or
        PACKED (position_ids only)."""
        return RowLayout.PACKED if self.attention_mask is None else RowLayout.SHARED

    def boundaries(self) -> dict:
        """The sequence boundaries of packed rows as flash implementations take them
        (`boundaries_of` their position_ids)."""
        if self.attention_mask is not None:
            raise ValueError("shared-prefix rows have no flash boundaries (a segment also sees "
                             "its prefix): they take their 4-D attention_mask")
        return boundaries_of(self.position_ids)

    def real_mask(self) -> torch.Tensor:
        """[R, W] int64: 1 at real tokens, 0 at the rows' filler tails (e.g. the attention_mask
        for statistics over real tokens only, such as an MoE router's load balance)."""
        R, W = self.input_ids.shape
        used = torch.tensor(self.row_lengths, device=self.input_ids.device).unsqueeze(1)
        return (torch.arange(W, device=self.input_ids.device) < used).long()

    def pack(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """Per-token [S, T] -> [N] (the kept tokens, in sequence order); None stays None."""
        if x is None:
            return None
        if tuple(x.shape) != self.shape:
            raise ValueError(f"expected a per-token [S, T] = {list(self.shape)} tensor, got "
                             f"{tuple(x.shape)}")
        return x.reshape(-1)[self.token_index]

    def unpack(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[N] -> [S, T] with `fill` at the tokens the rows do not hold."""
        out = x.new_full((self.shape[0] * self.shape[1],), fill)
        return out.index_copy(0, self.token_index, x).view(self.shape)


def boundaries_of(position_ids: torch.Tensor) -> dict:
    """Packed rows' sequence boundaries as transformers' flash implementations take them, from
    position_ids [R, W] that restart at 0 for every sequence (and every row's filler tail):
    cu_seq_lens_q/k [segments + 1] int32 over the flattened rows, max_length_q/k (int). Passed
    explicitly, flash attention needs no boundaries read from position_ids (which transformers
    does for one row only)."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().squeeze(1)  # every segment restarts at 0
    ends = torch.cat([starts[1:], starts.new_tensor([pos.numel()])])
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
    longest = int((ends - starts).max()) if starts.numel() else 0
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)


def check_prompt_and_completion(input_ids, attention_mask, logits_to_keep, completion_mask):
    """(prompt [S, L - T], completion [S, T]) bool masks of the tokens a padded batch puts into
    packed or shared rows, after checking the shapes, T, that every sequence has a prompt token
    and that the completion mask is a prefix of each row, of 0s and 1s."""
    for name, x in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor [S, L], got {type(x).__name__}")
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids and attention_mask must both be [S, L], got "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    if not is_id_dtype(input_ids.dtype):  # the rows would be filled with them as they are
        raise TypeError(f"input_ids must be an integer tensor of token ids, got {input_ids.dtype}")
    S, L = input_ids.shape
    if S == 0:  # no sequence: no row width (it failed as "max() arg is an empty sequence")
        raise ValueError(f"input_ids must hold at least one sequence, got shape (0, {L})")
    T = logits_to_keep
    if isinstance(T, bool) or not isinstance(T, int) or not 0 < T < L:
        raise ValueError(f"logits_to_keep must be an int in [1, L-1] = [1, {L - 1}], got {T!r}")
    prompt = attention_mask[:, :L - T].bool()  # [S, Lp]
    if completion_mask is not None:
        _check_binary(completion_mask)
    comp = attention_mask[:, L - T:].bool() if completion_mask is None else completion_mask.bool()
    if comp.shape != (S, T):
        raise ValueError(f"completion_mask must be [S, T] = [{S}, {T}], got {tuple(comp.shape)}")
    # a prefix: no kept token after a dropped one (cummin keeps 1 only up to the first 0)
    if not torch.equal(comp, comp.int().cummin(dim=1).values.bool()):
        raise ValueError("completion_mask must be 1s then 0s in every row (a prefix, as an EOS "
                         "mask is): a dropped token would otherwise vanish from the context of "
                         "the kept tokens after it")
    if not bool(prompt.any(dim=1).all()):
        raise ValueError("every sequence needs at least one prompt token (attention_mask 1 in "
                         "its first L - T columns): the first completion token is predicted "
                         "from the position before it")
    return prompt, comp


def _check_binary(completion_mask) -> None:
    """A row keeps a completion token or drops it, and the loss on packed or shared rows weighs
    every kept token 1: a weight other than 0 and 1 would be lost (it read as 1). The rows'
    layout is read on the host anyway (their lengths), so this read adds no wait."""
    if not isinstance(completion_mask, torch.Tensor):
        raise TypeError(f"completion_mask must be a tensor [S, T] or None, got "
                        f"{type(completion_mask).__name__}")
    if completion_mask.dtype != torch.bool and not bool(
            ((completion_mask == 0) | (completion_mask == 1)).all()):
        raise ValueError("completion_mask must hold 0s and 1s for packed or shared rows (a "
                         "token is kept or dropped; each kept token weighs 1 in the loss): "
                         "other weights need padded rows")


def pack_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                   completion_mask: torch.Tensor | None = None, *, pad_token_id: int = 0,
                   row_width: int | None = None, model_config=None) -> PackedBatch:
    """The packed rows of a padded batch: input_ids, attention_mask [S, L]; the completion is
    the last `logits_to_keep` = T columns; completion_mask [S, T] (default: attention_mask's
    last T columns) says which completion tokens are kept (a prefix of each row). row_width:
    W (at least the longest sequence; default: `choose_row_width(lengths, model_config)`, the
    rule of `row_width.py` for the config's attention); pad_token_id fills the rows' tails."""
    prompt, comp = check_prompt_and_completion(input_ids, attention_mask, logits_to_keep,
                                               completion_mask)
    S, L = input_ids.shape
    T = logits_to_keep
    keep = torch.cat([prompt, comp], dim=1)  # [S, L] the tokens that go into the rows
    lengths = keep.sum(dim=1).tolist()
    W = choose_row_width(lengths, model_config) if row_width is None else row_width
    if isinstance(W, bool) or not isinstance(W, int) or W < max(lengths):
        raise ValueError(f"row_width must be an int >= the longest sequence ({max(lengths)} "
                         f"tokens), got {row_width!r}")
    row, offset, used = first_fit(lengths, W)
    R, device = len(used), input_ids.device
    start = torch.tensor([r * W + o for r, o in zip(row, offset)], device=device)  # [S]
    k = keep.cumsum(dim=1) - 1  # each token's place within its sequence, [S, L]
    dest = (start.unsqueeze(1) + k)[keep]  # flat row position of every real token
    ids = torch.full((R * W,), pad_token_id, dtype=input_ids.dtype, device=device)
    ids[dest] = input_ids[keep]
    # filler tails restart at 0 (their own segment); real tokens count from 0 per sequence
    pos = (torch.arange(W, device=device) - torch.tensor(used, device=device).unsqueeze(1))
    pos = pos.clamp(min=0).reshape(-1)
    pos[dest] = k[keep]
    counts = comp.sum(dim=1)  # [S] kept completion tokens
    cu = torch.zeros(S + 1, dtype=torch.int32, device=device)
    cu[1:] = counts.cumsum(0)
    comp_dest = (start.unsqueeze(1) + k)[:, L - T:][comp]  # [N] in sequence order
    return PackedBatch(
        input_ids=ids.view(R, W), position_ids=pos.view(R, W),
        logits_to_keep=comp_dest - 1,  # the position before each kept token
        cu_seqlens=cu, token_index=comp.reshape(-1).nonzero().squeeze(1), shape=(S, T),
        real_tokens=sum(lengths), row_lengths=tuple(used))


_PACKING_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# How closely a packed (or shared-prefix) row's logits must match separate forwards (relative
# to max(1, the largest logit)): above rounding, far below a leak. On the checks' own inputs
# (`python -m benchmarks.check_bounds`, docs/trainer.md) eager and sdpa differ by 1.2e-6 in
# float32 and 2.0e-2 in bf16; a sequence that sees the other's tokens moves by 1.27 in both.
FULL_PRECISION_ATOL = 1e-4
HALF_PRECISION_ATOL = 5e-2


def agreement_atol(model: nn.Module) -> float:
    """The checks' bound for `model` as it runs now: half precision when a parameter is 16-bit
    or autocast is on for its device."""
    device = next(model.parameters()).device
    half = torch.is_autocast_enabled(device.type) or any(
        p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
    return HALF_PRECISION_ATOL if half else FULL_PRECISION_ATOL


def logits_disagree(model: nn.Module, got, want, atol: float | None = None) -> float | None:
    """max |got - want| where past atol·max(1, max |want|), else None (atol: agreement_atol)."""
    err = (got - want).abs().max().item()
    atol = agreement_atol(model) if atol is None else atol
    return None if err <= atol * max(1.0, want.abs().max().item()) else err


def check_packed_attention(model: nn.Module, atol: float | None = None) -> str | None:
    """None if `model` attends within the sequences of a packed row, else why not (a sentence).

    Runs the model on two short sequences, packed and one at a time, and compares the logits
    (`logits_disagree`, atol): implementations or models that do not read sequence boundaries
    from position_ids would let the second sequence see the first. Implementations that take
    the boundaries (`takes_boundaries`) are handed them, as the trainers hand them. Cached per
    model, attention implementation (`hf.attention_choice` may check another one than the
    model's own) and bound. Pass the model before a DDP/FSDP wrapper (a PEFT wrapper is fine)."""
    inner = model
    config = getattr(inner, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    seen = _PACKING_CHECKED.setdefault(inner, {})
    key = (impl, agreement_atol(inner) if atol is None else atol)  # a dtype's bound, or atol
    if key in seen:
        return seen[key]
    vocab = text_vocab_size(config)
    device = next(inner.parameters()).device
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(0, vocab, (1, 5), generator=generator).to(device)
    b = torch.randint(0, vocab, (1, 4), generator=generator).to(device)
    row = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(5), torch.arange(4)]).unsqueeze(0).to(device)
    reason = None
    was_training = inner.training
    inner.eval()  # no dropout in the comparison
    try:
        with torch.no_grad():
            bounds = boundaries_of(pos) if takes_boundaries(config) else {}
            packed = inner(input_ids=row, position_ids=pos, use_cache=False,
                           **bounds).logits.float()
            alone = torch.cat([inner(input_ids=x, use_cache=False).logits.float()
                               for x in (a, b)], dim=1)
        err = logits_disagree(inner, packed, alone, atol)
        if err is not None:
            reason = (f"{type(inner).__name__} with attention {impl!r} attends across the "
                      f"sequences of a packed row (logits differ by {err:.2g} from separate "
                      "forwards)")
    except Exception as exc:  # noqa: BLE001  (any failure means: do not pack)
        reason = (f"{type(inner).__name__} with attention {impl!r} failed on a packed row: "
                  f"{type(exc).__name__}: {exc}")
    finally:
        inner.train(was_training)
    seen[key] = reason
    return reason


# ---- the packed form inside causal_lm.py --------------------------------------------------------


def check_packed_positions(input_ids, attention_mask, positions) -> None:
    """Packed rows: input_ids [R, W], no attention mask (shared-prefix rows: their 4-D mask),
    positions [N] int into the flattened rows, never a row's last column (a position predicts
    the token after it, in its row)."""
    if attention_mask is not None and len(getattr(attention_mask, "shape", ())) != 4:
        raise ValueError("packed rows take attention_mask=None (with position_ids restarting "
                         "per sequence), or shared-prefix rows their 4-D mask "
                         "(`share_prompts`); a 2-D mask would let sequences attend across")
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"logits_to_keep as a tensor must be int32/int64 [N] positions, got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    R, W = input_ids.shape
    if positions.numel() and not (int(positions.min()) >= 0 and int(positions.max()) < R * W
                                  and not bool((positions % W == W - 1).any())):
        raise ValueError(f"logits_to_keep positions must index the flattened rows [0, R*W) = "
                         f"[0, {R * W}) and never a row's last column (each predicts the next "
                         f"token of its row); got [{int(positions.min())}, "
                         f"{int(positions.max())}] with W = {W}")


def completion_targets(input_ids: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The tokens the kept positions predict: [B, T] (int T) or [1, N] (positions [N])."""
    if isinstance(logits_to_keep, torch.Tensor):
        return input_ids.reshape(1, -1)[:, logits_to_keep.to(torch.int64) + 1]
    return input_ids[:, -logits_to_keep:]


def keep_positions(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """Hidden states [B, L, D] -> the ones that predict the kept tokens, [B, T, D] / [1, N, D]."""
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden.reshape(1, -1, hidden.shape[-1])[:, logits_to_keep.to(torch.int64)]
    return hidden[:, -logits_to_keep - 1:-1, :]
