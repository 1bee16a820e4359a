"""Forced completion lengths, for benchmarks: every `generate` call inside `forced_lengths`
(or given a run state's `forced_lengths`) ends sequence i after exactly L_i tokens, on every
generation path, so that timings are taken on realistic lengths (random weights never stop on
their own). The padded and static paths apply them with `EosSchedule`, a logits processor;
continuous batching with the same lengths (`continuous.py`)."""

from __future__ import annotations

import contextlib
import math

import torch

_forced_draw = None  # the `forced_lengths` hook in effect outside a run that names its own


@contextlib.contextmanager
def forced_lengths(draw):
    """Force completion lengths in every `generate` call inside the block (the trainer's too).

    draw(B) -> B ints, one per sequence of the call in batch order (the G completions of prompt 0
    first): sequence i samples with EOS banned for its first L_i - 1 tokens and then emits EOS
    (eos_ids[0]) as token L_i, so its completion is exactly L_i tokens; L_i above
    max_new_tokens gives a truncated completion of max_new_tokens tokens. It overrides
    min_new_tokens. A run state's (or GenerationSetup's) `forced_lengths = draw` does the same
    for the calls given that run."""
    global _forced_draw
    previous, _forced_draw = _forced_draw, draw
    try:
        yield
    finally:
        _forced_draw = previous


class EosSchedule:
    """The padded path's form of forced lengths, a logits processor for `model.generate`:
    scores [B, V] of the token at completion index t = input_ids.shape[1] - Lp.

    Its masks are built on the scores' device on the first call (again only if the device,
    dtype or vocabulary changes): built per call, the lengths' copy to a GPU and the EOS ids
    turned into an index there were host-to-device copies, each a host synchronization, in
    every decode step of every forced-length benchmark."""

    def __init__(self, lengths: torch.Tensor, eos_ids: list[int], prompt_len: int):
        self.lengths, self.eos_ids, self.prompt_len = lengths, eos_ids, prompt_len  # [B]
        self._masks = None  # ((device, dtype, V), last [B, 1], is_eos [V], only_eos [V])

    def _device_masks(self, scores: torch.Tensor):
        """(last [B, 1]: the completion index of each row's forced EOS, is_eos [V] bool,
        only_eos [V]: 0 at eos_ids[0], -inf elsewhere), on the scores' device."""
        key = (scores.device, scores.dtype, scores.shape[1])
        if self._masks is None or self._masks[0] != key:
            device, V = scores.device, scores.shape[1]
            last = (torch.as_tensor(self.lengths).to(device) - 1).unsqueeze(1)
            ids = torch.tensor(self.eos_ids, dtype=torch.long, device=device)
            is_eos = torch.zeros(V, dtype=torch.bool, device=device).index_fill_(0, ids, True)
            only_eos = torch.full((V,), -math.inf, dtype=scores.dtype, device=device)
            only_eos[self.eos_ids[0]] = 0.0
            self._masks = (key, last, is_eos, only_eos)
        return self._masks[1:]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1] - self.prompt_len
        last, is_eos, only_eos = self._device_masks(scores)
        scores = scores.masked_fill((t < last) & is_eos, -math.inf)
        return torch.where(t == last, only_eos, scores)


def lengths_to_force(run, B: int, max_new_tokens: int) -> list[int] | None:
    """The B lengths to force in this call (capped at max_new_tokens + 1), or None."""
    draw = run.forced_lengths if run.forced_lengths is not None else _forced_draw
    if draw is None:
        return None
    lengths = [int(n) for n in draw(B)]
    if len(lengths) != B or min(lengths) < 1:
        raise ValueError(f"forced_lengths: expected {B} lengths >= 1, got {lengths}")
    return [min(n, max_new_tokens + 1) for n in lengths]  # beyond the cap: truncated anyway
