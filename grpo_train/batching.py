"""Micro-batches of a step: which sequences go into each forward/backward, and in what form.

A step's B sequences (this process' share) are cut into contiguous micro-batches, either by a
sequence count (--micro_batch_size) or by a token budget (--max_tokens_per_microbatch). Each
micro-batch is then laid out (`models.micro_batch_layout` chose how, with
`grpo_kernels.hf.choose_layout`; `grpo_kernels.hf.plan_rows` lays the rows out) as

- "padded": rows [b, Lp + T] with the attention mask, as generation returned them;
- "packed" (padding-free): the real tokens of its sequences end to end in rows [R, W] with
  position_ids restarting per sequence (`grpo_kernels.hf.pack_sequences`), as wide as
  `grpo_kernels.hf.choose_row_width` says for the model's attention: one row with flash
  attention (which is also handed the boundaries, cu_seq_lens_* and max_length_*), widths
  priced by a cost rule with sdpa; or
- "shared" (the default where the model allows it): the group's prompt once, followed by its
  completions, under a 4-D mask that keeps siblings apart (`grpo_kernels.hf.share_prompts`).
  The G completions of a prompt are consecutive in the step, so a micro-batch shares every
  prompt whose completions it holds (a group cut between two micro-batches shares within each).

All three give the same loss, gradients and metrics. The padded form's cost is b x (Lp + T)
tokens; the packed form's is the real prompt + completion tokens plus the rows' unused tails;
the shared form's is each prompt once plus the completions (a budget counts the packed form's
real tokens, an upper bound for the shared form).

With several processes (DDP/FSDP) every process must run the same number of forwards (each
runs collectives), so the count is agreed on first (`agree`: the maximum over processes) and a
process with fewer chunks splits its largest ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo_kernels.hf import PackedBatch, RowLayout, parse_row_layout, plan_rows, row_inputs

from .config import auto_value
from .flags import UsageError
from .models import position_ids


@dataclass
class MicroBatch:
    """Sequences `seqs` (a slice of the step's B) in the form the model and the loss take.

    inputs: (input_ids, attention_mask (padded [b, L], shared 4-D) or None (packed),
    logits_to_keep: int T or positions [N]); position_ids: [b, L] or [R, W]; mask: [b, T] float
    (padded) or None (packed and shared: every kept token counts); packed: the PackedBatch of
    packed and shared rows, else None; boundaries: flash attention's cu_seq_lens_* and
    max_length_* of packed rows, where the model's attention is a flash implementation. Per-token
    values of the step ([B, T]) are taken with `tokens(x)`: [b, T] padded, [N] otherwise."""

    seqs: slice
    inputs: tuple
    position_ids: torch.Tensor
    mask: torch.Tensor | None
    packed: PackedBatch | None
    completion_mask: torch.Tensor  # [b, T] as generated, for token counts
    boundaries: dict = field(default_factory=dict)

    @property
    def model_kwargs(self) -> dict:
        """The keywords the model's forward takes besides input_ids and attention_mask."""
        return dict(position_ids=self.position_ids, **self.boundaries)

    @property
    def num_seqs(self) -> int:
        return self.seqs.stop - self.seqs.start

    @property
    def num_loss_tokens(self) -> float:
        return self.completion_mask.sum().item()

    @property
    def cu_seqlens(self) -> torch.Tensor | None:
        return None if self.packed is None else self.packed.cu_seqlens

    def tokens(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """A per-token value of the step [B, T] -> this micro-batch's form."""
        if x is None:
            return None
        x = x[self.seqs]
        return x if self.packed is None else self.packed.pack(x)


def sequence_costs_of(attention_mask, completion_mask, T: int) -> torch.Tensor:
    """[b] real tokens of each sequence: its prompt tokens plus kept completion tokens."""
    return attention_mask[:, :-T].sum(dim=1) + completion_mask.sum(dim=1)


def sequence_costs(batch: dict, layout: RowLayout) -> list[int]:
    """Tokens one forward spends on each sequence: padded, the full row Lp + T; packed (and, as
    an upper bound, shared), its real tokens."""
    if layout is RowLayout.PADDED:
        return [batch["input_ids"].shape[1]] * batch["input_ids"].shape[0]
    return sequence_costs_of(batch["attention_mask"], batch["completion_mask"],
                             batch["T"]).tolist()


def cut(costs: list[int], micro_batch_size: int, max_tokens: int) -> list[slice]:
    """Contiguous chunks: `micro_batch_size` sequences each, or with `max_tokens` > 0 as many
    sequences as fit the budget (a sequence longer than the budget goes alone)."""
    B = len(costs)
    if max_tokens <= 0:
        size = micro_batch_size or B
        return [slice(i, min(i + size, B)) for i in range(0, B, size)]
    chunks, start, used = [], 0, 0
    for i, c in enumerate(costs):
        if i > start and used + c > max_tokens:
            chunks.append(slice(start, i))
            start, used = i, 0
        used += c
    chunks.append(slice(start, B))
    return chunks


def split_to(chunks: list[slice], n: int) -> list[slice]:
    """Split the chunks holding the most sequences in two until there are `n` (n <= B)."""
    chunks = list(chunks)
    while len(chunks) < n:
        i = max(range(len(chunks)), key=lambda j: chunks[j].stop - chunks[j].start)
        s = chunks[i]
        if s.stop - s.start < 2:
            raise ValueError(f"cannot make {n} micro-batches of {chunks[-1].stop} sequences")
        mid = (s.start + s.stop) // 2
        chunks[i:i + 1] = [slice(s.start, mid), slice(mid, s.stop)]
    return chunks


def batch_sizes(cfg, world: int, say=None) -> tuple[int, int, int]:
    """(P_local prompts per process, B = P_local·G sequences per process, sequences per
    micro-batch) of a run with `world` processes; a one-line error for sizes that do not divide.
    An automatic --micro_batch_size (None) is the largest divisor of B up to AUTO's cap (0: the
    whole batch), said with `say` when below the cap; a value given must divide B."""
    G = cfg.num_generations
    if cfg.num_prompts % world:
        raise UsageError(f"--num_prompts {cfg.num_prompts} must be divisible by the number of "
                         f"processes ({world}): every process takes whole groups")
    P_local = cfg.num_prompts // world
    B = P_local * G
    if cfg.micro_batch_size is None:
        return P_local, B, _auto_micro(cfg, P_local, B, say)
    micro = cfg.micro_batch_size or B  # sequences per micro-batch, unless a token budget
    if B % micro and not cfg.max_tokens_per_microbatch:
        raise UsageError(f"--micro_batch_size {micro} must divide the per-process batch "
                         f"num_prompts/processes x num_generations = {P_local} x {G} = {B}: "
                         f"pass a divisor of {B}, or 0 for the whole batch")
    return P_local, B, micro


def _auto_micro(cfg, P_local: int, B: int, say) -> int:
    """The automatic micro-batch size: the largest divisor of B up to the cap (a cap of 0, or
    one of B or more: B). A token budget cuts the micro-batches instead, so the cap stands."""
    cap = auto_value(cfg, "micro_batch_size")
    if not cap or cap >= B:
        return B
    if cfg.max_tokens_per_microbatch:
        return cap
    micro = max(d for d in range(1, cap + 1) if B % d == 0)
    if micro < cap and say is not None:
        say(f"micro-batches: {micro} sequences each, the largest divisor up to the automatic "
            f"{cap} of the per-process batch num_prompts/processes x num_generations = "
            f"{P_local} x {cfg.num_generations} = {B} (--micro_batch_size sets it)")
    return micro


def micro_batches(batch: dict, layout: RowLayout | str, micro_batch_size: int, max_tokens: int,
                  agree=None, model_config=None) -> list[MicroBatch]:
    """The step's micro-batches. batch: `generation.generate`'s dict (input_ids, attention_mask
    [B, Lp + T], completion_mask [B, T], T); layout: a RowLayout (or its name). agree(n) -> the
    count every process uses (the maximum over processes); None for one process. model_config:
    the model's config, whose attention implementation sets the rows' width
    (`grpo_kernels.hf.choose_row_width`), the shared rows' mask and the flash boundaries (None:
    rows as wide as the longest sequence, a boolean mask)."""
    layout = parse_row_layout(layout)
    chunks = cut(sequence_costs(batch, layout), micro_batch_size, max_tokens)
    if agree is not None and max_tokens > 0:  # sequence-count chunks are the same everywhere
        chunks = split_to(chunks, agree(len(chunks)))
    ids, attn, mask, T = (batch["input_ids"], batch["attention_mask"],
                          batch["completion_mask"], batch["T"])
    out = []
    for s in chunks:
        if layout is RowLayout.PADDED:
            out.append(MicroBatch(s, (ids[s], attn[s], T), position_ids(attn[s]),
                                  mask[s].float(), None, mask[s]))
            continue
        rows = plan_rows(ids[s], attn[s], T, mask[s], layout, model_config)
        kwargs = row_inputs(rows, model_config)
        out.append(MicroBatch(s, (rows.input_ids, rows.attention_mask, rows.logits_to_keep),
                              kwargs.pop("position_ids"), None, rows, mask[s], kwargs))
    return out
