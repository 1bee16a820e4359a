"""Token layouts: where each token of a loss's batch sits, padded [B, T] or packed (padding-free).

(Formerly layouts.py. These are the layouts of the loss's per-token values; the layout of the
rows a model's forwards take is `grpo_kernels.hf.RowLayout`, a separate choice: packed or shared
rows both reach the loss as packed tokens.)

A packed batch lays its S sequences end to end, N tokens in all, with the flash-attention
convention `cu_seqlens` [S + 1]: sequence s holds tokens cu_seqlens[s]:cu_seqlens[s+1]. It
equals the padded batch whose row s holds those tokens (mask 1) followed by padding (mask 0).

`grpo_math` states every formula once and asks a layout for the few operations that depend on
where tokens sit. In both layouts a per-sequence value is a column [S, 1] (S = B when padded);
a per-token value is [B, T] when padded and [N] when packed:

    seq_sum(x)    per-token -> per-sequence sum, [S, 1]
    expand(x)     per-sequence -> per-token where broadcasting cannot do it (packed only)
    align(*xs)    a common shape for values that meet elementwise
    per_sequence  whether a value has one entry per sequence (metrics average those over S)
    flat(x)       per-token [N] contiguous, for the kernels' epilogue (in packed order)

The packed layout uses segment reductions over each token's sequence id (index_add, which is
deterministic on CUDA under torch.use_deterministic_algorithms); nothing is padded, so no work
is spent on padding and nothing has a data-dependent shape (torch.compile traces it as is).
"""

from __future__ import annotations

import torch


def seq_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The sequence of every packed token: cu_seqlens [S + 1] (validated) -> [N] int64.

    searchsorted finds, for token n, how many sequence ends are <= n; a zero-length sequence
    (equal consecutive entries) owns no token and is skipped."""
    ends = cu_seqlens[1:].to(torch.int64)
    n = torch.arange(num_tokens, device=cu_seqlens.device, dtype=torch.int64)
    return torch.searchsorted(ends, n, right=True)


class PaddedLayout:
    """The padded token layout: rows of T positions, mask 0 at padding: per-token [B, T],
    per-sequence [B, 1]. Every method is the plain [B, T] operation, so padded results are what
    they always were."""

    def __init__(self, mask: torch.Tensor):
        self.shape = tuple(mask.shape)  # (B, T)
        self.num_seqs = self.shape[0]

    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True)

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        return x  # [B, 1] broadcasts against [B, T]

    def align(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return xs

    def per_sequence(self, x: torch.Tensor) -> bool:
        # T = 1 makes a per-token value look per-sequence: the edge case of docs/semantics.md
        return x.shape[-1] == 1

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        return torch.broadcast_to(x, self.shape).reshape(-1).contiguous()


class PackedLayout:
    """The packed token layout, S sequences end to end: per-token [N], per-sequence [S, 1].
    seq_ids [N] is computed once per loss call; a zero-length sequence is a fully masked padded
    row (it counts in S)."""

    def __init__(self, cu_seqlens: torch.Tensor, num_tokens: int):
        self.num_seqs = cu_seqlens.shape[0] - 1
        self.seq_ids = seq_ids(cu_seqlens, num_tokens)

    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(self.num_seqs)
        return out.index_add(0, self.seq_ids, x.reshape(-1)).unsqueeze(-1)

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1)[self.seq_ids] if self.per_sequence(x) else x

    def align(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if all(self.per_sequence(x) for x in xs):
            return xs  # stays per sequence (the clip flags of GSPO are averaged over S)
        return tuple(self.expand(x) for x in xs)

    def per_sequence(self, x: torch.Tensor) -> bool:
        return x.dim() == 2  # [S, 1]; per-token values are [N] even when S = N

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        return self.expand(x).contiguous()


def layout_of(mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
    """The token layout of validated per-token inputs: packed when cu_seqlens is given (mask
    [N]), else padded (mask [B, T])."""
    if cu_seqlens is None:
        return PaddedLayout(mask)
    return PackedLayout(cu_seqlens, mask.shape[0])
